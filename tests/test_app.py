"""The Streamlit app driven headless with AppTest: default flow, caching, presets, export/import
and every error path (each shows st.error and no exception, and the app keeps working)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import results, settings, ui
from lab.calibrate.capture_memo import CapturingModel
from lab.export import lab_json
from lab.messages import explain
from lab.results import choose
from observers.formats import FAMILIES

APP = str(Path(__file__).resolve().parents[1] / "app.py")
LAYERS = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]  # one fused unit
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


def _ws(at: AppTest):
    return at.session_state[ui.WORKSPACE]


def _plotly_count(at: AppTest) -> int:
    return len(at.get("plotly_chart"))


@pytest.fixture(scope="module")
def ran() -> AppTest:
    """The default flow on MiniLM: two small layers, weights and inputs, every observer."""
    at = _open_model_page()
    _ok(at)
    assert at.multiselect(key="w:layers").value == settings.default_layer_names(
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
    assert _ws(at).analysis is None


def test_default_run_stores_every_applicable_observer_on_every_tensor(ran):
    analysis = _ws(ran).analysis
    assert [(e.layer, e.tensor) for e in analysis.entries] == [(lay, t) for lay in LAYERS for t in ("weight", "input")]
    for entry in analysis.entries:
        kind = "weight" if entry.tensor == "weight" else "activation"
        assert [r.name for r in entry.results] == ob.applicable(entry.spec, kind)
        assert all(r.error is None and r.qparams is not None for r in entry.results), entry.tensor
    inputs = analysis.entry(LAYERS[0], "input").data
    assert inputs.shape[1] == 384 and 0 < inputs.shape[0] <= 4 * 32
    outcome = _ws(ran).last_run
    own = [results.per_layer(e) for e in analysis.entries]  # the cache holds each layer's own results
    computed = {id(r) for found in own for r in found}
    assert outcome.misses == len(computed)  # the query, key and value layers read one input: observed once
    assert outcome.hits == sum(map(len, own)) - len(computed)
    assert any("Results for 6 tensors" in s.value for s in ran.success)


@pytest.mark.parametrize("page", ["overview", "ranges", "scales", "error", "export"])
def test_every_result_page_renders_plots_without_errors(ran, page):
    _page(ran, page)
    _ok(ran)
    if page != "export":
        assert _plotly_count(ran) >= 1


def test_error_page_shows_a_fused_tensor_as_served_beside_its_own(ran):
    """q, k and v read one input, whose static int8 scale a fusing server keeps one of: the table has
    each layer's own figures beside the served ones, and the picked input its "As served" section."""
    _page(ran, "error")
    _ok(ran)
    table = ran.dataframe[0].value
    assert {"per-layer:sqnr_db", "fused as", "scale set by"} <= set(table.columns)
    inputs = table[table["tensor"] == "input"]
    assert inputs["fused as"].str.startswith("encoder.layer.0.attention.self qkv_proj").all()
    ran.selectbox(key="w:tensor").set_value((LAYERS[1], "input")).run()
    _ok(ran)
    assert any(h.value == "As served" for h in ran.subheader)
    served = next(frame.value for frame in ran.dataframe if "sqnr_db per layer" in frame.value.columns)
    assert set(served["scale set by"]) <= set(LAYERS) and len(served) >= 1
    assert any("A fusing server (vLLM, SGLang) runs query, key, value" in c.value for c in ran.caption)
    weight = _ws(ran).analysis.entry(LAYERS[1], "weight")
    assert weight.served is None  # int4 groups: each layer keeps its own scales
    ran.selectbox(key="w:tensor").set_value((LAYERS[0], "weight")).run()  # the picker as the next tests expect it


def test_ranges_options_change_the_plot_not_the_results(ran):
    _page(ran, "ranges")
    cache = _ws(ran).result_cache
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
    analysis = _ws(ran).analysis
    assert _ws(ran).choices()[0] == choose(analysis, "sqnr_db")
    labels = [b.proto.label for b in ran.get("download_button")]
    assert "Observer Lab JSON" in labels and "compressed-tensors (zip)" in labels
    override = {key: "memoryless_minmax" for key in analysis.keys()}
    data = lab_json.save(analysis, override, "sqnr_db")
    ran.file_uploader(key="import_file").set_value(("prev.json", data, "application/json"))
    ran.run()
    _ok(ran)
    assert _ws(ran).choices()[0] == override
    assert any("Restored 6 choice" in s.value for s in ran.success)
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
    outcome = _ws(ran).last_run
    tensors = len(outcome.analysis.entries)
    own = [results.per_layer(entry) for entry in outcome.analysis.entries]
    recomputed = {id(r) for found in own for r in found if r.name == "moving_average_minmax"}
    # each layer's weight, and the one input the three layers read (observed once)
    assert outcome.misses == len(recomputed) == tensors - len(LAYERS) + 1
    assert outcome.hits == sum(map(len, own)) - len(recomputed)
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
    assert _ws(at).settings.wants["input"] is False
    at.selectbox(key="w:preset").set_value("MXFP4").run()
    _ok(at)
    assert at.selectbox(key="w:weight_dtype").value == "mxfp4"
    assert at.selectbox(key="w:weight_scale_rounding").value == "floor"
    assert _ws(at).settings.wants["input"] is True


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
    assert _ws(other).analysis is None
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


def test_hub_id_on_an_offline_server_is_refused_before_any_lookup(monkeypatch):
    """A server started offline (``scripts/app.sh``'s default) fetches no hub id typed in a browser:
    the page says so on the source itself and refuses the id with one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = _open_model_page()
    at.radio(key="w:source_kind").set_value("hub").run()
    assert any("runs offline" in c.value for c in at.caption)
    at.text_input(key="w:source_hub").input("nobody/no-such-model").run()
    _expect_error(at, "this server runs offline (HF_HUB_OFFLINE=1)")
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
    analysis = _ws(ran).analysis
    document = json.loads(lab_json.save(analysis, choose(analysis), "sqnr_db"))
    assert len(document["entries"]) == len(analysis.entries)


# ---------------------------------------------------------------- lab.ui helpers without a browser


def test_layer_pattern_and_default_layers():
    from sample_models import LayerInfo

    assert settings.layer_pattern("  ") is None
    assert settings.layer_pattern("dense") == "*dense*"
    assert settings.layer_pattern("*.dense") == "*.dense"
    assert settings.layer_pattern("re:enc.*") == "re:enc.*"
    infos = [LayerInfo("emb", "Embedding", (10, 4), 40)] + [LayerInfo(f"l{i}", "Linear", (4, 4), 16) for i in range(8)]
    assert settings.default_layer_names(infos) == [f"l{i}" for i in range(6)]
    assert settings.default_layer_names(infos[:1]) == ["emb"]


def test_spec_settings_set_only_what_the_format_uses():
    assert settings.SpecSettings("int4", False, "group", group_size=64).spec() == ob.QuantSpec(
        dtype="int4", symmetric=False, strategy="group", group_size=64
    )
    assert settings.SpecSettings("int8", True, "block", block_rows=32, block_cols=16).spec().block_size == (32, 16)
    assert settings.SpecSettings("fp8_e4m3", False, "channel").spec().symmetric is True
    for name in ob.PRESET_NAMES:
        for spec in ob.preset(name).values():
            if spec is not None:
                assert settings.SpecSettings.from_spec(spec).spec() == spec, name
    with pytest.raises(ValueError):
        settings.SpecSettings("int8", True, "group", group_size=0).spec()


def test_formats_grouped_by_family_cover_every_dtype_once():
    groups = settings.formats_by_family()
    flat = [name for names in groups.values() for name in names]
    assert sorted(flat) == sorted(ob.FORMATS) and len(flat) == len(set(flat))
    known = [f for f in FAMILIES if f in groups]
    assert list(groups)[: len(known)] == known


def test_knob_overrides_keep_only_changed_knobs():
    name = next(n for n in ob.available() if any(isinstance(v, float) for v in ob.knobs(n).values()))
    knob, default = next((k, v) for k, v in ob.knobs(name).items() if isinstance(v, float))
    assert settings.knob_overrides({name: dict(ob.knobs(name))}) == {}
    assert settings.knob_overrides({name: {**ob.knobs(name), knob: default / 2}}) == {name: {knob: default / 2}}


def test_explain_says_what_to_do():
    from sample_models import LayerNotFoundError, ModelSourceError

    assert "fewer layers" in explain(MemoryError("boom"))
    assert "'auto' or 'cpu'" in explain(ValueError("device 'cuda' requested but CUDA is not available"))
    assert "built-in sample" in explain(ModelSourceError("x is not a model"))
    assert "Model page" in explain(LayerNotFoundError("no layer 'x'"))
    assert explain(RuntimeError("odd")) == "RuntimeError: odd"


def test_token_warnings_flag_empty_and_tiny_activations():
    from lab.analyse.analysis import Analysis, TensorAnalysis
    from lab.analyse.model_facts import ModelFacts
    from lab.analyse.run_config import RunConfig

    spec = ob.QuantSpec()
    entries = [
        TensorAnalysis("e0", "input", spec, torch.zeros(0, 8), ob.run_suite(torch.zeros(0, 8) + 1, spec, ["minmax"])),
        TensorAnalysis(
            "e1", "input", spec, torch.ones(3, 8), ob.run_suite(torch.ones(3, 8), spec, ["minmax"], "activation")
        ),
        TensorAnalysis("e2", "input", spec, torch.ones(64, 8), []),
        TensorAnalysis("w", "weight", spec, torch.ones(2, 8), []),
    ]
    notes = results.token_warnings(Analysis(ModelFacts({}), RunConfig(specs={"input": spec}), entries))
    assert len(notes) == 2
    assert "e0 · input: no tokens" in notes[0] and "only 3 tokens" in notes[1]


def test_best_mask_follows_metric_direction():
    import pandas as pd

    frame = pd.DataFrame(
        {
            "layer": ["a", "a", "b", "b"],
            "tensor": ["weight"] * 4,
            "observer": ["x", "y", "x", "y"],
            "sqnr_db": [10.0, 20.0, 5.0, None],
            "mse": [1.0, 2.0, 3.0, 1.0],
        }
    )
    assert results.best_mask(frame, "sqnr_db").tolist() == [False, True, True, False]
    assert results.best_mask(frame, "mse").tolist() == [True, False, False, True]


def test_capturing_model_memoizes_one_capture():
    calls = []

    class Captured(dict):
        def report(self, done):
            done(list(self), dict(self), {})

    class Model:
        source = "m"

        def capture(self, names, stream=None, done=None, **kwargs):
            calls.append((tuple(names), kwargs))
            return Captured(x=len(calls))

    store: dict = {}
    wrapped = CapturingModel(Model(), store)
    assert wrapped.capture(["a"], samples=4) == {"x": 1}
    assert wrapped.capture(["a"], samples=4) == {"x": 1}
    assert wrapped.capture(["a"], samples=8) == {"x": 2}
    assert wrapped.source == "m" and len(calls) == 2
    assert wrapped.capture(["a"], samples=8, stream=print) == {"x": 3}  # observers need the batches: it runs
    replayed = []
    assert wrapped.capture(["a"], samples=8, done=lambda *args: replayed.append(args)) == {"x": 3}
    assert replayed == [(["x"], {"x": 3}, {})] and len(calls) == 3  # a memo hit tells ``done`` at once


def test_layer_output_error_toggle_shows_three_modes_per_observer(ran):
    _page(ran, "error")
    assert _plotly_count(ran) == 2  # metric bars, error histogram
    ran.toggle(key="w:layer_output").set_value(True).run()
    _ok(ran)
    assert _plotly_count(ran) == 3  # plus the layer-output bars
    analysis = _ws(ran).analysis
    rows = results.layer_output_rows(ui.open_shared_model("minilm", "auto", "fp32"), analysis, ["minmax", "percentile"])
    assert len(rows) == len(LAYERS) * 2 * 3
    assert set(rows["quantized"]) == {"weight only", "activation only", "both"}
    both = rows.set_index(["layer", "observer", "quantized"])["sqnr_db"]
    for layer in LAYERS:
        assert both[(layer, "minmax", "both")] <= both[(layer, "minmax", "weight only")] + 1.0
