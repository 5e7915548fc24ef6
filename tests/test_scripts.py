"""The two commands' plumbing: the Streamlit settings the served app runs with, and setup.sh's rule
that an up-to-date .venv is left alone (running the tests must not pull the environment from under a
running app). setup.sh runs against a temporary copy with a fake ``python3``, never the real .venv."""

import base64
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers import free_port, wait_healthy
from streamlit import config as st_config

from lab.serve.access import SESSION_COOKIE, session_cookie

ROOT = Path(__file__).resolve().parents[1]
APP_SECONDS = 20.0

FAKE_PYTHON3 = """#!/usr/bin/env bash
# python3 as setup.sh calls it: --version, and -m venv DIR (whose bin/python is the fake pip).
echo "python3 $*" >>"$FAKE_LOG"
if [[ "$1" == --version ]]; then echo "Python $FAKE_PYTHON_VERSION"; exit 0; fi
mkdir -p "$3/bin"
cp "$(dirname "$0")/venv-python" "$3/bin/python"
"""
FAKE_VENV_PYTHON = """#!/usr/bin/env bash
# .venv/bin/python -m pip install ...: logged, and failing when FAKE_PIP_FAIL is set.
echo "pip $*" >>"$FAKE_LOG"
[[ -z "${FAKE_PIP_FAIL:-}" ]]
"""


# ---------------------------------------------------------------- Streamlit settings


def _project_config() -> dict:
    with (ROOT / ".streamlit" / "config.toml").open("rb") as file:
        return tomllib.load(file)


def test_config_turns_the_file_watcher_off_and_hides_deploy():
    settings = _project_config()
    assert settings["server"]["fileWatcherType"] == "none"
    assert settings["server"]["runOnSave"] is False
    assert settings["client"]["toolbarMode"] in {"viewer", "minimal"}


def test_config_names_only_options_this_streamlit_knows():
    """A misspelt option is ignored by Streamlit with a warning nobody reads."""
    known = st_config.get_config_options()
    names = [f"{section}.{key}" for section, values in _project_config().items() for key in values]
    assert [name for name in names if name not in known] == []


def _open_session(port: int, token: str) -> socket.socket:
    """A browser tab as far as the server cares: the websocket handshake on /_stcore/stream.
    Streamlit installs its file watchers per session, so without one no watcher would start."""
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET /_stcore/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
        f"Cookie: {SESSION_COOKIE}={session_cookie(token)}\r\n\r\n"
    )
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(request.encode())
    status = connection.recv(1024).split(b"\r\n", 1)[0]
    assert b" 101 " in status, status
    return connection


@pytest.mark.slow
def test_served_app_does_not_flood_the_terminal(tmp_path):
    """``python -m lab.serve`` from the repository root with the project config only (as
    scripts/app.sh runs it, signed in with its token), a session open for about 20 s: not one inotify
    message, the URL Streamlit prints is the loopback one (no "Network URL"), and the server prints the
    address to open, with its token."""
    port = free_port()
    token = "scripts-test-token-0123456789"
    (tmp_path / "token").write_text(token)
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port)]
    command += ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]
    command += ["--token-file", str(tmp_path / "token")]
    log_path = tmp_path / "streamlit.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server)
            with _open_session(port, token):
                time.sleep(max(0.0, APP_SECONDS - (time.monotonic() - started)))
                assert server.poll() is None, "streamlit exited while a session was open"
        finally:
            server.terminate()
            server.wait(timeout=20)
    output = log_path.read_text()
    assert f"URL: http://127.0.0.1:{port}" in output and "Network URL" not in output
    assert f"Observer Lab: open http://127.0.0.1:{port}/?token={token}\n" in output
    assert [line for line in output.splitlines() if "Inotify" in line] == []


# ---------------------------------------------------------------- setup.sh


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A copy of scripts/ and a requirements.txt, with a fake python3 first on PATH."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    (repo / "requirements.txt").write_text("torch==2.13.0\n")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("python3", FAKE_PYTHON3), ("venv-python", FAKE_VENV_PYTHON)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.log"))
    monkeypatch.setenv("FAKE_PYTHON_VERSION", "3.11.2")
    monkeypatch.delenv("FAKE_PIP_FAIL", raising=False)
    return repo


def _setup(repo: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run setup.sh; return its result and the commands it ran (this run only)."""
    log = Path(os.environ["FAKE_LOG"])
    log.unlink(missing_ok=True)
    result = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True)
    return result, log.read_text().splitlines() if log.exists() else []


def _built(calls: list[str]) -> bool:
    return any(call.startswith("python3 -m venv") for call in calls)


def test_setup_builds_once_then_leaves_the_environment_alone(checkout):
    result, calls = _setup(checkout)
    assert result.returncode == 0, result.stderr
    assert _built(calls) and "pip -m pip install -q -r requirements.txt" in calls
    stamp = (checkout / ".venv" / ".requirements.sha256").read_text()
    assert "Python 3.11.2" in stamp
    keepsake = checkout / ".venv" / "installed-by-the-user"
    keepsake.write_text("a CUDA torch, say")
    result, calls = _setup(checkout)
    assert result.returncode == 0, result.stderr
    assert not _built(calls) and keepsake.exists()


@pytest.mark.parametrize("change", ["requirements", "python"])
def test_setup_rebuilds_when_requirements_or_python_change(checkout, monkeypatch, change):
    assert _setup(checkout)[0].returncode == 0
    if change == "requirements":
        (checkout / "requirements.txt").write_text("torch==2.13.0\nnumpy\n")
    else:
        monkeypatch.setenv("FAKE_PYTHON_VERSION", "3.12.1")
    result, calls = _setup(checkout)
    assert result.returncode == 0, result.stderr
    assert _built(calls)


def test_failed_install_leaves_no_stamp_so_the_next_run_rebuilds(checkout, monkeypatch):
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    result, calls = _setup(checkout)
    assert result.returncode != 0 and _built(calls)
    assert not (checkout / ".venv" / ".requirements.sha256").exists()
    monkeypatch.delenv("FAKE_PIP_FAIL")
    result, calls = _setup(checkout)
    assert result.returncode == 0 and _built(calls)
    assert (checkout / ".venv" / ".requirements.sha256").is_file()


# ---------------------------------------------------------------- chromium.sh

FAKE_APT_GET = """#!/bin/bash
echo "apt-get $*" >>"$FAKE_LOG"
"""


def _chromium(tmp_path: Path, *, uid: int, chromium: bool, sudo: bool) -> tuple[subprocess.CompletedProcess, list]:
    """Run chromium.sh with a PATH of fakes only (``id``, ``apt-get``, maybe ``chromium`` and ``sudo``)."""
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    fakes = {"apt-get": FAKE_APT_GET, "id": f"#!/bin/bash\necho {uid}\n"}
    if chromium:
        fakes["chromium"] = "#!/bin/bash\n"
    if sudo:
        fakes["sudo"] = '#!/bin/bash\necho "sudo $*" >>"$FAKE_LOG"\nshift\n"$@"\n'
    for name, text in fakes.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    log = tmp_path / "calls.log"
    environment = {"PATH": str(fake_bin), "FAKE_LOG": str(log)}
    result = subprocess.run(
        ["/bin/bash", str(ROOT / "scripts" / "chromium.sh")], capture_output=True, text=True, env=environment
    )
    return result, log.read_text().splitlines() if log.exists() else []


def test_the_test_command_installs_chromium_when_it_is_missing(tmp_path):
    result, calls = _chromium(tmp_path, uid=0, chromium=False, sudo=False)
    assert result.returncode == 0, result.stderr
    assert calls == ["apt-get update -qq", "apt-get install -y -qq chromium"]


def test_chromium_is_installed_through_sudo_for_a_user(tmp_path):
    result, calls = _chromium(tmp_path, uid=1000, chromium=False, sudo=True)
    assert result.returncode == 0, result.stderr
    assert "apt-get install -y -qq chromium" in calls and any(call.startswith("sudo -n apt-get") for call in calls)


def test_a_present_chromium_is_left_alone_and_a_user_without_sudo_is_told(tmp_path):
    (tmp_path / "present").mkdir()
    result, calls = _chromium(tmp_path / "present", uid=0, chromium=True, sudo=False)
    assert result.returncode == 0 and calls == []
    (tmp_path / "user").mkdir()
    result, calls = _chromium(tmp_path / "user", uid=1000, chromium=False, sudo=False)
    assert result.returncode == 0 and calls == []
    assert "chromium is missing" in result.stderr


def test_the_readme_test_command_sets_up_chromium_before_the_tests():
    lines = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    assert lines.index("bash scripts/chromium.sh") < next(i for i, line in enumerate(lines) if "pytest" in line)
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
