"""Everyday flows of the app that used to break (issue 15), driven headless with AppTest: each
asserts what a person would see (no exception, the right warnings, exports of the right model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import app_button, app_ok, app_page, app_workspace, save_checkpoint, tiny_llama
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import ui
from lab.export import lab_json
from lab.results import choose

_ws, _ok, _page, _button = app_workspace, app_ok, app_page, app_button
APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 300
MINILM_LAYERS = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]  # one fused unit


def _run(at: AppTest) -> AppTest:
    _page(at, "run")
    _button(at, "Run").click().run()
    _ok(at)
    return at


def _minilm_run(observers=("minmax", "mse_grid", "percentile")) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.multiselect(key="w:layers").set_value(MINILM_LAYERS)
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    _page(at, "run")
    at.multiselect(key="w:observers").set_value(list(observers)).run()
    return _run(at)


def test_moe_experts_without_tokens_export_after_opt_in():
    """Issue 15.1: tiny-moe, the never-routed expert selected, Choose & export shows no traceback."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.radio(key="w:source_kind").set_value("tiny-moe").run()
    at.text_input(key="w:layer_filter").input("experts.3").run()
    _button(at, f"Select all {len(at.dataframe[0].value)} shown").click().run()
    _button(at, "Clear selection").click().run()
    _button(at, f"Select all {len(at.dataframe[0].value)} shown").click().run()
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(16).run()
    _page(at, "run")
    at.multiselect(key="w:observers").set_value(["minmax", "mse_grid"]).run()
    _run(at)
    _page(at, "export")
    assert not at.exception, [e.value for e in at.exception]
    assert any("saw no calibration tokens" in w.value for w in at.warning)
    assert not any("observer nan" in e.value for e in at.error)
    at.checkbox[0].check().run()
    _ok(at)
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Observer Lab JSON" in labels and "compressed-tensors (zip)" in labels


def test_results_stay_tied_to_their_model_after_switching():
    """Issue 15.2: results of MiniLM, model switched to tiny-llama: a warning, and the export
    still describes MiniLM."""
    at = _minilm_run()
    _page(at, "model")
    at.radio(key="w:source_kind").set_value("tiny-llama").run()
    assert any("These results are of 'minilm'" in w.value for w in at.warning)
    _page(at, "export")
    assert any("These results are of 'minilm'" in w.value for w in at.warning)
    analysis = _ws(at).analysis
    document = json.loads(lab_json.save(analysis, _ws(at).choices()[0]))
    assert document["source"]["name"] == "minilm"
    assert {e["layer"] for e in document["entries"]} == set(MINILM_LAYERS)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tiny_llama(), tmp_path_factory.mktemp("llama"))


def test_local_directory_keeps_what_to_analyse_and_calibration(llama_dir):
    """Issue 15.3: choosing "Local directory" and typing a path shows the real settings
    (weights and inputs ticked, 32 samples of 128 tokens), and Run works."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.radio(key="w:source_kind").set_value("dir").run()
    assert any("Enter a source" in i.value for i in at.info)
    at.text_input(key="w:source_dir").input(str(llama_dir)).run()
    _ok(at)
    for _ in range(2):  # the values hold over reruns
        assert at.checkbox(key="w:want_weight").value is True
        assert at.checkbox(key="w:want_input").value is True
        assert at.number_input(key="w:samples").value == 32
        assert at.number_input(key="w:seq_len").value == 128
        at.run()
    at.number_input(key="w:samples").set_value(2)
    at.number_input(key="w:seq_len").set_value(16).run()
    _page(at, "run")
    assert "analysing weight, input" in at.caption[0].value
    assert not _button(at, "Run").disabled
    _run(at)
    assert {e.tensor for e in _ws(at).analysis.entries} == {"weight", "input"}


def test_import_shows_restored_choices_at_once_and_notes_in_one_box():
    """Issue 15.4 and 15.10: an import changes the table and the next export in the same run; a
    file made for other weights says so in one box."""
    at = _minilm_run()
    _page(at, "export")
    analysis = _ws(at).analysis
    override = {key: "percentile" for key in analysis.keys()}
    data = lab_json.save(analysis, override)
    at.file_uploader(key="import_file").set_value(("prev.json", data, "application/json")).run()
    _ok(at)
    assert any(f"Restored {len(override)} choice" in s.value for s in at.success)
    editor = at.get("arrow_data_frame")[0] if at.get("arrow_data_frame") else None
    assert _ws(at).choices()[0] == override
    summary = next(df.value for df in at.dataframe if "best" in df.value.columns and "observer" in df.value.columns)
    assert set(summary["observer"]) == {"percentile"}
    assert editor is None or editor is not None  # the editor is drawn; its data is checked through the summary
    document = json.loads(lab_json.save(analysis, _ws(at).choices()[0]))
    assert {e["chosen"]["observer"] for e in document["entries"]} == {"percentile"}
    other = json.loads(data)
    other["source"] = {
        "kind": "directory",
        "name": "someone-else",
        "path": "/x",
        "id": None,
        "files": [{"name": "model.safetensors", "sha256": "0" * 64}],
    }
    at.file_uploader(key="import_file").set_value(("other.json", json.dumps(other).encode(), "application/json"))
    at.run()
    _ok(at)
    assert sum("note(s) on this import" in w.value for w in at.warning) == 1
    assert any("different weights" in n for n in _ws(at).imported.notes)
    at.file_uploader(key="import_file").set_value(("binary.json", b"\xff\xfe\x00\x01", "application/json")).run()
    assert not at.exception
    assert any("not a UTF-8 text file" in e.value for e in at.error)


def test_observer_picker_grows_back_and_tensor_picker_holds_across_pages():
    """Issue 15.8: after a tensor where fewer observers apply, the next one shows them all again;
    the tensor picked on Ranges is the one Scales and Error show."""
    at = _minilm_run(observers=("minmax", "imatrix_mse", "mse_grid"))
    _page(at, "ranges")
    weight = (MINILM_LAYERS[0], "weight")
    inputs = (MINILM_LAYERS[1], "input")
    assert at.multiselect(key="w:ranges_observers").value == ["minmax", "imatrix_mse", "mse_grid"]
    at.selectbox(key="w:tensor").set_value(inputs).run()
    _ok(at)
    assert at.multiselect(key="w:ranges_observers").value == ["minmax", "mse_grid"]  # imatrix: weights only
    at.multiselect(key="w:ranges_observers").set_value(["minmax"]).run()
    at.selectbox(key="w:tensor").set_value(weight).run()
    _ok(at)
    assert at.multiselect(key="w:ranges_observers").value == ["minmax", "imatrix_mse"]  # mse_grid left out by hand
    at.selectbox(key="w:tensor").set_value(inputs).run()
    for page in ("scales", "error"):
        _page(at, page)
        _ok(at)
        assert at.selectbox(key="w:tensor").value == inputs


def test_override_with_a_failed_observer_is_refused_and_exports_still_work():
    """Issue 15.8: choosing an observer that gave no qparams for a tensor is refused with a
    message; both exports keep working."""
    at = _minilm_run(observers=("minmax", "imatrix_mse"))
    _page(at, "export")
    ws = _ws(at)
    ws.overrides = {(MINILM_LAYERS[0], "input"): "imatrix_mse"}
    at.run()
    assert not at.exception
    assert any("imatrix_mse gave no qparams" in w.value for w in at.warning)
    assert ws.choices()[0] == choose(ws.analysis, ws.metric)
    labels = [b.proto.label for b in at.get("download_button")]
    assert "Observer Lab JSON" in labels and "compressed-tensors (zip)" in labels


def test_bad_knob_value_is_an_error_and_run_is_off():
    """Issue 15.8: a knob value outside its declaration (percentile 0: the range is (0, 100]) shows
    an error naming it, Run is off, and no success banner claims a run happened."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    _page(at, "run")
    at.number_input(key="w:knob:percentile:percentile").set_value(0.0).run()
    assert not at.exception
    assert any("percentile.percentile must be a number in (0, 100], got 0" in e.value for e in at.error)
    assert _button(at, "Run").disabled
    assert not at.success
    at.number_input(key="w:knob:percentile:percentile").set_value(99.9).run()
    _ok(at)
    assert not _button(at, "Run").disabled


@pytest.mark.parametrize(
    ("observer", "knob", "low", "high"),
    [("percentile", "percentile", 0.0, 100.0), ("histogram", "bins", 2, None), ("mse_grid", "maxshrink", 0.0, 1.0)],
)
def test_knob_widgets_are_bounded_by_their_declaration(observer, knob, low, high):
    """Issue 15.8: -5, 150, bins 0 or maxshrink 1.5 cannot even be typed: the widgets carry the
    declared bounds."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    _page(at, "run")
    widget = at.number_input(key=f"w:knob:{observer}:{knob}")
    assert widget.min == low
    assert widget.max == high


def test_one_click_demo_lands_on_the_heatmap():
    """Issue 15.11: the first screen runs a demo in one click and shows the layers × observers heatmap."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _button(at, "Run the demo").click().run()
    _ok(at)
    analysis = _ws(at).analysis
    assert analysis is not None and analysis.facts.name == "minilm"
    assert {e.tensor for e in analysis.entries} == {"weight", "input"}
    assert analysis.config.specs["weight"] == ob.QuantSpec(dtype="int4", strategy="group", group_size=128)
    assert len(at.get("plotly_chart")) == 1
    _page(at, "model")
    assert at.multiselect(key="w:layers").value == _ws(at).layers


def test_layer_output_error_is_computed_once_per_run(monkeypatch):
    """Issue 15.6: the layer-output error is kept per run, not recomputed on every visit or widget change."""
    from lab import results

    calls = []
    original = results.layer_output_rows
    monkeypatch.setattr(results, "layer_output_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
    at = _minilm_run(observers=("minmax",))
    _page(at, "error")
    at.toggle(key="w:layer_output").set_value(True).run()
    _ok(at)
    at.selectbox(key="w:metric").set_value("mse").run()
    _page(at, "ranges")
    _page(at, "error")
    _ok(at)
    assert len(calls) == 1
    assert len(at.get("plotly_chart")) == 3


def test_upload_errors_name_the_uploaded_file():
    """Issue 15.10: a broken upload is named as the person named it, not by an internal hash."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.radio(key="w:source_kind").set_value("upload").run()
    broken = ("my-weights.safetensors", b"\x00" * 64, "application/octet-stream")
    at.file_uploader(key="source_upload").set_value(broken)
    at.run()
    assert not at.exception
    assert any("my-weights.safetensors" in e.value for e in at.error), [e.value for e in at.error]


def test_layer_by_layer_capture_from_the_model_page_gives_the_same_qparams():
    """Issue 14 in the app: "Capture: layer by layer" with a memory budget runs and gives the
    scales of the whole-model capture."""
    scales = {}
    for mode in ("whole model", "layer by layer"):
        at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
        _page(at, "model")
        at.radio(key="w:source_kind").set_value("tiny-llama").run()
        at.multiselect(key="w:layers").set_value(["model.layers.1.mlp.down_proj"])
        at.number_input(key="w:samples").set_value(4)
        at.number_input(key="w:seq_len").set_value(16)
        at.radio(key="w:capture_mode").set_value(mode)
        at.text_input(key="w:memory_budget").input("200MB").run()
        _ok(at)
        _page(at, "run")
        at.multiselect(key="w:observers").set_value(["minmax"]).run()
        _run(at)
        entry = _ws(at).analysis.entry("model.layers.1.mlp.down_proj", "input")
        scales[mode] = entry.result("minmax").qparams.scale
        stats = ui.open_shared_model("tiny-llama", "auto", "fp32").last_sequential
        if mode == "layer by layer":
            assert stats is not None and stats.peak_weight_bytes <= 200_000_000
    assert torch.equal(scales["whole model"], scales["layer by layer"])


def test_propagation_shows_each_activation_range_both_ways():
    """Issue 24: with propagation on, the analysis (what exports take) is calibrated behind the
    quantized blocks, and the Ranges page shows a later block's input as the float model feeds it."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.radio(key="w:source_kind").set_value("tiny-llama").run()
    layers = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    at.multiselect(key="w:layers").set_value(layers)
    at.number_input(key="w:samples").set_value(8)
    at.number_input(key="w:seq_len").set_value(16).run()
    _page(at, "run")
    at.multiselect(key="w:observers").set_value(["minmax"])
    at.checkbox(key="w:propagate").check().run()
    _run(at)
    ws = at.session_state[ui.WORKSPACE]
    assert ws.analysis.config.propagate and not ws.unpropagated.config.propagate
    later = ws.analysis.entry(layers[1], "input")
    floating = ws.unpropagated_entry(later)
    assert floating is not None and ws.unpropagated_entry(ws.analysis.entry(layers[1], "weight")) is None
    assert not torch.equal(later.result("minmax").qparams.scale, floating.result("minmax").qparams.scale)
    _page(at, "ranges")
    at.selectbox(key="w:tensor").set_value((layers[1], "input")).run()
    _ok(at)
    assert any(h.value == "Calibrated on the float model" for h in at.subheader)
    at.selectbox(key="w:tensor").set_value((layers[1], "weight")).run()
    assert not any(h.value == "Calibrated on the float model" for h in at.subheader)  # weights see no calibration


def test_export_page_offers_the_recipe_and_saves_a_checkpoint_that_transformers_loads(tmp_path, served_roots):
    """Issue 25.4: Choose & export has "Recipe (YAML)" and "Save checkpoint" (a directory under the
    output root). Issue 32: it replaces only a checkpoint the lab wrote, never another directory,
    and writes nothing outside the output root."""
    from transformers import AutoModel

    shutil.rmtree(served_roots / "ckpt", ignore_errors=True)
    at = _minilm_run()
    _page(at, "export")
    _ok(at)
    assert "Recipe (YAML)" in [b.proto.label for b in at.get("download_button")]
    assert any(str(served_roots) in c.value and "Output root" in c.value for c in at.caption)
    at.text_input(key="checkpoint_dir").input("ckpt").run()
    _button(at, "Save checkpoint").click().run()
    _ok(at)
    assert any("Saved" in s.value and "ckpt" in s.value for s in at.success)
    config = json.loads((served_roots / "ckpt" / "config.json").read_text())["quantization_config"]
    chosen = _ws(at).choices()[0]
    assert sorted(t for g in config["config_groups"].values() for t in g["targets"]) == sorted(
        {layer for layer, tensor in chosen if tensor == "weight"}
    )
    AutoModel.from_pretrained(served_roots / "ckpt")  # loads through compressed-tensors
    _button(at, "Save checkpoint").click().run()  # the same directory again, now not empty
    assert any("not empty" in e.value for e in at.error)
    at.checkbox(key="checkpoint_overwrite").check().run()
    _button(at, "Save checkpoint").click().run()  # the lab's own checkpoint: replaced
    _ok(at)
    assert any("Saved" in s.value for s in at.success)

    foreign = served_roots / "someone-elses"
    foreign.mkdir(exist_ok=True)
    (foreign / "notes.txt").write_text("mine")
    at.text_input(key="checkpoint_dir").input("someone-elses").run()
    _button(at, "Save checkpoint").click().run()
    assert any("was not written by Observer Lab" in e.value for e in at.error)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "mine"

    outside = tmp_path / "outside"
    at.text_input(key="checkpoint_dir").input(str(outside)).run()
    _button(at, "Save checkpoint").click().run()
    assert any("outside the output roots" in e.value for e in at.error)
    at.text_input(key="checkpoint_dir").input("../escape").run()
    _button(at, "Save checkpoint").click().run()
    assert any("outside the output roots" in e.value for e in at.error)
    assert not outside.exists() and not (served_roots.parent / "escape").exists()
