"""Tests across two emulated hosts (network namespaces): skipped, with the reason, where
namespaces cannot be made (not root, no iproute2). Helpers of the kvtransfer and e2e tests
are importable here."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for d in (HERE, HERE.parent / "kvtransfer", HERE.parent / "e2e"):
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))

from netns_util import skip_reason  # noqa: E402

_REASON = skip_reason()


def pytest_collection_modifyitems(config, items):
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"network namespace tests: {_REASON}")
    for item in items:
        if str(HERE) in str(item.fspath):
            item.add_marker(skip)
