#!/usr/bin/env bash
# The virtual environment .venv from requirements.txt (torch pinned to the local CPU wheel). Built on
# first use and rebuilt only when requirements.txt or python3's version changes, so running the tests
# never pulls the environment from under a running app. The stamp is written only after a successful
# install: an interrupted or failed one leaves none, and the next run rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp_file=.venv/.requirements.sha256
stamp="$(sha256sum requirements.txt | cut -d' ' -f1) $(python3 --version 2>&1)"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
  exit 0
fi
rm -rf .venv
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
printf '%s\n' "$stamp" >"$stamp_file"
