#!/usr/bin/env bash
# Fresh environment, lint, then every test (slow and browser tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
