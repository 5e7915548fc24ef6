"""The Model effect page driven headless (AppTest), and the data of its figures: a person measures
sensitivity, chooses by a model-level metric, evaluates the choice sets end to end and hands the
choices to Choose & export; bad held-out settings are an error box, never a traceback."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from lab import ui
from lab.results.plots import effect as effect_plots

APP = str(Path(__file__).resolve().parents[1] / "app.py")
LAYERS = ["encoder.layer.4.output.dense", "encoder.layer.5.output.dense"]


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


@pytest.fixture(scope="module")
def effect_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=300).run()
    at.switch_page("pages/model.py").run()
    at.multiselect(key="w:layers").set_value(LAYERS)
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    at.switch_page("pages/run.py").run()
    at.selectbox(key="w:weight_dtype").set_value("int4").run()
    at.selectbox(key="w:weight_strategy").set_value("group").run()
    at.multiselect(key="w:observers").set_value(["minmax", "mse_grid"]).run()
    _button(at, "Run").click().run()
    _ok(at)
    at.switch_page("pages/effect.py").run()
    at.number_input(key="w:effect_samples").set_value(12).run()
    _ok(at)
    return at


def test_sensitivity_choose_by_model_and_evaluate(effect_page):
    at = effect_page
    _button(at, "Measure sensitivity").click().run()
    _ok(at)
    state = at.session_state[ui.WORKSPACE].effect
    assert state.sensitivity is not None and len(state.sensitivity.frame) == 4
    assert at.selectbox(key="w:effect_choose_by").value == "model:cosine"
    _button(at, "Evaluate end to end").click().run()
    _ok(at)
    names = [e.name for e in state.evaluations]
    assert names == ["float", "your choices", "all min-max", "all best-local (sqnr_db)", "best by model (cosine)"]
    assert state.evaluations[0].metrics["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert len(at.get("plotly_chart")) >= 4  # heatmap, local vs model, bars, block SQNR curves
    _button(at, "Use these choices on Choose & export").click().run()
    _ok(at)
    ws = at.session_state[ui.WORKSPACE]
    by_model = state.sensitivity.choices(ws.analysis)
    assert len(by_model) == 2 and {k: ws.choices()[0][k] for k in by_model} == by_model
    at.switch_page("pages/export.py").run()
    _button(at, "Build HTML report").click().run()
    _ok(at)
    html = at.session_state[ui.WORKSPACE].report_html.decode()
    assert "Model-level effect" in html and "best by model (cosine)" in html


def test_held_out_text_too_short_is_an_error_box_not_a_crash(effect_page):
    at = effect_page.switch_page("pages/effect.py").run()
    at.number_input(key="w:effect_samples").set_value(3)
    at.number_input(key="w:effect_seq_len").set_value(512).run()
    assert not at.exception
    assert any("shorter than one window" in e.value for e in at.error)


def test_page_without_results_asks_for_a_run():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.switch_page("pages/effect.py").run()
    assert not at.exception and any("No results yet" in i.value for i in at.info)


# ---------------------------------------------------------------- figure data


def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "layer": ["a", "a", "b", "b"],
            "tensor": ["weight"] * 4,
            "observer": ["minmax", "mse_grid"] * 2,
            "kl": [1e-2, 1e-4, 0.0, 1e-6],
            "local_sqnr_db": [18.0, 19.0, 20.0, 21.0],
        }
    )


def test_sensitivity_heatmap_colors_log_damage_and_writes_the_values():
    fig = effect_plots.sensitivity_heatmap(_frame(), "kl")
    heat = fig.data[0]
    assert list(heat.y) == ["a · weight", "b · weight"] and list(heat.x) == ["minmax", "mse_grid"]
    np.testing.assert_allclose(heat.z, [[-2.0, -4.0], [-12.0, -6.0]])  # zero damage at the floor
    assert heat.text[0][0] == "0.01" and np.asarray(heat.customdata)[1][1] == pytest.approx(1e-6)
    assert heat.colorbar.title.text == "color: log10 kl<br>text: kl"


def test_sensitivity_heatmap_text_tells_apart_cosines_that_round_to_one():
    frame = _frame().rename(columns={"kl": "cosine"}).assign(cosine=[0.9996, 0.9990, 1.0, 0.987654321])
    heat = effect_plots.sensitivity_heatmap(frame, "cosine").data[0]
    assert heat.text[0][0] != heat.text[0][1]
    assert [list(row) for row in heat.text] == [["0.0004", "0.001"], ["0", "0.0123"]]  # 1 − cosine
    assert heat.hovertext[1][1] == "cosine = 0.987654321<br>1 − cosine = 0.0123457"  # the full value
    assert heat.colorbar.title.text == "color: log10(1 − cosine)<br>text: 1 − cosine"


def test_sensitivity_heatmap_writes_kl_and_perplexity_to_three_significant_digits():
    frame = _frame().assign(kl=[0.0123456, 2.34567e-5, 0.0, 1.5])
    heat = effect_plots.sensitivity_heatmap(frame, "kl").data[0]
    assert [list(row) for row in heat.text] == [["0.0123", "2.35e-05"], ["0", "1.5"]]
    assert heat.hovertext[0][0] == "kl = 0.0123456"
    frame = _frame().rename(columns={"kl": "perplexity"}).assign(perplexity=[21.234, 20.0, 20.5, float("nan")])
    heat = effect_plots.sensitivity_heatmap(frame, "perplexity", 20.0).data[0]
    assert [list(row) for row in heat.text] == [["21.2", "20"], ["20.5", ""]]
    assert heat.colorbar.title.text == "color: log10 relative rise of perplexity<br>text: perplexity"


def test_damage_per_metric():
    assert effect_plots.damage("cosine", 0.99) == pytest.approx(0.01)
    assert effect_plots.damage("top1_agreement", 1.0) == 0.0
    assert effect_plots.damage("perplexity", 22.0, 20.0) == pytest.approx(0.1)


def test_block_sqnr_figure_leaves_out_blocks_before_the_first_quantized_one():
    fig = effect_plots.block_sqnr_figure(["float", "one layer"], [[math.inf] * 3, [math.inf, 30.0, 25.0]])
    assert len(fig.data) == 1  # the float set has no finite point to draw
    assert list(fig.data[0].y) == [None, 30.0, 25.0] and fig.data[0].name == "one layer"


def test_choice_set_bars_outline_the_best_quantized_set_on_an_axis_that_shows_the_difference():
    fig = effect_plots.choice_set_bars(["float", "x", "y"], [0.0, 0.3, 0.1], "kl")
    assert list(fig.data[0].marker.line.width) == [0, 0, 3]  # float is the yardstick, not a choice
    fig = effect_plots.choice_set_bars(["float", "x", "y"], [1.0, 0.9957, 0.9969], "cosine")
    assert list(fig.data[0].marker.line.width) == [0, 0, 3]
    low, high = fig.layout.yaxis.range
    assert 0.99 < low < 0.9957 and high > 1.0  # not 0..1, where 0.9957 and 0.9969 look the same


def test_effect_figures_take_the_direction_from_lab_results(monkeypatch):
    from lab import results

    metrics = ("kl", "perplexity", "top1_agreement", "cosine", "spearman")
    assert [effect_plots.is_similarity(m) for m in metrics] == [False, False, True, True, True]
    flipped = results.higher_is_better
    monkeypatch.setattr(results, "higher_is_better", lambda m: not flipped(m))
    fig = effect_plots.choice_set_bars(["float", "x", "y"], [0.0, 0.3, 0.1], "kl")
    assert list(fig.data[0].marker.line.width) == [0, 3, 0]  # the rule, not a table in the plot, says which


def test_effect_figures_refuse_an_unknown_metric():
    frame = _frame().rename(columns={"kl": "nonsense"})
    with pytest.raises(ValueError, match=r"unknown metric 'model:nonsense'.*model:kl"):
        effect_plots.choice_set_bars(["float", "x"], [0.0, 0.3], "nonsense")
    with pytest.raises(ValueError, match="unknown metric"):
        effect_plots.sensitivity_heatmap(frame, "nonsense")


def test_local_vs_model_has_one_trace_per_observer():
    fig = effect_plots.local_vs_model(_frame(), "local_sqnr_db", "kl")
    assert [t.name for t in fig.data] == ["minmax", "mse_grid"]
    assert list(fig.data[0].x) == [18.0, 20.0] and fig.data[0].y[1] == effect_plots.DAMAGE_FLOOR
