"""Serving a team (issue 32), without a browser: the declared roots and the launcher, where browser
paths may lead, the checkpoint directories the app may replace, a session's uploads, and runs shared
between sessions (computed once, queued, kept within a byte bound)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lab.export.model_dir import NOTES_FILE, lab_written
from lab.serve import __main__ as launcher
from lab.serve import config as serve_config
from lab.serve import roots
from lab.serve.config import ServeConfig
from lab.serve.roots import OutsideRootsError
from lab.serve.shared_runs import SharedRuns, tensor_bytes
from lab.serve.uploads import SessionUploads, UploadError

# ---------------------------------------------------------------- declared roots and the launcher


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    """Roots and, beside them, what the server must never serve."""
    paths = {name: tmp_path / name for name in ("data", "models", "out", "private")}
    for path in paths.values():
        path.mkdir()
    (paths["private"] / "secret.json").write_text('{"text": "the admin password is hunter2"}')
    (paths["data"] / "records.jsonl").write_text('{"text": "hello"}\n')
    return paths


@pytest.fixture
def served(tree) -> ServeConfig:
    argv = ["--data-root", str(tree["data"]), "--model-root", str(tree["models"]), "--output-root", str(tree["out"])]
    config, rest = ServeConfig.parse(argv)
    assert rest == []
    return config


def test_defaults_expose_only_folders_under_the_app_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))
    config, rest = ServeConfig.parse(["--server.port", "8600"], cwd=tmp_path)
    assert rest == ["--server.port", "8600"]  # Streamlit's flags pass through
    assert config.data_roots == ((tmp_path / "lab-data").resolve(),)
    assert config.output_root == (tmp_path / "lab-outputs").resolve()
    assert (tmp_path / "lab-data").is_dir() and (tmp_path / "lab-outputs").is_dir()
    assert all(root.is_relative_to(tmp_path.resolve()) or "huggingface" in str(root) for root in config.model_roots)
    assert config.heavy_runs == 1 and config.shared_cache_bytes == 10**9
    assert (config.history_size, config.history_bytes) == (200, 20 * 10**9)


def test_a_declared_root_that_does_not_exist_stops_the_launcher(tmp_path, capsys, monkeypatch):
    executed = []
    monkeypatch.setattr(os, "execv", lambda *a: executed.append(a))
    code = launcher.main(["--data-root", str(tmp_path / "missing"), "--server.port", "8600"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and executed == []
    assert err.count("\n") == 0 and "data root" in err and "does not exist" in err
    (tmp_path / "a-file").write_text("x")
    assert launcher.main(["--output-root", str(tmp_path / "a-file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert launcher.main(["--heavy-runs", "0"]) == 2
    assert launcher.main(["--shared-cache", "lots"]) == 2


@pytest.mark.parametrize("text", ["5G", "-1GB", "0", "20", "lots"])
def test_a_bad_history_bytes_stops_the_launcher_in_one_line(text, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default roots are made here
    executed = []
    monkeypatch.setattr(os, "execv", lambda *a: executed.append(a))
    assert launcher.main([f"--history-bytes={text}"]) == 2 and executed == []
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --history-bytes")
    config, _ = ServeConfig.parse(["--history-bytes", "5.5 GB"], cwd=tmp_path)
    assert config.history_bytes == 5_500_000_000 and ServeConfig.parse(config.to_argv())[0] == config


def test_the_launcher_hands_streamlit_its_flags_and_the_app_its_roots(served, tree):
    line = launcher.command(["--server.address", "0.0.0.0", "--data-root", str(tree["data"]), "--heavy-runs", "2"])
    assert line[:4] == [sys.executable, "-m", "streamlit", "run"] and line[4].endswith("app_server.py")
    cut = line.index("--")
    assert line[5:cut] == ["--server.address", "0.0.0.0"]
    app_config, rest = ServeConfig.parse(line[cut + 1 :])
    assert rest == [] and app_config.data_roots == (tree["data"].resolve(),) and app_config.heavy_runs == 2
    assert ServeConfig.parse(served.to_argv())[0] == served  # the app reads back what the launcher wrote


def test_the_project_config_listens_on_loopback_with_xsrf_and_an_upload_limit():
    import tomllib

    settings = tomllib.loads((Path(__file__).resolve().parents[1] / ".streamlit" / "config.toml").read_text())
    assert settings["server"]["address"] == "127.0.0.1"
    assert settings["server"]["enableXsrfProtection"] is True
    assert settings["server"]["maxUploadSize"] == serve_config.MAX_UPLOAD_MB


# ---------------------------------------------------------------- paths from a browser


def test_paths_inside_a_root_resolve_and_relative_ones_start_at_the_first_root(served, tree):
    assert roots.data_path(str(tree["data"] / "records.jsonl"), served) == tree["data"].resolve() / "records.jsonl"
    assert roots.data_path("records.jsonl", served) == tree["data"].resolve() / "records.jsonl"
    assert roots.data_path("sub/../records.jsonl", served) == tree["data"].resolve() / "records.jsonl"


@pytest.mark.parametrize(
    "how",
    ["absolute", "dotdot", "relative dotdot", "symlink", "symlinked folder", "home", "missing"],
)
def test_paths_outside_every_root_are_refused_in_one_line(served, tree, how):
    secret = tree["private"] / "secret.json"
    if how == "symlink":
        (tree["data"] / "link.json").symlink_to(secret)
    if how == "symlinked folder":
        (tree["data"] / "elsewhere").symlink_to(tree["private"], target_is_directory=True)
    text = {
        "absolute": str(secret),
        "dotdot": f"{tree['data']}/../private/secret.json",
        "relative dotdot": "../private/secret.json",
        "symlink": str(tree["data"] / "link.json"),
        "symlinked folder": "elsewhere/secret.json",
        "home": "~/.bash_history",
        "missing": str(tree["private"] / "no-such-file.json"),
    }[how]
    with pytest.raises(OutsideRootsError) as err:
        roots.data_path(text, served)
    message = str(err.value)
    assert "\n" not in message and "outside the data roots" in message and str(tree["data"]) in message
    assert "--data-root" in message and "hunter2" not in message
    if how in ("absolute", "dotdot", "home", "missing"):  # the same text is no model path either
        with pytest.raises(OutsideRootsError, match="outside the model roots"):
            roots.model_path(text, served)


def test_hub_ids_only_on_a_server_with_network_and_never_a_local_path(served, tree, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OutsideRootsError, match="runs offline"):
        roots.hub_id("org/model", served)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert roots.hub_id(" org/model ", served) == "org/model"
    monkeypatch.chdir(tree["private"].parent)
    for text in ("private/secret.json", "../x", "/etc/passwd", "org/../x", "a/b/c"):
        with pytest.raises(OutsideRootsError):
            roots.hub_id(text, served)


# ---------------------------------------------------------------- checkpoint directories


def _lab_checkpoint(folder: Path) -> Path:
    """A directory as ``checkpoint.write`` leaves it: its files, and the notes listing them."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / NOTES_FILE).write_text("Observer Lab checkpoint\n\nfiles written:\n  config.json\n  model.safetensors\n")
    return folder


def test_checkpoints_go_under_the_output_root_and_replace_only_the_labs_own(served, tree):
    out = tree["out"].resolve()
    assert roots.checkpoint_dir("new", served, replace=False) == out / "new"
    assert roots.checkpoint_dir(str(out / "deep" / "new"), served, replace=True) == out / "deep" / "new"
    ours = _lab_checkpoint(out / "ours")
    with pytest.raises(OutsideRootsError, match="not empty"):
        roots.checkpoint_dir("ours", served, replace=False)
    assert roots.checkpoint_dir("ours", served, replace=True) == ours

    theirs = out / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    with pytest.raises(OutsideRootsError, match="not written by Observer Lab"):
        roots.checkpoint_dir("theirs", served, replace=True)
    (ours / "added-by-a-person.txt").write_text("mine")  # a lab checkpoint with someone's file in it
    with pytest.raises(OutsideRootsError, match="not written by Observer Lab"):
        roots.checkpoint_dir("ours", served, replace=True)
    (out / "a-file").write_text("x")
    with pytest.raises(OutsideRootsError, match="is a file"):
        roots.checkpoint_dir("a-file", served, replace=True)
    for escape in ("../escape", str(tree["private"]), ".", ""):
        with pytest.raises(OutsideRootsError):
            roots.checkpoint_dir(escape, served, replace=True)
    assert not (tree["out"].parent / "escape").exists()
    for history in ("runs", "runs/new", str(out / "runs" / "20261127-070905-a1b2c3")):  # the team's run history
        with pytest.raises(OutsideRootsError, match="holds the team's run history"):
            roots.checkpoint_dir(history, served, replace=True)


def test_lab_written_needs_the_notes_listing_every_plain_file(tmp_path):
    folder = _lab_checkpoint(tmp_path / "ckpt")
    assert lab_written(folder)
    (folder / "sub").mkdir()
    assert not lab_written(folder)
    (folder / "sub").rmdir()
    (folder / NOTES_FILE).write_text("Observer Lab checkpoint\n")  # no list of files: an older or forged note
    assert not lab_written(folder)
    assert not lab_written(tmp_path)


# ---------------------------------------------------------------- uploads


def test_upload_names_never_form_a_path_outside_the_session_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_config, "UPLOADS_ROOT", tmp_path / "sessions")
    uploads = SessionUploads()
    for name in ("../../evil.safetensors", "..\\..\\win.safetensors", "/etc/x.safetensors", ".hidden.safetensors"):
        path = uploads.save_model(name, b"weights")
        assert path.parent == uploads.folder / "models" and path.read_bytes() == b"weights"
        assert uploads.owns(str(path)) and not path.name.startswith(".")
    with pytest.raises(UploadError, match="not a .safetensors"):
        uploads.save_model("model.bin", b"x")
    with pytest.raises(UploadError, match="empty"):
        uploads.save_model("model.safetensors", b"")
    assert not uploads.owns(str(tmp_path / "sessions"))
    folder = uploads.folder
    del uploads
    gc.collect()
    assert not folder.exists()  # the session's uploads go with it


# ---------------------------------------------------------------- shared runs


def _threads(*targets) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_identical_runs_are_computed_once_and_read_by_every_session():
    """The computation holds until the second session is seen waiting on it (no race with a clock)."""
    runs, calls, got = SharedRuns(max_bytes=1 << 20), [], []
    started, joined = threading.Event(), threading.Event()

    def compute(tell):
        calls.append(1)
        started.set()
        tell("1/2 steps")
        assert joined.wait(30), "the second session never waited on the computation"
        return {"scale": torch.ones(4)}

    def session():
        got.append(runs.run("demo", compute, tensor_bytes))

    def late_session():
        started.wait(30)
        got.append(runs.run("demo", compute, tensor_bytes, waiting=lambda line: joined.set()))

    _threads(session, late_session)
    assert len(calls) == 1
    assert sorted(how for _, how in got) == ["computed", "joined"] and got[0][0] is got[1][0]
    assert runs.run("demo", compute, tensor_bytes)[1] == "cached" and len(calls) == 1
    counts = runs.counts()
    assert (counts.computed, counts.joined, counts.cached, counts.kept, counts.kept_bytes) == (1, 1, 1, 1, 16)


def test_different_runs_queue_and_the_waiting_session_is_told_how_many_are_ahead():
    """The first run holds until the second is seen waiting for it (no race with a clock)."""
    runs, running, peak, lines = SharedRuns(max_bytes=1 << 20, slots=1), [], [], []
    first_started, second_waits = threading.Event(), threading.Event()

    def compute(tell, name):
        running.append(name)
        peak.append(len(running))
        first_started.set()
        if name == "a":
            assert second_waits.wait(30), "the second run never waited"
        running.remove(name)
        return name

    def first():
        runs.run("a", lambda tell: compute(tell, "a"), lambda v: 1)

    def second():
        first_started.wait(30)

        def waiting(line: str) -> None:
            lines.append(line)
            second_waits.set()

        runs.run("b", lambda tell: compute(tell, "b"), lambda v: 1, waiting=waiting)

    _threads(first, second)
    assert max(peak) == 1
    assert "waiting for 1 run ahead" in lines


def test_the_cache_keeps_the_most_recent_results_within_its_bytes():
    runs = SharedRuns(max_bytes=100)
    for key in "abc":
        runs.run(key, lambda tell, key=key: key, lambda v: 40)
    assert runs.counts().kept == 2 and runs.counts().kept_bytes == 80
    assert runs.run("a", lambda tell: "again", lambda v: 40) == ("again", "computed")  # "a" was dropped
    runs.run("huge", lambda tell: "huge", lambda v: 1000)
    assert runs.run("huge", lambda tell: "recomputed", lambda v: 1000)[1] == "computed"  # too big to keep


def test_an_error_reaches_every_waiting_session_and_a_stopped_leader_hands_over():
    runs, started = SharedRuns(max_bytes=1 << 20), threading.Event()
    outcomes = []

    def failing(tell):
        started.set()
        time.sleep(0.3)
        raise ValueError("bad calibration file")

    def leader():
        with pytest.raises(ValueError):
            runs.run("x", failing, lambda v: 1)

    def follower():
        started.wait(5)
        try:
            runs.run("x", failing, lambda v: 1)
        except ValueError as err:
            outcomes.append(str(err))

    _threads(leader, follower)
    assert outcomes == ["bad calibration file"]

    class Stopped(BaseException):
        """What Streamlit raises in a script thread whose session stopped it."""

    started.clear()

    def stopping(tell):
        started.set()
        time.sleep(0.3)
        raise Stopped

    def stopped_leader():
        with pytest.raises(Stopped):
            runs.run("y", stopping, lambda v: 1)

    def heir():
        started.wait(5)
        outcomes.append(runs.run("y", lambda tell: "done by the heir", lambda v: 1))

    _threads(stopped_leader, heir)
    assert outcomes[-1] == ("done by the heir", "computed")


def test_heavy_work_that_is_not_shared_takes_a_slot_in_the_same_queue():
    runs, order = SharedRuns(max_bytes=1, slots=1), []
    holding = threading.Event()

    def evaluation():
        with runs.slot():
            holding.set()
            order.append("evaluation starts")
            time.sleep(0.5)
            order.append("evaluation ends")

    def run():
        holding.wait(5)
        runs.run("r", lambda tell: order.append("run") or 1, lambda v: 1)

    _threads(evaluation, run)
    assert order == ["evaluation starts", "evaluation ends", "run"]


def test_tensor_bytes_counts_each_storage_once():
    x = torch.zeros(10, 10)
    assert tensor_bytes({"a": x, "b": [x, x[0]], "c": (torch.zeros(3, dtype=torch.float16),)}) == 400 + 6


# ---------------------------------------------------------------- sessions' workspaces


def test_two_sessions_with_the_same_settings_share_one_analysis_and_a_change_computes_anew():
    from lab.settings import RunSettings, SpecSettings
    from lab.workspace import ModelRequest, Workspace
    from sample_models import open_model

    model = open_model("tiny-llama")
    runs = SharedRuns(max_bytes=1 << 30)
    sessions = [Workspace(), Workspace()]
    settings = RunSettings(weight=SpecSettings(dtype="int4", strategy="group", group_size=16), observers=("minmax",))
    settings.samples, settings.seq_len = 2, 16
    for ws in sessions:
        ws.request = ModelRequest("tiny-llama")
        ws.layers = [info.name for info in model.layers()][:2]
        ws.settings = settings
    first, second = (ws.run(model, settings.config(), shared=runs) for ws in sessions)
    assert (first.shared, second.shared) == ("computed", "cached")
    assert second.analysis is first.analysis and sessions[1].analysis is sessions[0].analysis
    assert first.misses > 0 and (second.hits, second.misses) == (0, 0)
    settings.observers = ("minmax", "percentile")
    assert sessions[1].run(model, settings.config(), shared=runs).shared == "computed"
    assert runs.counts().computed == 2


def test_a_calibration_path_outside_the_data_roots_is_refused_before_it_is_read(served, tree, monkeypatch):
    from lab import workspace as workspace_module
    from lab.workspace import Workspace
    from sample_models import open_model

    read = []
    monkeypatch.setattr(workspace_module, "preview", lambda source: read.append(source))
    monkeypatch.setattr(workspace_module, "calibration_stamp", lambda source: read.append(source))
    ws = Workspace()
    ws.calibration.kind, ws.calibration.path = "local path", str(tree["private"] / "secret.json")
    check = ws.check_calibration(open_model("tiny-llama"), 4, 16, served)
    assert read == [] and check.preview is None and "outside the data roots" in check.error
    assert ws.calibration.problem == check.error


def test_a_released_workspace_gives_back_its_uploads_analyses_and_caches(tmp_path, monkeypatch):
    from lab.settings import RunSettings, SpecSettings
    from lab.workspace import ModelRequest, Workspace
    from sample_models import open_model

    monkeypatch.setattr(serve_config, "UPLOADS_ROOT", tmp_path / "sessions")
    model = open_model("tiny-llama")
    ws = Workspace(request=ModelRequest("tiny-llama"), layers=[info.name for info in model.layers()][:1])
    ws.settings = RunSettings(weight=SpecSettings(dtype="int8", strategy="channel"), observers=("minmax",))
    ws.settings.samples, ws.settings.seq_len = 2, 16
    ws.run(model, ws.settings.config())
    folder = ws.save_calibration_upload("notes.txt", b"hello\n").parent
    assert ws.analysis is not None and len(ws.result_cache) > 0 and ws.capture_memo
    ws.release()
    assert not folder.exists() and ws.upload_dir is None
    assert ws.analysis is None and ws.last_run is None and len(ws.result_cache) == 0 and not ws.capture_memo
    assert ws.layers and ws.request == ModelRequest("tiny-llama")  # what the person chose stays


def test_an_app_started_with_a_missing_root_says_so_in_one_line_and_serves_nothing(tmp_path, monkeypatch):
    """``streamlit run app.py -- --data-root missing`` (without the launcher's check): the page is
    that one line, no traceback, no page of the app."""
    from streamlit.testing.v1 import AppTest

    from lab.ui import serving

    monkeypatch.setattr(sys, "argv", ["app.py", "--data-root", str(tmp_path / "missing")])
    serving.served.clear()
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=120).run()
    assert not at.exception
    assert [e.value for e in at.error] == [
        f"This server cannot serve the app: the declared data root {str(tmp_path / 'missing')!r} "
        f"({tmp_path / 'missing'}) does not exist: create it or leave the flag out."
    ]
    assert not at.button
