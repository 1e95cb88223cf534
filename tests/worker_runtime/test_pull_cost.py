"""A pull's measured cost (worker_runtime/pull_cost.py): a fixed part and a rate per block,
fitted through the recent pulls, so a small pull's fixed cost is not charged per block."""

import pytest

from worker_runtime.pull_cost import PullCost


def test_the_line_through_pulls_of_different_sizes():
    cost = PullCost()
    for blocks in (10, 100, 40, 200):
        cost.observe(blocks, 0.005 + blocks / 20000)
    assert cost.overhead_s == pytest.approx(0.005, rel=1e-6)
    assert cost.blocks_per_s == pytest.approx(20000, rel=1e-6)


def test_one_size_is_all_fixed_cost_until_a_slope_shows():
    cost = PullCost()
    cost.observe(31, 0.008)
    cost.observe(31, 0.010)
    assert cost.blocks_per_s == 0.0  # unmeasured: the router prices blocks at its default
    assert 0.008 < cost.overhead_s < 0.010


def test_recent_pulls_count_more():
    cost = PullCost()
    for blocks in (10, 100) * 3:
        cost.observe(blocks, 0.2 + blocks / 1000)  # a busy holder: 0.2 s each
    for blocks in (10, 100) * 10:
        cost.observe(blocks, 0.005 + blocks / 20000)  # then an idle one
    assert cost.overhead_s < 0.02 and cost.blocks_per_s > 10000


def test_a_line_below_the_origin_is_all_per_block():
    cost = PullCost()
    cost.observe(10, 0.001)
    cost.observe(100, 0.1)
    assert cost.overhead_s == 0.0
    assert cost.blocks_per_s == pytest.approx(
        (0.8 * 10 + 100) / (0.8 * 0.001 + 0.1)
    )  # the older pull weighs 0.8
