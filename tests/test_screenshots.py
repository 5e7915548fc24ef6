"""``scripts/screenshots.py`` (issue 55), run as the docs' maintainer runs it, on one cheap page: the
real app started and driven in Chromium, one PNG of the fixed viewport written into ``--out`` and
nothing left elsewhere, and the app it started gone afterwards (its process, its process group and
its port)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "screenshots.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, read from its header (the IHDR chunk comes first)."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """An empty temporary folder with a short path: Chromium's singleton socket lies under it, and a
    socket path over 107 bytes (as under pytest's ``tmp_path``) stops Chromium at launch."""
    folder = Path(tempfile.mkdtemp(prefix="shots-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_model_page_is_shot_and_the_app_is_stopped(tmp_path, short_tmp):
    out, tmp = tmp_path / "shots", short_tmp
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--pages", "model"],
        cwd=tmp_path,  # the script finds the app from its own place, not the working directory
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp)},  # where the server's own folder goes, to see it removed
    )
    assert result.returncode == 0, result.stdout + result.stderr
    started = re.search(r"app: pid (\d+) on http://127\.0\.0\.1:(\d+)", result.stdout)
    assert started, result.stdout
    pid, port = int(started[1]), int(started[2])

    assert [p.name for p in out.iterdir()] == ["model.png"]
    assert list(tmp.iterdir()) == []  # the server's token, outputs, uploads and log went with it
    assert _png_size(out / "model.png") == (1400, 900)
    assert (out / "model.png").stat().st_size > 20_000  # a drawn page, not a blank one
    assert f"wrote {out / 'model.png'}" in result.stdout

    assert _gone(pid) and _group_gone(pid)  # the server led a process group of its own
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens where the app did


def test_an_unknown_page_is_refused_before_anything_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "shots"), "--pages", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "invalid choice: 'nowhere'" in result.stderr
    assert not (tmp_path / "shots").exists()
