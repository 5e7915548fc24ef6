#!/usr/bin/env bash
# The environment (built on first use, rebuilt when requirements.txt changes), Chromium for the
# browser tests (installed from Debian's packages when missing), lint, then every test (slow and
# browser tests included). It leaves an up-to-date .venv alone, so a running app keeps working.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/chromium.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
