#!/usr/bin/env bash
# Issue 20's GPU work in one command, on a machine with one CUDA GPU and no network
# (tools/gpu/gpu_check.py says what it measures; docs/gpu.md how to run it):
#   python tools/gpu/gpu_bundle.py         # first, here: .gpu_bundle/ (what the GPU image lacks)
#   tools/gpu/gpu_check.sh --out "$OUT"    # there, with .gpu_bundle carried: < 8 minutes
#   tools/gpu/gpu_check.sh --dry-run       # here: the same code on CPU, tiny shapes
# Flags go to tools/gpu/gpu_check.py (--skip-pytest/engine/transfer/pd, --budget-s, --model).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# The bundle's packages (nixl, etcd, pinned grpcio/protobuf) go first on the path; the repo
# itself is imported from here, not installed.
case " $* " in *" --dry-run "*) DRY=1 ;; *) DRY=0 ;; esac
if [ -f .gpu_bundle/site.tar.xz ] && [ "$DRY" = 0 ]; then
    SITE=${TMPDIR:-/tmp}/pdserve-gpu-site
    rm -rf "$SITE" && mkdir -p "$SITE"
    tar -xJf .gpu_bundle/site.tar.xz -C "$SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    unset NIXL_PLUGIN_DIR  # when set, NIXL looks for its plugins only there
    # UCX's CUDA memory hooks need libcudart: the one beside the image's torch, if any.
    CUDART_DIR=$("$PYTHON" -c "import glob, os, site; print(next((os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/**/libcudart.so.*', recursive=True)), ''))" 2>/dev/null || true)
    if [ -n "$CUDART_DIR" ]; then export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# GPU_CHECK_KILL_S: the hard limit (default 500 s; give --budget-s about 30 s less).
exec timeout --signal=INT --kill-after=10 "${GPU_CHECK_KILL_S:-500}" "$PYTHON" tools/gpu/gpu_check.py "$@"
