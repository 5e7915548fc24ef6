"""What every test process shares: the app's declared roots.

The app serves only paths inside the roots its server was started with (``lab.serve``). The
AppTest tests run ``app.py`` in this process, so they declare the roots as ``scripts/app.sh``
hands them on (``sys.argv`` after ``--``): the test run's temporary folder (where every
``tmp_path`` lies) for data and models, a folder of it for outputs. Each test starts with the
server's settings read anew and no shared results kept from an earlier test.
"""

from __future__ import annotations

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
