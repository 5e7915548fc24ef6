"""The Streamlit app driven headless with AppTest: default flow, caching, presets, export/import
and every error path (each shows st.error and no exception, and the app keeps working)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import ui
from lab.pipeline import choose

APP = str(Path(__file__).resolve().parents[1] / "app.py")
LAYERS = ["encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key"]
TIMEOUT = 300


def _errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not _errors(at), _errors(at)


def _button(at: AppTest, label: str):
    matches = [b for b in at.button if b.label == label]
    assert matches, f"no button {label!r}; buttons: {[b.label for b in at.button]}"
    return matches[0]


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"pages/{name}.py").run()


def _open_model_page(**state) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    for key, value in state.items():
        at.session_state[key] = value
    return _page(at, "model")


def _plotly_count(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


@pytest.fixture(scope="module")
def ran() -> AppTest:
    """The default flow on MiniLM: two small layers, weights and inputs, every observer."""
    at = _open_model_page()
    _ok(at)
    assert at.multiselect(key="w:layers").value == ui.default_layer_names(
        ui.open_shared_model("minilm", "auto", "fp32").layers()
    )
    at.multiselect(key="w:layers").set_value(LAYERS)
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32)
    at.run()
    _ok(at)
    _page(at, "run")
    _ok(at)
    _button(at, "Run").click()
    at.run()
    _ok(at)
    return at


def test_home_before_any_run_points_to_model():
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _ok(at)
    assert any("Go to Model" in link.proto.label for link in at.get("page_link"))
    assert ui.ANALYSIS not in at.session_state


def test_default_run_stores_every_observer_on_every_tensor(ran):
    analysis = ran.session_state[ui.ANALYSIS]
    assert [(e.layer, e.tensor) for e in analysis.entries] == [(lay, t) for lay in LAYERS for t in ("weight", "input")]
    for entry in analysis.entries:
        assert [r.name for r in entry.results] == list(ob.available())
        assert any(r.qparams is not None for r in entry.results)
    inputs = analysis.entry(LAYERS[0], "input").data
    assert inputs.shape[1] == 384 and 0 < inputs.shape[0] <= 4 * 32
    outcome = ran.session_state[ui.LAST_RUN]
    assert outcome.misses == len(analysis.entries) * len(ob.available()) and outcome.hits == 0
    assert any("Results for 4 tensors" in s.value for s in ran.success)


@pytest.mark.parametrize("page", ["overview", "ranges", "scales", "error", "export"])
def test_every_result_page_renders_plots_without_errors(ran, page):
    _page(ran, page)
    _ok(ran)
    if page != "export":
        assert _plotly_count(ran) >= 1


def test_ranges_options_change_the_plot_not_the_results(ran):
    _page(ran, "ranges")
    cache = ran.session_state[ui.RESULT_CACHE]
    before = (cache.hits, cache.misses)
    ran.checkbox(key="w:ranges_abs").check()
    ran.radio(key="w:ranges_zoom").set_value("right tail")
    ran.run()
    _ok(ran)
    assert (cache.hits, cache.misses) == before
    assert _plotly_count(ran) == 2  # weight: histogram, per-channel ranges
    ran.selectbox(key="w:tensor").set_value((LAYERS[1], "input")).run()
    _ok(ran)
    assert _plotly_count(ran) == 3  # activation: histogram, per-token vs per-channel, per-channel ranges


def test_export_defaults_to_best_and_round_trips_through_import(ran):
    _page(ran, "export")
    _ok(ran)
    analysis = ran.session_state[ui.ANALYSIS]
    assert ran.session_state["final_choices"] == choose(analysis, "sqnr_db")
    labels = [b.proto.label for b in ran.get("download_button")]
    assert "Observer Lab JSON" in labels and "compressed-tensors (zip)" in labels
    override = {key: "memoryless_minmax" for key in ui.tensor_keys(analysis)}
    text = ui.json_export(analysis, override, "sqnr_db", None)
    ran.file_uploader(key="import_file").set_value(("prev.json", text.encode(), "application/json"))
    ran.run()
    _ok(ran)
    assert ran.session_state["final_choices"] == override
    assert any("Restored 4 choice" in s.value for s in ran.success)
    ran.file_uploader(key="import_file").set_value(("broken.json", b"{not json", "application/json"))
    ran.run()
    assert not ran.exception
    assert any("Importing broken.json failed" in e for e in _errors(ran))


def test_changing_one_knob_recomputes_only_that_observer(ran):
    _page(ran, "run")
    knob = ran.number_input(key="w:knob:moving_average_minmax:averaging_constant")
    knob.set_value(0.5)
    ran.run()
    _button(ran, "Run").click()
    ran.run()
    _ok(ran)
    outcome = ran.session_state[ui.LAST_RUN]
    tensors = len(outcome.analysis.entries)
    assert outcome.misses == tensors
    assert outcome.hits == tensors * (len(ob.available()) - 1)
    for entry in outcome.analysis.entries:
        assert entry.result("moving_average_minmax").knobs["averaging_constant"] == 0.5


def test_preset_fills_the_spec_editors():
    at = _open_model_page()
    _page(at, "run")
    at.selectbox(key="w:preset").set_value("W4A16").run()
    _ok(at)
    assert at.selectbox(key="w:weight_dtype").value == "int4"
    assert at.selectbox(key="w:weight_strategy").value == "group"
    assert at.number_input(key="w:weight_group_size").value == 128
    assert at.session_state["want_input"] is False
    at.selectbox(key="w:preset").set_value("MXFP4").run()
    _ok(at)
    assert at.selectbox(key="w:weight_dtype").value == "mxfp4"
    assert at.selectbox(key="w:weight_scale_rounding").value == "floor"
    assert at.session_state["want_input"] is True


def test_format_box_lists_every_dtype_grouped_by_family():
    at = _open_model_page()
    _page(at, "run")
    options = at.selectbox(key="w:weight_dtype").options
    assert sorted(options) == sorted(f"{getattr(f, 'family', 'other')} · {n}" for n, f in ob.FORMATS.items())
    families = [o.split(" · ")[0] for o in options]
    assert families == sorted(families, key=list(dict.fromkeys(families)).index), "families are contiguous"
    assert families[0] == "integer"


def test_sessions_do_not_see_each_others_state(ran):
    other = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert ui.ANALYSIS not in other.session_state
    _page(other, "error")
    assert any("No results yet" in i.value for i in other.info)


# ---------------------------------------------------------------- error paths


def _expect_error(at: AppTest, text: str) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert any(text in e for e in _errors(at)), _errors(at)


def _recovers(at: AppTest) -> None:
    at.radio(key="w:source_kind").set_value("minilm").run()
    _ok(at)
    assert at.multiselect(key="w:layers").value


def test_bad_safetensors_upload_shows_error():
    at = _open_model_page()
    at.radio(key="w:source_kind").set_value("upload").run()
    at.file_uploader(key="source_upload").set_value(("broken.safetensors", b"\x00" * 64, "application/octet-stream"))
    at.run()
    _expect_error(at, "Opening")
    _recovers(at)


def test_missing_local_directory_shows_error(tmp_path):
    at = _open_model_page()
    at.radio(key="w:source_kind").set_value("dir").run()
    at.text_input(key="w:source_dir").input(str(tmp_path / "nope")).run()
    _expect_error(at, "nope")
    _recovers(at)


def test_hub_id_without_network_shows_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = _open_model_page()
    at.radio(key="w:source_kind").set_value("hub").run()
    at.text_input(key="w:source_hub").input("nobody/no-such-model").run()
    _expect_error(at, "nobody/no-such-model")
    _recovers(at)


def test_layer_filter_without_match_shows_error():
    at = _open_model_page()
    at.text_input(key="w:layer_filter").input("no_layer_is_called_this").run()
    _expect_error(at, "No layer matches")
    at.text_input(key="w:layer_filter").input("re:[").run()
    _expect_error(at, "regular expression")
    at.text_input(key="w:layer_filter").input("intermediate").run()
    _ok(at)
    assert len(at.dataframe[0].value) == 6


def test_cuda_without_gpu_shows_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    at = _open_model_page()
    at.selectbox(key="w:device").set_value("cuda").run()
    _expect_error(at, "no usable GPU")
    at.selectbox(key="w:device").set_value("cpu").run()
    _ok(at)


def test_run_error_is_shown_and_the_app_keeps_working(ran):
    _page(ran, "model")
    ran.radio(key="w:calib_kind").set_value("pasted").run()
    _page(ran, "run")
    _button(ran, "Run").click()
    ran.run()
    _expect_error(ran, "calibration text is empty")
    _page(ran, "model")
    ran.radio(key="w:calib_kind").set_value("built-in").run()
    _ok(ran)


def test_json_export_is_valid_json(ran):
    analysis = ran.session_state[ui.ANALYSIS]
    document = json.load(io.StringIO(ui.json_export(analysis, choose(analysis), "sqnr_db", None)))
    assert len(document["entries"]) == len(analysis.entries)
