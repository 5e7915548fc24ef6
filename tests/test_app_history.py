"""The Runs page and the run links, driven headless with AppTest: every computed run is kept with
who asked; the page lists them, opens one as it was (no recomputing), compares two, deletes only
the person's own, says when it pruned; a link (``?run=ID``) opens a run for another session; a
model from a session's own upload stays out of the team's history."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from lab import results, ui
from lab.history.run_file import KeptRun
from lab.settings import SpecSettings
from lab.ui import serving
from lab.workspace import ModelRequest, Workspace
from sample_models.builtin import minilm_dir

APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 300


@pytest.fixture
def history_root(tmp_path, monkeypatch):
    """A server of its own whose history keeps two runs."""
    (tmp_path / "outputs").mkdir()
    argv = ["app.py", "--data-root", str(tmp_path), "--model-root", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [*argv, "--output-root", str(tmp_path / "outputs"), "--history-size", "2"])
    serving.served.clear()
    serving.shared_runs.clear()
    serving.history.clear()
    return tmp_path / "outputs" / "runs"


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _button(at: AppTest, label: str):
    matches = [b for b in at.button if b.label == label]
    assert matches, f"no button {label!r}; buttons: {[b.label for b in at.button]}"
    return matches[0]


def _ws(at: AppTest) -> Workspace:
    return at.session_state[ui.WORKSPACE]


def _demo() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _button(at, "Run the demo").click()
    at.run()
    _ok(at)
    return at


def _second_run(at: AppTest) -> None:
    """The same layers again with int8 weights per tensor: another format, another kept run."""
    _ws(at).settings.weight = SpecSettings(dtype="int8")
    at.switch_page("pages/run.py").run()
    _button(at, "Run").click()
    at.run()
    _ok(at)


def _captions(at: AppTest) -> str:
    return " ".join(c.value for c in at.caption)


def test_the_runs_page_lists_opens_and_compares_kept_runs(history_root):
    at = _demo()
    first = _ws(at).last_run.kept
    assert first is not None and first.who == "token" and first.model == "minilm" and len(first.layers) == 6
    errors = results.error_table(_ws(at).analysis)
    _second_run(at)
    second = _ws(at).last_run.kept
    assert second.formats.startswith("weight: int8 sym tensor") and second.id != first.id

    at.switch_page("pages/runs.py").run()
    _ok(at)
    table = at.dataframe[0].value
    assert list(table["run"]) == [second.id, first.id] and list(table["who"]) == ["token", "token"]
    assert list(table["model"]) == ["minilm", "minilm"] and list(table["GPTQ"]) == [False, False]
    assert table["layers"][0].startswith("6: encoder.layer.0.attention.self.query")
    assert "the newest 2 runs within 20 GB (`--history-size`, `--history-bytes`)" in _captions(at)
    assert "They differ in formats." in _captions(at)
    side = at.dataframe[1].value
    assert {"sqnr_db · A", "sqnr_db · B", "clips above · A", "scale median · B"} <= set(side.columns)
    assert len(at.get("plotly_chart")) == 3  # the figure's bars and each run's ranges

    at.selectbox(key="w:runs_open").set_value(first.id).run()
    _button(at, "Open").click()
    at.run()
    _ok(at)
    ws = _ws(at)
    assert ws.last_run.shared == "kept" and ws.last_run.kept.id == first.id
    assert results.error_table(ws.analysis).equals(errors)  # the first run's numbers, not recomputed
    assert any("opened from the team's run history" in s.value for s in at.success)
    at.switch_page("pages/overview.py").run()
    _ok(at)
    assert "opened from the team's run history: nothing recomputed" in _captions(at)
    at.switch_page("pages/export.py").run()
    _ok(at)
    assert f"Run asked for by token on {first.when} (run {first.id})." in _captions(at)
    for page in ("ranges", "scales", "error"):  # a kept weight is read from its model when a page asks
        at.switch_page(f"pages/{page}.py").run()
        _ok(at)
    key = ("encoder.layer.0.attention.output.dense", "input")
    entry = ws.analysis.entry(*key)
    assert entry.kept_values is not None and entry.data.shape[0] < entry.metrics_tokens  # the sample, bounded
    for page in ("ranges", "error"):  # drawn from it: the histogram and channels of every token, the rest on a subset
        at.switch_page(f"pages/{page}.py").run()
        at.selectbox(key="w:tensor").set_value(key).run()
        _ok(at)
        assert f"This kept run holds {entry.kept_note}, a seeded subset" in _captions(at)


def test_a_link_opens_a_run_for_another_session(history_root):
    at = _demo()
    kept = _ws(at).last_run.kept
    errors = results.error_table(_ws(at).analysis)
    colleague = AppTest.from_file(APP, default_timeout=TIMEOUT)
    colleague.query_params["run"] = kept.id
    colleague.run()
    _ok(colleague)
    assert _ws(colleague).last_run.kept.id == kept.id
    assert results.error_table(_ws(colleague).analysis).equals(errors)
    assert _ws(colleague).request == ModelRequest("minilm", "auto", "fp32")
    stranger = AppTest.from_file(APP, default_timeout=TIMEOUT)
    stranger.query_params["run"] = "20260101-000000-abcdef"
    stranger.run()
    assert [e.value for e in stranger.error] == [
        "Opening run 20260101-000000-abcdef failed: no kept run '20260101-000000-abcdef' on this server "
        "(deleted, pruned, or never kept here)"
    ]


def test_a_person_deletes_only_their_own_runs_and_the_page_says_what_it_pruned(history_root):
    at = _demo()
    mine = _ws(at).last_run.kept
    theirs = serving.history().record(KeptRun(_ws(at).analysis, request={"source": "minilm"}), "alice@example.com")
    at.switch_page("pages/runs.py").run()
    at.selectbox(key="w:runs_open").set_value(theirs.id).run()
    delete = _button(at, "Delete")
    assert delete.disabled and delete.help == "Only alice@example.com may delete this run."
    at.selectbox(key="w:runs_open").set_value(mine.id).run()
    _button(at, "Delete").click()
    at.run()
    _ok(at)
    assert [r.id for r in serving.history().runs()] == [theirs.id] and not (history_root / mine.id).exists()

    _second_run(at)
    serving.history().record(KeptRun(_ws(at).analysis, request={"source": "minilm"}), "alice@example.com")
    at.switch_page("pages/runs.py").run()
    _ok(at)
    assert len(at.dataframe[0].value) == 2 and not (history_root / theirs.id).exists()  # the oldest went
    pruned = "Since this server started, 1 older run(s) were removed to keep the newest 2 runs within 20 GB."
    assert [i.value for i in at.info] == [pruned]


def test_a_run_on_a_models_upload_stays_the_sessions_own(history_root):
    ws = Workspace()
    source = ws.save_model_upload("mine.safetensors", (minilm_dir() / "model.safetensors").read_bytes())
    ws.request = ModelRequest(str(source))
    assert serving.keeper(ws) is None
    ws.request = ModelRequest("minilm")
    assert serving.keeper(ws) is not None
    ws.uploads.remove()


def test_two_runs_on_two_models_compare_a_layer_picked_in_each(history_root):
    """No layer in common (MiniLM against tiny-llama): the page asks for one layer of each and
    compares them as it compares one layer of two runs."""
    from lab.analyse.result_cache import ResultCache
    from lab.serve.session_runs import SessionRun
    from lab.settings import RunSettings

    llama = ui.open_shared_model("tiny-llama", "auto", "fp32")
    settings = RunSettings(weight=SpecSettings(dtype="int8"), wants={"weight": True, "input": False})
    config = settings.config(has_layers=True, has_attention=False)
    layer = "model.layers.0.self_attn.o_proj"
    computed = SessionRun(llama, [layer], config, [], ResultCache(), {}).compute()
    at = _demo()
    serving.history().record(KeptRun(computed.analysis, request={"source": "tiny-llama"}), "alice@example.com")
    at.switch_page("pages/runs.py").run()
    _ok(at)
    assert "They differ in model, formats" in _captions(at), _captions(at)
    assert "The two runs analysed no layer in common: pick one of each." in _captions(at)
    assert at.selectbox(key="compare_tb").value == (layer, "weight")
    side = at.dataframe[1].value
    assert (
        side.set_index("observer").loc["minmax", "sqnr_db · B"]
        == computed.analysis.entry(layer, "weight").result("minmax").metrics["sqnr_db"]
    )
    at.selectbox(key="compare_ta").set_value(("encoder.layer.0.intermediate.dense", "weight")).run()
    _ok(at)
    assert len(at.get("plotly_chart")) == 3
