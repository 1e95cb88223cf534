#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite, slow tests included.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# tests/test_compose.py validates compose/ with Debian's docker-compose (no engine needed).
if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
    || echo "warning: could not install docker-compose; the compose test will be skipped" >&2
fi
# tests/router/test_dashboard.py renders /dashboard in Debian's headless chromium.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "warning: could not install chromium; the dashboard browser test will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
