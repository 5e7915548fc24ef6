#!/usr/bin/env bash
# Build the benchmark environment (.bench-venv, or $BENCH_VENV): the project's requirements plus
# the reference implementations of bench/requirements.txt (llm-compressor, ModelOpt, Quark) in ONE
# environment, so that `.bench-venv/bin/python -m bench` times them in the same process as ours,
# on the same tensors. requirements.txt pins nothing but torch, so pip may pick the transformers /
# compressed-tensors versions the references accept. torch==2.13.0 is named in every pip call:
# left free, a reference's resolution would replace the CPU wheel with a CUDA torch (GBs).
# A reference that does not install is reported, not fatal: its benchmark rows say "missing".
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${BENCH_VENV:-.bench-venv}"
pip=("$venv/bin/python" -m pip install --quiet)

if [ -L "$venv" ] && [ ! -e "$venv" ]; then
  echo "note: $venv is a link to a missing $(readlink "$venv"); building a real directory instead" >&2
  rm "$venv"
fi
python3 -m venv "$venv" || exit 1
"${pip[@]}" --upgrade pip || exit 1
if ! "${pip[@]}" torch==2.13.0 -r requirements.txt; then
  echo "error: the project requirements did not install into $venv" >&2
  exit 1
fi

mapfile -t references < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/requirements.txt | grep -v '^$')
# One resolution for all references first (consistent versions); if that fails, each on its own.
if ! "${pip[@]}" torch==2.13.0 -r requirements.txt -r bench/requirements.txt; then
  echo "warning: the references do not install together; trying each on its own" >&2
  for package in "${references[@]}"; do
    log="$(mktemp)"
    if ! "${pip[@]}" torch==2.13.0 -r requirements.txt "$package" >"$log" 2>&1; then
      echo "warning: $package did not install (its rows will say missing); pip said:" >&2
      grep -v 'is ignored: it is neither' "$log" | tail -n 5 >&2
    fi
    rm -f "$log"
  done
fi

"$venv/bin/python" -m pip check || echo "warning: pip check reports conflicts (see above)" >&2
for package in "${references[@]}" compressed-tensors transformers torch; do
  installed="$("$venv/bin/python" -m pip show "$package" 2>/dev/null | sed -n 's/^Version: //p')"
  echo "$package: ${installed:-not installed}"
done
echo "run: $venv/bin/python -m bench --threads 2 --markdown bench.md"
