"""One person, one token (issue 55), in a real browser on the real server (``python -m lab.serve``
on loopback, a ``--token-file`` of ``name token`` lines): two people sign in with their own tokens,
each makes a run, the history and the files they download say who asked, and each may delete only
their own run. The server's log names no token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import free_port, wait_healthy
from playwright.sync_api import expect
from test_browser import (
    ARTIFACTS,
    LAYER_REGEX,
    ROOT,
    RUN_COUNTER,
    SLOW_MS,
    _choose,
    _download,
    _go,
    _no_exception,
    _pick_layers,
    _see,
    _settle,
)

from lab.history.store import HISTORY_DIR, History

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ALICE = "alice-browser-token-0123456789abcdef"
BOB = "bob-browser-token-0123456789abcdef"


@contextmanager
def _team_server(base: Path, token_file: Path) -> Iterator[tuple[str, Path, Path]]:
    """``python -m lab.serve`` on a free loopback port signing people in with ``token_file``: its
    address, its output root and its log (``test-artifacts/team.log``)."""
    port, outputs = free_port(), base / "team-outputs"
    outputs.mkdir()
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port)]
    command += ["--browser.gatherUsageStats", "false", "--server.address", "127.0.0.1"]
    command += ["--data-root", str(base), "--model-root", str(base), "--output-root", str(outputs)]
    command += ["--token-file", str(token_file)]
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "team.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, server)
            yield url, outputs, log_path
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


def _signed_in(browser, url: str, token: str, name: str):
    """A browser of its own (its own cookies) signed in with ``token``, the app showing ``name``."""
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.add_init_script(RUN_COUNTER)
    tab.goto(f"{url}/?token={token}")
    _see(tab, f"Signed in as {name}, with their token")
    return tab


def _label(record) -> str:
    """A run as the Runs page's select box shows it."""
    return f"{record.when[:16].replace('T', ' ')} · {record.who} · {record.model} · {record.formats}"


def _open_run(tab) -> str:
    """The run the Runs page's "Run" select box shows (its first select box)."""
    box = tab.locator('[data-testid="stSelectbox"]').first
    return box.inner_text() + " " + " ".join(field.input_value() for field in box.locator("input").all())


def test_two_people_sign_in_with_their_own_tokens_and_delete_only_their_own_runs(browser, tmp_path):
    token_file = tmp_path / "team-tokens"
    token_file.write_text(f"# who may use this lab\nalice {ALICE}\n\nbob {BOB}\n")
    token_file.chmod(0o600)
    with _team_server(tmp_path, token_file) as (url, outputs, log):
        printed = log.read_text()
        assert "/?token=YOUR-TOKEN (each of the 2 people of the token file with their own token)" in printed
        assert ALICE not in printed and BOB not in printed

        alice = _signed_in(browser, url, ALICE, "alice")
        alice.get_by_role("button", name="Run the demo").click()
        _see(alice, "minilm: 12 tensors")

        bob = _signed_in(browser, url, BOB, "bob")
        _go(bob, "Model")
        bob.get_by_text("Layers to analyse").wait_for(timeout=SLOW_MS)
        _pick_layers(bob, LAYER_REGEX, 3)  # not the demo's layers: a run of his own, not alice's shared
        _go(bob, "Run")
        bob.get_by_role("button", name="Run", exact=True).click()
        _see(bob, "Results for 6 tensors")
        _go(bob, "Choose & export")
        exported = json.loads(_download(bob, "Observer Lab JSON", tmp_path / "bob.json").read_text())
        assert exported["provenance"]["asked_by"] == "bob" and exported["provenance"]["run"]["who"] == "bob"

        history = History(outputs / HISTORY_DIR, 200)
        bobs, alices = history.runs()
        assert (bobs.who, alices.who) == ("bob", "alice")
        kept = json.loads(history.lab_file(alices.id))["provenance"]
        assert kept["asked_by"] == "alice" and kept["run"]["who"] == "alice"

        _go(bob, "Runs")
        _see(bob, "recorded as asked for by bob")
        delete = bob.get_by_role("button", name="Delete")
        assert _label(bobs) in _open_run(bob)  # the newest: his
        expect(delete).to_be_enabled()
        _choose(bob, "Run", _label(alices))
        assert _label(alices) in _open_run(bob)
        expect(delete).to_be_disabled()  # alice's: not his to delete
        _no_exception(bob)

        _go(alice, "Runs")
        delete = alice.get_by_role("button", name="Delete")
        assert _label(bobs) in _open_run(alice)
        expect(delete).to_be_disabled()  # bob's
        _choose(alice, "Run", _label(alices))
        assert _label(alices) in _open_run(alice)
        expect(delete).to_be_enabled()  # her own
        delete.click()
        _see(alice, "Two kept runs are needed")
        _settle(alice)
        assert [record.who for record in history.runs()] == ["bob"]
        _no_exception(alice)
        alice.close()
        bob.close()
