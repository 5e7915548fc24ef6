#!/usr/bin/env bash
# Build .bench-venv with the reference packages (llm-compressor, ModelOpt, Quark), each where it
# installs; bench cases whose reference is missing say so. torch stays on the local 2.13.0 wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .bench-venv
.bench-venv/bin/python -m pip install -q torch==2.13.0
for package in llmcompressor nvidia-modelopt amd-quark; do
  .bench-venv/bin/python -m pip install -q torch==2.13.0 "$package" || echo "warning: $package did not install"
done
