"""Screenshots of every page of the app, made by the app itself: the docs' pictures stay true to what
a person sees, and are remade with one command when a page changes.

Run from anywhere: ``.venv/bin/python scripts/screenshots.py [--out docs/images] [--pages run ranges]``.

It starts the real app as ``scripts/app.sh`` does (``python -m lab.serve``, on 127.0.0.1 and a free
port, signed in with a token, on the default sample model, offline), drives it in headless Chromium
through Playwright (Debian's ``chromium`` on the PATH, as the browser tests use), walks the pages in
the order a person does (Model, then Run with the Run button pressed, then the pages that read that
run) and writes ``<out>/<page>.png`` at a fixed viewport for each page asked for. Each shot waits
until Streamlit has finished the page's script run (its ``data-test-script-state``) and the page's
plots have been drawn.

The server gets a temporary folder of its own (its token file, output root with the run history,
upload folders and log), removed afterwards, so the only files left behind are the PNGs under
``--out``; the server is stopped (its whole process group, SIGTERM then SIGKILL) whatever happens.
Nothing here reads the terminal or relies on SIGINT, so it runs the same under CI or a test.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "images"
VIEWPORT = {"width": 1400, "height": 900}
"""Every shot's size: wide enough for the app's wide layout, short enough that the top of each page
(its controls and first plot) is what the picture shows."""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
SLOW_MS = 600_000
"""The longest a step may take: the Run on a busy 2-core machine takes minutes, not seconds."""
UNSEEN_RUN_MS = 20_000
"""How long to wait to see the rerun an action started finish; a rerun too short to show as running
is over by then (as ``tests/test_browser.py`` waits)."""
SETTLE_S = 1.5
"""A last pause after the script run ends and the plots exist: Plotly and the data frames finish
their layout (and fonts load) after Streamlit marks the run over."""
RUN_COUNTER = """
window.__finishedRuns = 0;
new MutationObserver((records) => {
  records.forEach((record, i) => {
    const next = records.slice(i + 1).find((later) => later.target === record.target);
    const now = next ? next.oldValue : record.target.getAttribute("data-test-script-state");
    if (now === "notRunning" && record.oldValue !== "notRunning") window.__finishedRuns += 1;
  });
}).observe(document, {subtree: true, attributes: true, attributeOldValue: true,
                      attributeFilter: ["data-test-script-state"]});
"""
"""Counts the script runs the tab has seen finish (Streamlit's root element carries the run state);
installed before the app loads, so no run is missed however short."""
IDLE = """(after) => window.__finishedRuns > after &&
  document.querySelector('[data-testid="stApp"]')?.getAttribute("data-test-script-state") === "notRunning" &&
  !document.querySelector('[data-testid="stSpinner"]')
"""

TO_TOP = """() => { document.querySelectorAll('[data-testid="stMain"], [data-testid="stAppViewContainer"]')
  .forEach((e) => { e.scrollTop = 0; }); window.scrollTo(0, 0); }"""
TO_ELEMENT = """(e) => e.scrollIntoView({block: "start"})"""


@dataclass(frozen=True)
class Page:
    """One page of the app: its file stem in ``pages/`` (the PNG's name), its title in the sidebar,
    whether it shows anything before a run, and what to do on it before the shot."""

    name: str
    title: str
    needs_run: bool
    action: Callable[[Any], None] | None = None
    focus: str | None = None
    """Text to scroll to the top of the picture (what the action made); None: the top of the page."""


HELD_OUT = ("8", "32")
"""Held-out sentences and tokens per sentence for Model effect and Allocate: their defaults (64 of
128) make each a run of several minutes on a small machine, for the same kind of figure."""


def _fill(tab: Any, label: str, value: str) -> None:
    """Type ``value`` into the box labelled ``label`` and wait for the rerun it starts."""
    box = tab.get_by_label(label, exact=True)
    box.wait_for(timeout=SLOW_MS)
    if box.input_value() == value:
        return
    after = _runs(tab)
    box.fill(value)
    box.press("Enter")
    _settle(tab, after)


def _press(tab: Any, button: str, shown: str) -> None:
    """Press ``button`` and wait until ``shown`` is on the page and the run is over."""
    after = _runs(tab)
    tab.get_by_role("button", name=button).click()
    tab.get_by_text(shown).first.wait_for(timeout=SLOW_MS)
    _settle(tab, after)


def _measure_sensitivity(tab: Any) -> None:
    """Model effect: the per-layer sensitivity heatmap is what the page is for; it needs one press."""
    _fill(tab, "Held-out windows (decoders) or sentences (encoders)", HELD_OUT[0])
    _fill(tab, "Tokens per window or sentence", HELD_OUT[1])
    _press(tab, "Measure sensitivity", "one-tensor runs")


def _allocate(tab: Any) -> None:
    """Allocate: the frontier is what the page is for; Score and allocate with the page's schemes and
    budgets, on ``HELD_OUT``."""
    tab.get_by_text("Scoring: observers, held-out text, metric, calibration").click()
    _fill(tab, "Held-out windows (decoders) or sentences (encoders), per part", HELD_OUT[0])
    _fill(tab, "Tokens per window or sentence", HELD_OUT[1])
    _press(tab, "Score and allocate", "Measured (measuring part) against predicted")


PAGES = (
    Page("overview", "Overview", needs_run=True),
    Page("model", "Model", needs_run=False),
    Page("run", "Run", needs_run=True),
    Page("ranges", "Ranges", needs_run=True),
    Page("scales", "Scales", needs_run=True),
    Page("error", "Error", needs_run=True),
    Page("export", "Choose & export", needs_run=True),
    Page("effect", "Model effect", needs_run=True, action=_measure_sensitivity, focus="one-tensor runs"),
    Page("allocate", "Allocate", needs_run=False, action=_allocate, focus="Frontier"),
    Page("runs", "Runs", needs_run=True),
)
"""In the app's navigation order (``app.py``). The Overview is shot last, with the run's heatmap."""
BY_NAME = {page.name: page for page in PAGES}


def free_port() -> int:
    """A port nothing listens on now, on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Wait until the server answers its health check; fail with its log if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the app exited with code {server.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the app did not answer on {url} within {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(server: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop the server and everything it started: SIGTERM to its process group, SIGKILL after
    ``grace`` seconds, and wait for it, so no app is left listening (no terminal, no SIGINT needed)."""
    if server.poll() is None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            server.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # what of the group outlived the server, or the server itself
    except ProcessLookupError:
        pass
    server.wait()


Started = Callable[[subprocess.Popen, str], None]
"""Told of the server once it is started: its process and its address (without the token)."""


@contextmanager
def served_app(work: Path, on_start: Started | None = None) -> Iterator[str]:
    """The app as ``scripts/app.sh`` serves it (``python -m lab.serve``: loopback, token sign-in,
    MiniLM preselected, offline) on a free port, in a process group of its own, with its token file,
    output root, temporary folder and log (``work/app.log``) under ``work``. Yields the address to
    open, with the token; stops the server on the way out, whatever happened."""
    token = secrets.token_urlsafe(24)
    (work / "token").write_text(token)
    outputs, tmp = work / "outputs", work / "tmp"
    outputs.mkdir()
    tmp.mkdir()
    log = work / "app.log"
    port = free_port()
    command = [sys.executable, "-m", "lab.serve", "--server.address", "127.0.0.1", "--server.port", str(port)]
    command += ["--server.headless", "true", "--browser.gatherUsageStats", "false"]
    command += ["--output-root", str(outputs), "--token-file", str(work / "token")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        server = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if on_start is not None:
            on_start(server, url)
        _wait_healthy(url, server, log)
        yield f"{url}/?token={token}"
    finally:
        stop(server)


def _runs(tab: Any) -> int:
    return tab.evaluate("window.__finishedRuns")


def _settle(tab: Any, after: int = -1) -> None:
    """Wait until the app runs no script and shows no spinner. ``after``: the number of finished runs
    read before an action, so the idle page of before it does not count."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    try:
        tab.wait_for_function(IDLE, arg=after, timeout=UNSEEN_RUN_MS)
    except PlaywrightTimeoutError:  # a rerun too short to show in the run-state attribute is over too
        tab.wait_for_function(IDLE, arg=-1, timeout=SLOW_MS)


def _go(tab: Any, title: str) -> None:
    """Open the page ``title`` from the sidebar and wait until its script run is over."""
    after = _runs(tab)
    tab.locator('[data-testid="stSidebarNav"]').get_by_text(title, exact=True).click()
    tab.get_by_role("heading", name=title, exact=True).first.wait_for(timeout=SLOW_MS)
    _settle(tab, after)


def _run_suite(tab: Any) -> None:
    """Run's button with the page's defaults, on the Model page's default layers, waiting for its
    results."""
    _go(tab, "Run")
    after = _runs(tab)
    tab.get_by_role("button", name="Run", exact=True).click()
    tab.get_by_text("Results for").first.wait_for(timeout=SLOW_MS)
    _settle(tab, after)


def _shoot(tab: Any, page: Page, out: Path) -> Path:
    """Open ``page`` (unless it is open), do its action, wait for its plots, and write its PNG."""
    heading = tab.get_by_role("heading", name=page.title, exact=True)
    if heading.count() == 0:
        _go(tab, page.title)
    if page.action is not None:
        page.action(tab)
    plots = tab.locator(".js-plotly-plot")
    for index in range(plots.count()):
        plots.nth(index).locator(".main-svg").first.wait_for(state="attached", timeout=SLOW_MS)
    _settle(tab)
    if page.focus is None:
        tab.evaluate(TO_TOP)
    else:
        tab.get_by_text(page.focus, exact=page.focus == "Frontier").first.evaluate(TO_ELEMENT)
    tab.mouse.move(0, VIEWPORT["height"] - 1)  # no hover label or tooltip in the picture
    time.sleep(SETTLE_S)
    errors = tab.locator('[data-testid="stException"], [data-testid="stAlertContentError"]').all_inner_texts()
    if errors:
        print(f"warning: the {page.title} page shows an error: {' | '.join(errors)[:500]}", file=sys.stderr)
    target = out / f"{page.name}.png"
    tab.screenshot(path=str(target))
    return target


def _page_state(tab: Any) -> str:
    """What the page shows, for a failure message: its error boxes and the end of its text."""
    try:
        boxes = tab.locator('[data-testid="stException"], [data-testid="stAlertContentError"]').all_inner_texts()
        text = " ".join(tab.locator('[data-testid="stMain"]').inner_text(timeout=5_000).split())
    except Exception as err:  # the browser itself went away: say so rather than hide the first failure
        return f"(the page could not be read: {err})"
    return f"errors shown: {boxes}; the page's text ends: ...{text[-800:]}"


def shoot(names: Sequence[str], out: Path, on_start: Started | None = None) -> list[Path]:
    """Start the app, shoot the pages ``names`` (file stems of ``pages/``) into ``out`` and stop the
    app. The Run button is pressed first when any of them reads a run. Returns the PNGs written."""
    executable = shutil.which("chromium")
    if executable is None:
        raise RuntimeError("chromium is not installed: `bash scripts/chromium.sh` installs it")
    from playwright.sync_api import sync_playwright

    wanted = [page for page in PAGES if page.name in set(names)]
    before = [page for page in wanted if not page.needs_run and page.name != "overview"]
    after = [page for page in wanted if page.needs_run and page.name != "overview"]
    after += [page for page in wanted if page.name == "overview"]  # the heatmap of the run, once all else is shot
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="observer-lab-screenshots-") as work:
        with served_app(Path(work), on_start) as url, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
            tab = browser.new_page(viewport=VIEWPORT)
            try:
                tab.add_init_script(RUN_COUNTER)
                tab.goto(url)
                tab.set_default_timeout(SLOW_MS)
                tab.get_by_text("Observer Lab").first.wait_for()
                _settle(tab)
                _go(tab, "Model")  # opens the default sample and selects its default layers, which all else reads
                tab.get_by_text("Layers to analyse").wait_for()
                for page in before:
                    written.append(_shoot(tab, page, out))
                    print(f"wrote {written[-1]}", flush=True)
                if after:
                    _run_suite(tab)
                for page in after:
                    written.append(_shoot(tab, page, out))
                    print(f"wrote {written[-1]}", flush=True)
            except Exception as err:
                state, log = _page_state(tab), _tail(Path(work) / "app.log")
                raise RuntimeError(f"{err}\n{state}\nthe app's log ends:\n{log}") from err
            finally:
                browser.close()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="scripts/screenshots.py")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for <page>.png (default docs/images)")
    parser.add_argument(
        "--pages",
        nargs="+",
        choices=list(BY_NAME),
        default=list(BY_NAME),
        metavar="PAGE",
        help=f"pages to shoot (default all): {', '.join(BY_NAME)}",
    )
    args = parser.parse_args(argv)

    def started(server: subprocess.Popen, url: str) -> None:
        print(f"app: pid {server.pid} on {url}", flush=True)

    try:
        shoot(args.pages, args.out.resolve(), started)
    except Exception as err:  # the message and exit 1: a traceback of the driver says nothing more
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
