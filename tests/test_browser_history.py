"""The team's run history in a real browser on the real server (``python -m lab.serve``, signed in
with its token): a run made before a restart is listed after it, beside one the command line added
(``history add``), and the two compare side by side; a colleague who follows its link (signing in
on the way) sees the same numbers while the server does a fraction of the CPU work the run took,
since nothing is recomputed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_browser import (
    LAYER_REGEX,
    RUN_COUNTER,
    SLOW_MS,
    TOKEN,
    _download,
    _go,
    _no_exception,
    _plots,
    _see,
    _served_app,
    _settle,
    _shot,
    _sign_in,
)

from lab.cli import main

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _cpu_seconds(pid: int) -> float:
    """The user and system CPU time a process (all its threads) has used, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _shown(box) -> str:
    """A select box's label and the option it shows."""
    return box.inner_text() + " " + " ".join(field.input_value() for field in box.locator("input").all())


def _tab(browser):  # noqa: F811
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.add_init_script(RUN_COUNTER)
    return tab


def test_the_history_survives_a_restart_and_a_link_shows_a_colleague_the_same_numbers(browser, tmp_path):  # noqa: F811
    base = tmp_path
    outputs = base / "history-outputs"
    servers: list = []
    with _served_app(base, "history", started=servers) as url:
        tab = _tab(browser)
        _sign_in(tab, url)
        tab.get_by_role("button", name="Run the demo").wait_for(timeout=SLOW_MS)
        _settle(tab)
        before = _cpu_seconds(servers[0].pid)
        tab.get_by_role("button", name="Run the demo").click()
        _see(tab, "minilm: 12 tensors")
        run_cpu = _cpu_seconds(servers[0].pid) - before
        _go(tab, "Choose & export")
        _see(tab, "Run asked for by token on")
        mine = json.loads(_download(tab, "Observer Lab JSON", tmp_path / "mine.json").read_text())
        run_id = mine["provenance"]["run"]["id"]
        tab.close()

    shell = ["run", "minilm", "--layers", LAYER_REGEX, "--format", "int8", "--samples", "4", "--seq-len", "32"]
    assert main([*shell, "--quiet", "--out", str(tmp_path / "shell.json")]) == 0  # work done at the shell
    assert main(["history", "add", str(tmp_path / "shell.json"), "--output-root", str(outputs)]) == 0

    with _served_app(base, "history-again", "--output-root", str(outputs), started=servers) as url:
        tab = _tab(browser)
        _sign_in(tab, url)
        _go(tab, "Runs")
        _see(tab, "They differ in formats")  # the demo (before the restart) against the shell's run
        assert _plots(tab, 3) >= 3  # the figure's bars and each run's ranges
        boxes = [_shown(box) for box in tab.locator('[data-testid="stSelectbox"]').all()]
        assert "cli (" in boxes[0] and "minilm · weight: int8 sym tensor" in boxes[0], boxes  # the newest
        assert "token · minilm · weight: int4 sym group 128" in boxes[1], boxes  # A: the demo
        _no_exception(tab)
        _shot(tab, "30_runs_after_restart")
        tab.locator(".js-plotly-plot").nth(0).scroll_into_view_if_needed()
        _shot(tab, "30_runs_compared")
        tab.locator(".js-plotly-plot").nth(2).scroll_into_view_if_needed()
        _shot(tab, "30_runs_compared_ranges")
        tab.close()

        colleague = _tab(browser)
        colleague.goto(f"{url}/?run={run_id}")  # the link as shared: no token yet
        colleague.get_by_label("Token").wait_for(timeout=SLOW_MS)
        before = _cpu_seconds(servers[1].pid)
        colleague.get_by_label("Token").fill(TOKEN)
        colleague.get_by_role("button", name="Sign in").click()
        _see(colleague, "opened from the team's run history: nothing recomputed")
        open_cpu = _cpu_seconds(servers[1].pid) - before
        assert _plots(colleague, 1) >= 1
        _no_exception(colleague)
        _shot(colleague, "31_run_link_opened")
        _go(colleague, "Choose & export")
        _see(colleague, f"(run {run_id})")
        theirs = json.loads(_download(colleague, "Observer Lab JSON", tmp_path / "theirs.json").read_text())
        colleague.close()
    assert theirs["entries"] == mine["entries"] and theirs["provenance"]["run"] == mine["provenance"]["run"]
    print(f"server CPU: run {run_cpu:.2f} s, open {open_cpu:.2f} s")
    assert open_cpu < run_cpu / 2, f"opening the run took {open_cpu:.2f} s of server CPU, the run {run_cpu:.2f} s"
