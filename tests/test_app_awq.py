"""AWQ in the app (issue 41, item 5), driven headless with AppTest: the Run page's switch and knobs
(defaults, bounds and help from ``observers.AWQ_KNOBS``, kept across pages, a value ``AWQSpec``
refuses one line with Run off), a run on tiny-llama's first block, the Error page's "Under AWQ"
section for the picked balance layer (its table is ``awq_frame``'s rows of the layer's mapping, all
four variants) and the Ranges page's smoothed weight; MiniLM, an encoder, is one error line. The
bar chart and the turnover sentence are checked on their data first."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import app_button, app_ok, app_page, app_run_page, app_workspace
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import ui
from lab.awq.options import conflict
from lab.awq.search import Variant
from lab.awq.session import AWQResult
from lab.awq.table import awq_frame
from lab.results import plots
from lab.results.plots.ranges import value_histogram
from lab.results.ranges import envelope
from observers.suite import SuiteResult

_ws, _ok, _page, _button = app_workspace, app_ok, app_page, app_button
APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 300
BLOCK = "model.layers.0"
LAYERS = [f"{BLOCK}.self_attn.{p}_proj" for p in "qkv"]  # one mapping: input_layernorm → q/k/v
OBSERVERS = ["memoryless_minmax", "mse_grid"]
VARIANTS = [str(v) for v in Variant]
N_GRID = 4


# ------------------------------------------------------------------------------ the bars, on their data


def _figure(at: AppTest, index: int) -> dict:
    """The page's ``index``-th plotly chart as its JSON, arrays decoded (plotly writes numpy arrays
    as base64 ``bdata``)."""

    def decoded(value):
        if isinstance(value, dict) and set(value) >= {"dtype", "bdata"}:
            return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        if isinstance(value, dict):
            return {k: decoded(v) for k, v in value.items()}
        return [decoded(v) for v in value] if isinstance(value, list) else value

    return decoded(json.loads(at.get("plotly_chart")[index].proto.spec))


def _frame(errors: dict[str, list[float]], mapping: str = "m") -> pd.DataFrame:
    """``awq_frame``-shaped rows of one mapping: per observer its four variants' errors (None: an error row)."""
    rows = []
    for observer, values in errors.items():
        for variant, value in zip(VARIANTS, values, strict=True):
            smoothed = variant != "rtn"
            rows.append(
                {
                    "mapping": mapping,
                    "observer": observer,
                    "variant": variant,
                    "mapping_error": value,
                    "held_out_error": None if value is None else value * 1.1,
                    "clipped": 0.01,
                    "ratio": 0.5 if smoothed else None,
                    "duo": True if smoothed else None,
                    "error": "no qparams" if value is None else None,
                }
            )
    frame = pd.DataFrame(rows)
    frame["rank"] = frame.groupby("variant")["mapping_error"].rank(method="min").astype("Int64")
    return frame


def test_awq_bars_group_the_observers_under_each_variant_with_their_ranks():
    frame = _frame({"minmax": [0.01, 0.008, 0.006, 0.004], "mse_grid": [0.02, 0.007, 0.005, None]})
    fig = plots.awq_bars(frame)
    assert [t.name for t in fig.data] == ["minmax", "mse_grid"]
    a, b = fig.data
    assert list(a.x) == VARIANTS and list(a.y) == [0.01, 0.008, 0.006, 0.004]
    assert list(a.text) == ["#1", "#2", "#2", "#1"]
    assert list(b.x) == VARIANTS[:3] and list(b.text) == ["#2", "#1", "#1"]  # b's error row is left out
    assert fig.layout.barmode == "group" and fig.layout.yaxis.type == "linear"
    assert list(fig.layout.xaxis.categoryarray) == VARIANTS
    assert a.customdata[0][2] == "not smoothed" and a.customdata[1][2] == "r = 0.50"
    assert [t.marker.color for t in fig.data] == [plots.observer_color(t.name) for t in fig.data]


def test_awq_bars_go_log_when_errors_span_orders_of_magnitude_and_take_one_mapping():
    fig = plots.awq_bars(_frame({"a": [0.1, 0.05, 0.01, 0.001]}))
    assert fig.layout.yaxis.type == "log"
    two = pd.concat([_frame({"a": [0.1] * 4}, "m1"), _frame({"a": [0.1] * 4}, "m2")])
    with pytest.raises(ValueError, match="one mapping at a time"):
        plots.awq_bars(two)


def _result(frame: pd.DataFrame) -> tuple[AWQResult, SimpleNamespace]:
    """An ``AWQResult`` over ``frame`` alone, and its mapping as the pages hand it over."""
    return AWQResult(None, frame, None, 0.0, lambda: None), SimpleNamespace(mapping=SimpleNamespace(name="m"))


def test_the_turnover_sentence_names_where_the_best_observer_changes():
    turned, mapping = _result(_frame({"a": [0.01, 0.008, 0.006, 0.004], "b": [0.02, 0.007, 0.005, 0.005]}))
    assert turned.turnover(mapping) == (
        "Best by mapping error: rtn: a, llm-compressor: b, observer-in-search: b, clip-search: a. The ranking turns "
        "over between rtn and llm-compressor (a → b); observer-in-search and clip-search (b → a)."
    )
    kept, mapping = _result(_frame({"a": [0.01] * 4, "b": [0.02] * 4}))
    assert kept.turnover(mapping) == "Best by mapping error: a under every variant; the best does not change."


# ------------------------------------------------------------------------------ the app


def _run_page(source: str, layers: list[str]) -> AppTest:
    """``source`` with ``layers``, 4 samples of 32 tokens, on the Run page with two observers."""
    return app_run_page(APP, layers, OBSERVERS, source, TIMEOUT)


@pytest.fixture(scope="module")
def ran() -> AppTest:
    """tiny-llama's q/k/v of block 0, int4 symmetric groups of 16, AWQ on with 4 strengths, run."""
    at = _run_page("tiny-llama", LAYERS)
    at.selectbox(key="w:weight_dtype").set_value("int4").run()
    at.selectbox(key="w:weight_strategy").set_value("group").run()
    at.number_input(key="w:weight_group_size").set_value(16).run()
    assert at.toggle(key="w:awq").value is False
    at.toggle(key="w:awq").set_value(True).run()
    at.number_input(key="w:awq:n_grid").set_value(N_GRID).run()
    _ok(at)
    _button(at, "Run").click().run()
    _ok(at)
    return at


def _searched(at: AppTest):
    """The session's AWQ run beside its analysis, and the mapping of q/k/v."""
    ws = _ws(at)
    searched = ws.awq.shown_with(ws.analysis)
    return searched, searched.mapping_of(LAYERS[0])


def _model():
    """tiny-llama as the app opened it."""
    return ui.open_shared_model("tiny-llama", "auto", "fp32")


def test_the_knobs_are_the_librarys_and_out_of_bounds_is_refused():
    at = _run_page("minilm", ["encoder.layer.0.attention.self.query"])
    at.toggle(key="w:awq").set_value(True).run()
    _ok(at)
    for name, knob in ob.AWQ_KNOBS.items():
        widget = at.get("selectbox" if knob.choices else "number_input")
        shown = next(w for w in widget if w.key == f"w:awq:{name}")
        assert shown.value == knob.default and shown.help == knob.describe()
        if not knob.choices:
            assert (shown.min, shown.max) == tuple(float(v) for v in knob.widget_bounds().values())
    assert _ws(at).awq.asked() == ob.AWQSpec()
    high = ob.AWQ_KNOBS["n_grid"].high
    at.number_input(key="w:awq:n_grid").set_value(high + 1000).run()
    _ok(at)  # the widget's bounds refuse it: back within them
    kept = _ws(at).awq.asked().n_grid
    assert kept == at.number_input(key="w:awq:n_grid").value and ob.AWQ_KNOBS["n_grid"].low <= kept <= high
    at.number_input(key="w:awq:n_grid").set_value(20)
    at.number_input(key="w:awq:clip_min").set_value(1.0).run()  # the widget's open end: AWQSpec refuses it
    assert not at.exception
    assert len(at.error) == 1 and "clip_min" in at.error[0].value
    assert _button(at, "Run").disabled and any("Run is off: AWQ" in c.value for c in at.caption)


def test_a_transform_beside_awq_is_one_error_and_run_is_off():
    at = _run_page("minilm", ["encoder.layer.0.attention.self.query"])
    at.toggle(key="w:awq").set_value(True)
    at.selectbox(key="w:transform").set_value("hadamard").run()
    assert not at.exception
    asked = SimpleNamespace(transform="hadamard", propagate=False, sequential=None)
    assert [e.value for e in at.error] == [f"{conflict(asked)}."]
    assert _button(at, "Run").disabled
    at.selectbox(key="w:transform").set_value("none").run()
    _ok(at)
    assert not _button(at, "Run").disabled


def test_an_encoder_is_one_error_line_after_its_analysis():
    at = _run_page("minilm", ["encoder.layer.0.attention.self.query"])
    at.toggle(key="w:awq").set_value(True).run()
    _button(at, "Run").click().run()
    assert not at.exception
    assert len(at.error) == 1 and "minilm has no such layers" in at.error[0].value
    assert "switch AWQ off on the Run page" in at.error[0].value and "--awq" not in at.error[0].value
    assert _ws(at).analysis is not None and _ws(at).awq.result is None


def test_the_run_searches_the_analysis_layers_with_its_spec_observers_and_calibration(ran):
    _page(ran, "run")
    _ok(ran)
    searched, mapping = _searched(ran)
    found = searched.run
    assert [r.mapping.balance for r in found.results] == [tuple(LAYERS)]
    assert found.spec == ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    assert list(found.observers) == OBSERVERS and found.awq == ob.AWQSpec(n_grid=N_GRID)
    assert 0 < found.tokens <= 4 * 32 and 0 < found.held_out_tokens <= 4 * 32
    assert any(s.value.startswith("AWQ: 1 mapping(s) searched for 2 weight observer(s)") for s in ran.success)
    assert ran.number_input(key="w:awq:n_grid").value == N_GRID  # kept across pages
    assert ran.toggle(key="w:awq").value is True


def test_error_page_shows_the_mapping_of_the_picked_balance_layer(ran):
    _page(ran, "error")
    _ok(ran)
    searched, mapping = _searched(ran)
    frame = awq_frame(searched.run)
    expected = frame[frame["mapping"] == mapping.mapping.name].drop(columns=["mapping", "error"])
    for layer in LAYERS[:2]:
        ran.selectbox(key="w:tensor").set_value((layer, "weight")).run()
        _ok(ran)
        assert any(h.value == "Under AWQ" for h in ran.subheader)
        shown = next(d.value for d in ran.dataframe if "variant" in d.value.columns)
        pd.testing.assert_frame_equal(shown, expected.reset_index(drop=True), check_dtype=False)
        assert set(shown["variant"]) == set(VARIANTS) and set(shown["observer"]) == set(OBSERVERS)
        figure = _figure(ran, -1)
        assert [t["name"] for t in figure["data"]] == OBSERVERS and list(figure["data"][0]["x"]) == VARIANTS
        assert any(c.value == ui.plain(searched.turnover(mapping)) for c in ran.caption)


def test_an_input_tensor_points_to_the_weights(ran):
    _page(ran, "error")
    ran.selectbox(key="w:tensor").set_value((LAYERS[0], "input")).run()
    _ok(ran)
    assert any(h.value == "Under AWQ" for h in ran.subheader)
    assert any("pick a balance layer's weight" in c.value for c in ran.caption)


def test_the_model_level_effect_is_measured_when_asked(ran):
    _page(ran, "error")
    _ok(ran)
    searched, _ = _searched(ran)
    assert searched.effect is None
    _button(ran, "Measure each variant's model-level effect").click().run()
    _ok(ran)
    effect = searched.effect
    assert len(effect) == len(OBSERVERS) * len(Variant)
    assert any(d.value.equals(effect) for d in ran.dataframe)
    best = searched.effect_best()
    assert set(best) == set(VARIANTS)
    for variant, observer in best.items():
        rows = effect[effect["variant"] == variant]
        assert rows.loc[rows["kl"].idxmin(), "observer"] == observer


def test_ranges_draws_the_smoothed_weight_with_the_observers_range(ran):
    _page(ran, "ranges")
    ran.selectbox(key="w:tensor").set_value((LAYERS[2], "weight")).run()
    _ok(ran)
    assert any(h.value == "Under AWQ" for h in ran.subheader)
    ran.selectbox(key="w:ranges_awq_observer").set_value("mse_grid")
    ran.radio(key="w:ranges_awq_variant").set_value(str(Variant.OBSERVER_IN_SEARCH)).run()
    _ok(ran)
    searched, mapping = _searched(ran)
    key = (Variant.OBSERVER_IN_SEARCH, "mse_grid")
    scales = mapping.scales[key]
    assert not bool((scales == 1).all())  # a smoothing that moves the weight
    weight = _model().weight(LAYERS[2])
    smoothed = (weight.double() * scales.view(1, -1)).float()

    figure = _figure(ran, 1)  # the histogram after the weight's own
    assert "as observer-in-search smooths it for mse_grid" in figure["layout"]["title"]["text"]
    counts, lo, hi = _bars(figure)
    np.testing.assert_allclose(counts, value_histogram(smoothed, len(counts), lo, hi)[1])
    assert counts.sum() == smoothed.numel()
    assert not np.allclose(counts, value_histogram(weight, len(counts), lo, hi)[1])

    qparams = mapping.qparams[key][LAYERS[2]]
    drawn = SuiteResult("mse_grid", qparams, {}, 0.0)
    lines = sorted({round(shape["x0"], 6) for shape in figure["layout"]["shapes"]})
    assert lines == sorted(round(v, 6) for v in envelope(drawn, searched.run.spec))
    clipped = mapping.row(*key).clipped[LAYERS[2]]
    assert any(f"{clipped:.2%} of it lies outside" in c.value for c in ran.caption)

    ran.radio(key="w:ranges_awq_variant").set_value("rtn").run()
    _ok(ran)
    counts, lo, hi = _bars(_figure(ran, 1))
    np.testing.assert_allclose(counts, value_histogram(weight, len(counts), lo, hi)[1])
    assert torch.equal(searched.smoothed(_model(), mapping, LAYERS[2], Variant.RTN, "mse_grid")[0], weight)


def _bars(figure: dict) -> tuple[np.ndarray, float, float]:
    """A range histogram's counts and the value range its bins span."""
    bars = figure["data"][0]
    centers, width = np.asarray(bars["x"]), bars["width"]
    return np.asarray(bars["y"]), centers[0] - width / 2, centers[-1] + width / 2


def test_running_again_without_awq_drops_the_sections(ran):
    _page(ran, "run")
    ran.toggle(key="w:awq").set_value(False).run()
    _button(ran, "Run").click().run()
    _ok(ran)
    assert _ws(ran).awq.result is None
    assert not any(s.value.startswith("AWQ:") for s in ran.success)
    _page(ran, "error")
    _ok(ran)
    assert not any(h.value == "Under AWQ" for h in ran.subheader)
    _page(ran, "ranges")
    _ok(ran)
    assert not any(h.value == "Under AWQ" for h in ran.subheader)


def _run_with_awq(at: AppTest, n_grid: int) -> AppTest:
    """``at``'s Run page set to int4 symmetric groups of 16 with AWQ on at ``n_grid`` strengths, run."""
    at.selectbox(key="w:weight_dtype").set_value("int4").run()
    at.selectbox(key="w:weight_strategy").set_value("group").run()
    at.number_input(key="w:weight_group_size").set_value(16).run()
    at.toggle(key="w:awq").set_value(True).run()
    at.number_input(key="w:awq:n_grid").set_value(n_grid).run()
    _button(at, "Run").click().run()
    _ok(at)
    return at


def test_tiny_moes_experts_run_under_awq_in_the_app():
    # the fused experts' gate/up of experts 0 and 1 (the float model routes block 0's tokens there):
    # the gate/up mapping of all four experts, under the four variants, on the Error page
    experts = [f"{BLOCK}.mlp.experts.{e}.gate_proj" for e in (0, 1)]
    at = _run_with_awq(_run_page("tiny-moe", experts), 3)
    ws = _ws(at)
    searched = ws.awq.shown_with(ws.analysis)
    mapping = searched.mapping_of(experts[1])
    assert mapping.mapping.name == f"{BLOCK}.post_attention_layernorm → gate_proj, up_proj of 4 experts"
    _page(at, "error")
    at.selectbox(key="w:tensor").set_value((experts[1], "weight")).run()
    _ok(at)
    shown = next(d.value for d in at.dataframe if "variant" in d.value.columns)
    assert set(shown["variant"]) == set(VARIANTS) and set(shown["observer"]) == set(OBSERVERS)
    assert shown["mapping_error"].notna().all()


def test_awq_then_gptq_shows_calibration_and_held_out_figures_on_the_error_page():
    # GPTQ on beside AWQ: the Error page's table gets the mapping error once GPTQ follows each
    # variant, on calibration and on held-out tokens, each with its rank among the observers
    at = _run_page("tiny-llama", LAYERS)
    at.selectbox(key="w:weight_dtype").set_value("int4").run()
    at.selectbox(key="w:weight_strategy").set_value("group").run()
    at.number_input(key="w:weight_group_size").set_value(16).run()
    at.toggle(key="w:gptq").set_value(True).run()
    at.toggle(key="w:awq").set_value(True).run()
    at.number_input(key="w:awq:n_grid").set_value(N_GRID).run()
    _button(at, "Run").click().run()
    _ok(at)
    searched, mapping = _searched(at)
    frame = awq_frame(searched.run)
    expected = frame[frame["mapping"] == mapping.mapping.name].drop(columns=["mapping", "error"])
    _page(at, "error")
    at.selectbox(key="w:tensor").set_value((LAYERS[0], "weight")).run()
    _ok(at)
    shown = next(d.value for d in at.dataframe if "variant" in d.value.columns)
    pd.testing.assert_frame_equal(shown, expected.reset_index(drop=True), check_dtype=False)
    figures = shown[["gptq_error", "gptq_held_out_error"]]
    assert figures.notna().all().all() and (figures["gptq_error"] != figures["gptq_held_out_error"]).all()
    assert set(shown["gptq_held_out_rank"]) <= {1, 2} and (shown["gptq_held_out_rank"] == 1).any()


def test_awq_rides_the_runs_calibration_pass_and_a_run_read_from_the_server_walks_its_own(monkeypatch):
    # imatrix_mse takes its importance from the layers' inputs, so the analysis makes a pass of its
    # own; AWQ rides it (one pass where there were two), and finds what it finds on a pass of its own
    from sample_models.model import Model

    passes = []
    capture = Model.capture

    def counted(self, names, **kwargs):
        passes.append((list(names), kwargs.get("tap")))
        return capture(self, names, **kwargs)

    monkeypatch.setattr(Model, "capture", counted)
    at = app_run_page(APP, LAYERS, ["memoryless_minmax", "imatrix_mse"], "tiny-llama", TIMEOUT)
    at = _run_with_awq(at, 3)
    ws = _ws(at)
    ridden = ws.awq.shown_with(ws.analysis)
    assert [names for names, _ in passes] == [LAYERS] and passes[0][1] is not None  # the analysis's pass
    assert ridden.run.tokens > 0 and ridden.frame["mapping_error"].notna().all()
    analysis, request = ws.analysis, ws.request
    own = ws.awq.run(_model(), request, analysis)  # the same walk on a pass of its own
    pd.testing.assert_frame_equal(ridden.frame, own.frame)
    # the same Run again is read from the server's recent results: no pass of this session carries
    # AWQ, so it walks one of its own (a capture of no layers), and the result is the same
    passes.clear()
    _button(at, "Run").click().run()
    _ok(at)
    assert _ws(at).last_run.shared == "cached"
    assert [names for names, _ in passes] == [[]] and passes[0][1] is not None
    again = _ws(at).awq.shown_with(_ws(at).analysis)
    pd.testing.assert_frame_equal(again.frame, ridden.frame)
