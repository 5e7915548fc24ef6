#!/usr/bin/env bash
# Fresh environment, then the app on its default sample model (MiniLM, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 exec .venv/bin/streamlit run app.py "$@"
