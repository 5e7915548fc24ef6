"""A server a team shares (issue 32): sessions pressing "Run the demo" at once, and the memory a
server keeps after sessions end.

Each case starts the app as ``scripts/app.sh`` does (``python -m lab.serve``, loopback, offline, a
2 s reconnect window, roots in a temporary folder) and drives headless Chromium tabs (Debian's
``chromium``, through Playwright) against it, on 127.0.0.1 only:
- ``one session``: a fresh server, one tab, click to the Overview's results;
- ``four sessions at once``: a fresh server, four tabs clicked together; the slowest against one
  session alone (target ≤ 1.6×), and whether all four read one analysis (the same compute time);
- ``RSS after 8 more sessions``: a fresh server, one session's demo, its tab closed, the server's
  RSS once the session ended; then 8 sessions run the demo and close, and the RSS again (target:
  within 300 MB of the first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import case

ROOT = Path(__file__).resolve().parents[1]
SESSION_TTL_S = 2
RELEASE_WAIT_S = SESSION_TTL_S + 6
"""How long after a tab closes the server has released its session (reconnect window + 1 s + slack)."""
WAIT_MS = 300_000
RATIO_TARGET = 1.6
RSS_TARGET_MB = 300


@contextmanager
def _server(folder: Path) -> Iterator[tuple[str, int]]:
    """The app served from ``folder`` (its roots and temporary files), yielding its URL and pid."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(folder)}
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port)]
    command += ["--server.disconnectedSessionTTL", str(SESSION_TTL_S), "--browser.gatherUsageStats", "false"]
    command += ["--data-root", str(folder), "--model-root", str(folder), "--output-root", str(folder)]
    with (folder / "server.log").open("w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2):
                        break
                except OSError:
                    time.sleep(0.5)
            yield url, server.pid
        finally:
            server.terminate()
            server.wait(timeout=30)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _demo(browser, url: str, count: int) -> tuple[list[float], list[str]]:
    """``count`` tabs press "Run the demo" together; seconds from the click to each tab's results,
    and each tab's results caption. The tabs are closed after."""
    tabs = []
    for _ in range(count):
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.goto(url)
        tab.get_by_role("button", name="Run the demo").wait_for(timeout=WAIT_MS)
        tabs.append(tab)
    clicked = []
    for tab in tabs:
        tab.get_by_role("button", name="Run the demo").click()
        clicked.append(time.perf_counter())
    seconds, captions = [0.0] * count, [""] * count
    pending = set(range(count))
    while pending:
        for i in list(pending):
            found = tabs[i].get_by_text("minilm: 12 tensors")
            if found.count():
                seconds[i] = time.perf_counter() - clicked[i]
                captions[i] = found.first.inner_text()
                pending.discard(i)
        if time.perf_counter() - clicked[0] > WAIT_MS / 1000:
            raise RuntimeError("the demo did not finish in time")
        time.sleep(0.05)
    for tab in tabs:
        tab.close()
    return seconds, captions


def _computed_in(caption: str) -> str:
    return caption.split("computed in ", 1)[1].split(" s", 1)[0]


def cases(device: str) -> list[dict]:
    if shutil.which("chromium") is None:
        return [case("serve: chromium is not installed (apt-get install chromium)", 0.0, agreement="skipped")]
    from playwright.sync_api import sync_playwright

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=["--no-sandbox"])
        folders = [Path(tmp) / name for name in ("alone", "four", "rss")]
        for folder in folders:
            folder.mkdir()
        with _server(folders[0]) as (url, _):
            alone, _ = _demo(browser, url, 1)
        with _server(folders[1]) as (url, _):
            together, captions = _demo(browser, url, 4)
        ratio = max(together) / alone[0]
        one_analysis = len({_computed_in(c) for c in captions}) == 1
        computed = sum("reused from cache" in c for c in captions)
        rows.append(case("serve: demo, one session alone (click to results)", alone[0]))
        rows.append(
            case(
                "serve: demo, four sessions at once, the slowest",
                max(together),
                alone[0],
                "one session alone",
                agreement=f"{ratio:.2f}x one session (target <= {RATIO_TARGET}); computed {computed} time(s), "
                f"{'one analysis read by all four' if one_analysis else 'DIFFERENT analyses'}",
            )
        )
        with _server(folders[2]) as (url, pid):
            _demo(browser, url, 1)
            time.sleep(RELEASE_WAIT_S)
            after_one = _rss_mb(pid)
            for _ in range(2):
                _demo(browser, url, 4)
            time.sleep(RELEASE_WAIT_S)
            after_nine = _rss_mb(pid)
        grew = after_nine - after_one
        rows.append(
            case(
                "serve: server RSS after 1 + 8 demo sessions ended",
                0.0,
                agreement=f"{after_one:.0f} MB after one session, {after_nine:.0f} MB after 8 more "
                f"(+{grew:.0f} MB; target <= {RSS_TARGET_MB})",
            )
        )
        browser.close()
    return rows
