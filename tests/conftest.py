"""What every test process shares: the app's declared roots.

The app serves only paths inside the roots its server was started with (``lab.serve``). The
AppTest tests run ``app.py`` in this process, so they declare the roots as ``scripts/app.sh``
hands them on (``sys.argv`` after ``--``): the test run's temporary folder (where every
``tmp_path`` lies) for data and models, a folder of it for outputs. Each test starts with the
server's settings read anew and no shared results kept from an earlier test.

The browser tests share one Chromium a module: Debian's, found on the PATH (the README's test
command installs it, ``scripts/chromium.sh``), driven by Playwright.
"""

from __future__ import annotations

import shutil
import sys

import pytest


@pytest.fixture(autouse=True)
def served_roots(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.getbasetemp()
    outputs = base / "served-outputs"
    outputs.mkdir(exist_ok=True)
    argv = ["app.py", "--data-root", str(base), "--model-root", str(base), "--output-root", str(outputs)]
    monkeypatch.setattr(sys, "argv", argv)
    serving = sys.modules.get("lab.ui.serving")
    if serving is not None:
        serving.served.clear()
        serving.shared_runs.clear()
        serving.history.clear()
    return outputs


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("chromium is not installed: `bash scripts/test.sh` installs it (scripts/chromium.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()
