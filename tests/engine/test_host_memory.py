"""`engine.runner.device.keep_freed_host_memory`: after it, a step's large temporaries are reused
from the heap instead of being mapped and page-faulted afresh; PDSERVE_MALLOC_TUNING=0 and the
user's own malloc settings leave glibc alone. Each case in a fresh process (mallopt is
process-wide)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, json, resource, torch
from engine.runner.device import keep_freed_host_memory
# glibc's starting point, pinned (its dynamic threshold moves with what the process freed so
# far, so the same pattern faults in some runs and not in others): blocks over 128 KiB mapped.
ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)
applied = keep_freed_host_memory()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a layer's activations: several 12 MB tensors written, then all freed
        live = [torch.empty(3 << 20).fill_(1.0) for _ in range(4)]
        del live
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(json.dumps({"applied": applied, "faults": faults()}))
"""


def _probe(**env) -> dict:
    environ = {
        k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")
    }
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_temporaries_are_reused_from_the_heap():
    """From glibc's starting threshold, the same process with and without the setting: every
    page of the probe's blocks faulted afresh each round, then none."""
    tuned = _probe()
    untouched = _probe(PDSERVE_MALLOC_TUNING="0")
    assert tuned["applied"] and not untouched["applied"]
    # 20 rounds of 48 MB written: ~240,000 pages mapped afresh.
    assert untouched["faults"] > 50_000
    assert tuned["faults"] < 2_000


def test_off_by_flag_and_where_the_user_set_malloc_up():
    assert not _probe(PDSERVE_MALLOC_TUNING="0")["applied"]
    assert not _probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")["applied"]
    assert not _probe(MALLOC_ARENA_MAX="2")["applied"]
