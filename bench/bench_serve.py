"""A server a team shares (issue 32): sessions pressing "Run the demo" at once, and the memory a
server keeps after sessions end.

Each case starts the app as ``scripts/app.sh`` does (``python -m lab.serve``, loopback, offline, a
2 s reconnect window, roots in a temporary folder). Its sessions are clients of Streamlit's own
websocket protocol on 127.0.0.1 (what a browser sends and receives, without a browser's rendering,
which on this machine would run on the server's 2 cores, as four people's browsers would not): a
session opens the app, presses "Run the demo" (the button's widget id, as the page sent it) and
waits for the frame that carries the Overview's results.
- ``one session``: a fresh server (warmed: one session opened the Model page, so MiniLM is open),
  one session, the click to its results;
- ``four sessions at once``: a fresh server warmed alike, four sessions clicked together; the
  slowest against one session alone (target ≤ 1.6×), how often the run was computed, and whether all
  four read one analysis (the same compute time in their captions);
- ``RSS after 8 more sessions``: a fresh server, one session's demo, the session closed, the
  server's RSS once the session ended; then 8 sessions (four at a time) run the demo and close,
  and the RSS again (target: within 300 MB of the first).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import case

ROOT = Path(__file__).resolve().parents[1]
SESSION_TTL_S = 2
RELEASE_WAIT_S = SESSION_TTL_S + 6
"""How long after a session closes the server has released it (reconnect window + 1 s + slack)."""
TIMEOUT_S = 300
RATIO_TARGET = 1.6
RSS_TARGET_MB = 300
RESULTS = b"minilm: 12 tensors"
"""The Overview's caption once the demo's results are there."""


@contextmanager
def _server(folder: Path) -> Iterator[tuple[int, int]]:
    """The app served from ``folder`` (its roots and temporary files), yielding its port and pid."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(folder)}
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port)]
    command += ["--server.disconnectedSessionTTL", str(SESSION_TTL_S), "--browser.gatherUsageStats", "false"]
    command += ["--data-root", str(folder), "--model-root", str(folder), "--output-root", str(folder)]
    with (folder / "server.log").open("w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                        break
                except OSError:
                    time.sleep(0.5)
            yield port, server.pid
        finally:
            server.terminate()
            server.wait(timeout=30)


class _Session:
    """One browser session as the server sees it: Streamlit's websocket protocol (``BackMsg`` out,
    ``ForwardMsg`` in), on 127.0.0.1."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socket = None

    async def open(self, page: str = "") -> dict[str, str]:
        """Connect and run ``page`` (the default page when empty); the buttons it drew, by label."""
        import websockets

        url = f"ws://127.0.0.1:{self.port}/_stcore/stream"
        self.socket = await websockets.connect(url, subprotocols=["streamlit"], max_size=None)
        return await self._run(page_name=page)

    async def click(self, button_id: str) -> bytes:
        """Press the button and return the first frame holding the demo's results."""
        return await self._run(button_id, until=RESULTS)

    async def close(self) -> None:
        await self.socket.close()

    async def _run(self, button_id: str = "", page_name: str = "", until: bytes = b"") -> dict[str, str] | bytes:
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        message = BackMsg()
        message.rerun_script.query_string = ""
        message.rerun_script.page_name = page_name
        if button_id:
            pressed = message.rerun_script.widget_states.widgets.add()
            pressed.id, pressed.trigger_value = button_id, True
        await self.socket.send(message.SerializeToString())
        buttons: dict[str, str] = {}
        while True:
            raw = await asyncio.wait_for(self.socket.recv(), TIMEOUT_S)
            if until and until in raw:
                return raw
            found = ForwardMsg()
            found.ParseFromString(raw)
            kind = found.WhichOneof("type")
            if kind == "delta" and found.delta.WhichOneof("type") == "new_element":
                element = found.delta.new_element
                if element.WhichOneof("type") == "button":
                    buttons[element.button.label] = element.button.id
            if kind == "script_finished" and not until:
                return buttons


async def _demo(port: int, count: int) -> tuple[list[float], list[str]]:
    """``count`` sessions press "Run the demo" together: seconds from each click to its results,
    and each session's results caption. The sessions are closed after."""
    sessions = [_Session(port) for _ in range(count)]
    buttons = await asyncio.gather(*(s.open() for s in sessions))

    async def press(session: _Session, button: str) -> tuple[float, str]:
        start = time.perf_counter()
        frame = await session.click(button)
        caption = re.search(rb"minilm: 12 tensors[^\x00-\x1f]*", frame).group().decode("utf-8", "replace")
        return time.perf_counter() - start, caption

    done = await asyncio.gather(*(press(s, b["Run the demo"]) for s, b in zip(sessions, buttons, strict=True)))
    await asyncio.gather(*(s.close() for s in sessions))
    return [seconds for seconds, _ in done], [caption for _, caption in done]


async def _warm(port: int) -> None:
    """One session opens the Model page (the server imports what it needs and opens MiniLM, as a
    server that has served anybody has), then leaves."""
    session = _Session(port)
    await session.open("model")
    await session.close()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _computed_in(caption: str) -> str:
    return caption.split("computed in ", 1)[1].split(" s", 1)[0]


def cases(device: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        folders = [Path(tmp) / name for name in ("alone", "four", "rss")]
        for folder in folders:
            folder.mkdir()
        with _server(folders[0]) as (port, _):
            asyncio.run(_warm(port))
            alone, _ = asyncio.run(_demo(port, 1))
        with _server(folders[1]) as (port, _):
            asyncio.run(_warm(port))
            together, captions = asyncio.run(_demo(port, 4))
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
        with _server(folders[2]) as (port, pid):
            asyncio.run(_demo(port, 1))
            time.sleep(RELEASE_WAIT_S)
            after_one = _rss_mb(pid)
            for _ in range(2):
                asyncio.run(_demo(port, 4))
            time.sleep(RELEASE_WAIT_S)
            after_nine = _rss_mb(pid)
        rows.append(
            case(
                "serve: server RSS after 1 + 8 demo sessions ended",
                0.0,
                agreement=f"{after_one:.0f} MB after one session, {after_nine:.0f} MB after 8 more "
                f"(+{after_nine - after_one:.0f} MB; target <= {RSS_TARGET_MB})",
            )
        )
    return rows
