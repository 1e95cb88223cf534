#!/usr/bin/env bash
# One command on a machine with one CUDA GPU: kernel tests on CUDA, attention bandwidth vs copy
# bandwidth, engine throughput (Triton vs torch attention). No network; < 5 minutes.
#   benchmarks/gpu_check.sh              # the real check
#   benchmarks/gpu_check.sh --dry-run    # same code on CPU under the Triton interpreter, tiny shapes
# Extra flags go to benchmarks/gpu_check.py (--skip-pytest, --skip-engine, --json PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec timeout --signal=INT --kill-after=10 290 "$PYTHON" benchmarks/gpu_check.py "$@"
