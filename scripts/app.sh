#!/usr/bin/env bash
# The environment (built on first use, rebuilt when requirements.txt changes), then the app on its
# default sample model (MiniLM, offline). It listens on 127.0.0.1 only (.streamlit/config.toml, read
# from the repository root), asks for a token and prints the address to open with it; serving a team
# is `bash scripts/app.sh --server.address 0.0.0.0` (see docs/guides/serving-a-team.md: --auth token,
# oidc or none). The app's own flags (--auth, --data-root, --model-root, --output-root, --heavy-runs,
# --shared-cache) go beside Streamlit's; a declared root that does not exist stops it.
# Hub ids typed in a browser are refused unless it is started with HF_HUB_OFFLINE=0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" exec .venv/bin/python -m lab.serve "$@"
