"""benchmarks/vs_vllm.py's served schedule and summary, without servers: the order of turns, the
seeds, medians over rounds and the ratios to vLLM."""

from vs_vllm import Metrics, median, schedule, summary


def test_sides_take_turns_in_an_order_reversed_every_other_round():
    turns = schedule(["pdserve", "split", "vllm"], [0.5, 2.0], repeats=3)
    assert [(t.rate, t.round, t.side) for t in turns] == [
        (0.5, 0, "pdserve"),
        (0.5, 0, "split"),
        (0.5, 0, "vllm"),
        (0.5, 1, "vllm"),
        (0.5, 1, "split"),
        (0.5, 1, "pdserve"),
        (0.5, 2, "pdserve"),
        (0.5, 2, "split"),
        (0.5, 2, "vllm"),
        (2.0, 0, "pdserve"),
        (2.0, 0, "split"),
        (2.0, 0, "vllm"),
        (2.0, 1, "vllm"),
        (2.0, 1, "split"),
        (2.0, 1, "pdserve"),
        (2.0, 2, "pdserve"),
        (2.0, 2, "split"),
        (2.0, 2, "vllm"),
    ]


def test_a_seed_per_rate_and_round_the_same_on_every_side_never_the_warmups():
    turns = schedule(["pdserve", "vllm"], [0.5, 1.0, 2.0], repeats=2)
    seeds = {
        (t.rate, t.round): {u.seed for u in turns if (u.rate, u.round) == (t.rate, t.round)}
        for t in turns
    }
    assert all(len(s) == 1 for s in seeds.values())  # the same prompts on both sides
    per_run = [s.pop() for s in seeds.values()]
    assert len(set(per_run)) == len(per_run) == 6  # no side sees a run's prompts twice
    assert 0 not in per_run  # 0 is the warm-up's


def _m(ttft_p99: float, itl_p99: float, goodput: float = 1.0) -> Metrics:
    return Metrics(100.0, ttft_p99, 50.0, itl_p99, 1.0, goodput)


def test_median_is_per_field_over_rounds():
    assert median([_m(300, 90), _m(100, 30), _m(200, 60)]) == _m(200, 60)
    assert median([_m(100, 30, 0.5), _m(300, 90, 1.5)]) == _m(200, 60, 1.0)


def test_summary_without_vllm_has_medians_and_no_ratios():
    results = {
        ("pdserve", 1.0): [_m(100, 30), _m(300, 50)],
        ("split", 1.0): [_m(400, 20), _m(600, 40)],
    }
    lines = summary(results, ["pdserve", "split"], [1.0])
    assert len(lines) == 2 and lines[0].startswith("pdserve") and lines[1].startswith("split")
    assert "/    200 ms" in lines[0] and "/    500 ms" in lines[1]


def test_summary_ratios_are_of_the_medians_and_per_round():
    results = {
        ("pdserve", 1.0): [_m(100, 30), _m(300, 50)],
        ("vllm", 1.0): [_m(400, 100), _m(400, 20)],
    }
    lines = summary(results, ["pdserve", "vllm"], [1.0])
    assert lines[2].startswith("ratios to vLLM")
    ratios = lines[3]
    assert ratios.startswith("pdserve")
    assert "TTFT p50 1.00x p99 0.50x" in ratios and "ITL p50 1.00x p99 0.67x" in ratios
    assert "per round TTFT p99 0.25x 0.75x, ITL p99 0.30x 2.50x" in ratios
