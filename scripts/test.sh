#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite, slow tests included.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
