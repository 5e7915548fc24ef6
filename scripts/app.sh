#!/usr/bin/env bash
# The environment (built on first use, rebuilt when requirements.txt changes), then the app on its
# default sample model (MiniLM, offline). Settings (no file watcher, no Deploy button) are in
# .streamlit/config.toml, read from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE=1 exec .venv/bin/streamlit run app.py "$@"
