#!/usr/bin/env bash
# Debian's chromium for the browser tests (Playwright drives it; its own browser download needs a
# network the test machines lack). Installed with apt-get when `chromium` is not on the PATH: as
# root directly, else through sudo when it asks no password. When it cannot be installed this says
# so in one line and the browser tests fail naming it, rather than the suite pretending they ran.
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [[ "$(id -u)" == 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "warning: chromium is missing and this user cannot install it (apt-get install -y chromium as root)" >&2
  exit 0
fi
echo "installing Debian's chromium for the browser tests" >&2
if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install -y -qq chromium >/dev/null; }; then
  echo "warning: apt-get could not install chromium; the browser tests will fail" >&2
fi
