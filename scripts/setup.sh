#!/usr/bin/env bash
# Build a fresh virtual environment from requirements.txt (torch pinned to the local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
