"""GPTQ in the app (issue 33), driven headless with AppTest: the Run page's switch and knobs (their
defaults llm-compressor's, kept across pages, a combination GPTQ does not serve refused in one line
with Run off), and the Error page's "Under GPTQ" section for the picked layer, whose table is the
analysis's ``gptq_frame``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from helpers import app_button, app_ok, app_page, app_run_page, app_workspace
from streamlit.testing.v1 import AppTest

import observers as ob
from lab.gptq.table import gptq_frame
from observers.gptq import ACTORDER_ALIASES

_ws, _ok, _page, _button = app_workspace, app_ok, app_page, app_button
APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 300
LAYERS = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]  # one fused unit
OBSERVERS = ["memoryless_minmax", "mse_grid"]


def _run_page(layers=LAYERS) -> AppTest:
    """MiniLM with ``layers``, 4 samples of 32 tokens, on the Run page with two observers."""
    return app_run_page(APP, layers, OBSERVERS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ran() -> AppTest:
    """GPTQ switched on with its defaults, run on two layers with two observers."""
    at = _run_page()
    assert at.toggle(key="w:gptq").value is False
    assert _ws(at).settings.gptq is None
    at.toggle(key="w:gptq").set_value(True).run()
    _ok(at)
    _button(at, "Run").click().run()
    _ok(at)
    return at


def test_the_switch_shows_llm_compressors_defaults(ran):
    _page(ran, "run")
    _ok(ran)
    defaults = ob.GPTQSpec()
    assert ran.number_input(key="w:gptq_block_size").value == defaults.block_size
    assert ran.number_input(key="w:gptq_dampening").value == pytest.approx(defaults.dampening)
    assert ran.radio(key="w:gptq_actorder").value == ACTORDER_ALIASES[defaults.actorder]
    assert ran.radio(key="w:gptq_scales").value == defaults.scales
    assert any("llm-compressor" in c.value for c in ran.caption)
    assert _ws(ran).settings.gptq == defaults
    assert _ws(ran).analysis.config.gptq == defaults


def test_error_page_shows_each_layers_observers_under_gptq(ran):
    _page(ran, "error")
    _ok(ran)
    analysis = _ws(ran).analysis
    frame = gptq_frame(analysis)
    assert set(frame["layer"]) == set(LAYERS) and set(frame["observer"]) == set(OBSERVERS)
    assert frame["error"].isna().all()
    assert any(h.value == "Under GPTQ" for h in ran.subheader)
    for layer in LAYERS:
        ran.selectbox(key="w:tensor").set_value((layer, "weight")).run()
        _ok(ran)
        expected = frame[frame["layer"] == layer].drop(columns=["layer", "error"]).reset_index(drop=True)
        shown = ran.dataframe[-1].value.reset_index(drop=True)  # the last table on the page is GPTQ's
        assert not any(e.label.startswith("Why") for e in ran.expander)  # every observer has figures
        assert list(shown.columns) == list(expected.columns)
        pd.testing.assert_frame_equal(shown, expected, check_dtype=False)
        figure = ran.get("plotly_chart")[-1].proto.spec
        assert '"GPTQ"' in figure and '"round-to-nearest"' in figure
        assert any(layer in c.value and "GPTQ" in c.value for c in ran.caption)


def test_an_input_tensor_points_to_the_weights(ran):
    _page(ran, "error")
    ran.selectbox(key="w:tensor").set_value((LAYERS[0], "input")).run()
    _ok(ran)
    assert any(h.value == "Under GPTQ" for h in ran.subheader)
    assert any("pick a layer's weight" in c.value for c in ran.caption)


def test_refit_with_nvfp4_is_one_error_and_run_is_off():
    at = _run_page(LAYERS[:1])
    at.toggle(key="w:gptq").set_value(True).run()
    at.selectbox(key="w:weight_dtype").set_value("nvfp4").run()
    _ok(at)  # fixed scales serve NVFP4
    assert not _button(at, "Run").disabled
    at.radio(key="w:gptq_scales").set_value("refit").run()
    assert not at.exception
    assert len(at.error) == 1 and at.error[0].value.startswith("GPTQ serves") and "nvfp4" in at.error[0].value
    assert _button(at, "Run").disabled
    assert any("Run is off" in c.value for c in at.caption)
    at.toggle(key="w:gptq").set_value(False).run()
    _ok(at)
    assert not _button(at, "Run").disabled


def test_the_knobs_survive_a_page_switch_and_the_switch_going_off():
    at = _run_page(LAYERS[:1])
    at.toggle(key="w:gptq").set_value(True).run()
    at.number_input(key="w:gptq_block_size").set_value(64)
    at.number_input(key="w:gptq_dampening").set_value(0.05)
    at.radio(key="w:gptq_actorder").set_value("group")
    at.radio(key="w:gptq_scales").set_value("refit").run()
    _ok(at)
    chosen = ob.GPTQSpec(block_size=64, dampening=0.05, actorder="group", scales="refit")
    assert _ws(at).settings.gptq == chosen
    _page(at, "model")
    _page(at, "run")
    _ok(at)
    assert at.toggle(key="w:gptq").value is True
    assert at.number_input(key="w:gptq_block_size").value == 64
    assert at.number_input(key="w:gptq_dampening").value == pytest.approx(0.05)
    assert at.radio(key="w:gptq_actorder").value == "group"
    assert at.radio(key="w:gptq_scales").value == "refit"
    assert _ws(at).settings.gptq == chosen
    at.toggle(key="w:gptq").set_value(False).run()
    assert _ws(at).settings.gptq is None
    at.toggle(key="w:gptq").set_value(True).run()
    _ok(at)
    assert _ws(at).settings.gptq == chosen


def test_static_is_kept_as_llm_compressor_spells_it():
    """The default's ``static`` shows as ``weight`` and stays ``static`` until another order is picked."""
    at = _run_page(LAYERS[:1])
    at.toggle(key="w:gptq").set_value(True).run()
    assert _ws(at).settings.gptq.actorder == ob.GPTQSpec().actorder
    at.radio(key="w:gptq_actorder").set_value("none").run()
    assert _ws(at).settings.gptq.actorder == "none"
    at.radio(key="w:gptq_actorder").set_value(ACTORDER_ALIASES[ob.GPTQSpec().actorder]).run()
    _ok(at)
    assert ACTORDER_ALIASES[_ws(at).settings.gptq.actorder] == ACTORDER_ALIASES[ob.GPTQSpec().actorder]


def test_w4a16_groups_and_an_observer_without_qparams_are_set_apart():
    """int4 groups of 128 (W4A16, weights only: GPTQ still reads the calibration inputs); an observer
    that does not take groups has no GPTQ figures and says why below the table, not in it."""
    at = _run_page(LAYERS[:1])
    at.selectbox(key="w:preset").set_value("W4A16").run()
    at.multiselect(key="w:observers").set_value([*OBSERVERS, "histogram"])
    at.toggle(key="w:gptq").set_value(True).run()
    _ok(at)
    _button(at, "Run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    _page(at, "error")
    _ok(at)
    frame = gptq_frame(_ws(at).analysis)
    assert _ws(at).analysis.keys() == [(LAYERS[0], "weight")]
    assert list(frame.loc[frame["error"].isna(), "observer"]) == OBSERVERS
    shown = at.dataframe[-2].value  # the table, then the expander's
    assert list(shown["observer"]) == OBSERVERS
    assert "error" not in shown.columns
    assert list(at.dataframe[-1].value["observer"]) == ["histogram"]
    assert any(e.label == "Why 1 observer(s) have no GPTQ figures here" for e in at.expander)


def test_ranges_draws_the_weights_gptq_updated_against_the_observers_range(ran):
    from lab.gptq.layer import entry_gptq

    _page(ran, "ranges")
    _ok(ran)
    ran.selectbox(key="w:tensor").set_value((LAYERS[1], "weight")).run()
    _ok(ran)
    assert any(h.value == "Under GPTQ" for h in ran.subheader)
    ran.selectbox(key="w:ranges_gptq_observer").set_value("mse_grid").run()
    _ok(ran)
    analysis = _ws(ran).analysis
    done = entry_gptq(analysis.entry(LAYERS[1], "weight"), "mse_grid", analysis.config.gptq)
    shown = [c.value for c in ran.caption if "just before rounding" in c.value]
    assert len(shown) == 1 and f"{done.clip_ratio:.2%} of them lie outside" in shown[0]
    figure = ran.get("plotly_chart")[1].proto.spec  # the second histogram: the updated weights
    assert "as GPTQ's sweep updated it" in figure


def test_the_overview_and_the_choice_can_go_by_a_gptq_figure(ran):
    from lab import results

    _page(ran, "overview")
    _ok(ran)
    options = ran.selectbox(key="w:metric").options
    assert "GPTQ held-out error" in options and "GPTQ layer-output error" in options
    ran.selectbox(key="w:metric").set_value("gptq:gptq_held_out").run()
    _ok(ran)
    assert "GPTQ held-out error" in ran.get("plotly_chart")[0].proto.spec
    analysis = _ws(ran).analysis
    table = results.error_table(analysis)
    frame = gptq_frame(analysis)
    for row in frame.itertuples():
        same = (table["layer"] == row.layer) & (table["observer"] == row.observer)
        weight = table[same & (table["tensor"] == "weight")]
        assert weight["gptq:gptq_held_out"].item() == pytest.approx(row.gptq_held_out)
        assert table[same & (table["tensor"] != "weight")]["gptq:gptq_held_out"].isna().all()
    chosen = results.choose(analysis, "gptq:gptq_held_out")
    for layer in LAYERS:
        rows = frame[frame["layer"] == layer]
        assert chosen[(layer, "weight")] == rows.loc[rows["gptq_held_out"].idxmin(), "observer"]
