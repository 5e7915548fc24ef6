"""The Ranges page with a dynamic activation spec, driven headless with AppTest: the run-time scale
section appears for dynamic inputs only, draws its figure and table, and shows no error."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import ui
from lab.results import dynamic

APP = str(Path(__file__).resolve().parents[1] / "app.py")
LAYER = "encoder.layer.0.attention.self.query"
OBSERVERS = ["minmax", "memoryless_minmax", "mse_grid"]
SECTION = "Dynamic scales over the calibration tokens"
TIMEOUT = 300


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"pages/{name}.py").run()


def _run(at: AppTest) -> None:
    _page(at, "run")
    _ok(at)
    run = [b for b in at.button if b.label == "Run"]
    assert run, [b.label for b in at.button]
    run[0].click()
    at.run()
    _ok(at)


def _ranges(at: AppTest, tensor: str) -> AppTest:
    _page(at, "ranges")
    at.selectbox(key="w:tensor").set_value((LAYER, tensor)).run()
    _ok(at)
    return at


def _has_section(at: AppTest) -> bool:
    return any(s.value == SECTION for s in at.subheader)


@pytest.fixture(scope="module")
def dynamic_run() -> AppTest:
    """MiniLM, one layer, weights and inputs; activations int8 per token with Dynamic ticked."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    _ok(at)
    at.multiselect(key="w:layers").set_value([LAYER])
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32)
    at.run()
    _ok(at)
    _page(at, "run")
    at.multiselect(key="w:observers").set_value(OBSERVERS)
    at.selectbox(key="w:act_strategy").set_value("token")
    at.checkbox(key="w:act_dynamic").check()
    at.run()
    _ok(at)
    _run(at)
    return at


def test_run_stores_a_dynamic_input_spec(dynamic_run):
    entry = dynamic_run.session_state[ui.WORKSPACE].analysis.entry(LAYER, "input")
    assert entry.spec == ob.QuantSpec(dtype="int8", strategy="token", dynamic=True)
    assert dynamic.dynamic_applies(entry)


def test_ranges_page_shows_run_time_scales_for_dynamic_inputs(dynamic_run):
    at = _ranges(dynamic_run, "input")
    assert _has_section(at)
    assert len(at.get("plotly_chart")) == 4  # histogram, per-token vs per-channel, per-channel, dynamic scales
    entry = at.session_state[ui.WORKSPACE].analysis.entry(LAYER, "input")
    table = at.dataframe[-1].value
    assert list(table["scales from"]) == [dynamic.DYNAMIC_LABEL, *OBSERVERS]
    assert table["scales"].iloc[0] == entry.data.shape[0], "one run-time scale per calibration token"
    assert any("only summarize calibration" in c.value for c in at.caption)


def test_weights_show_no_dynamic_section(dynamic_run):
    at = _ranges(dynamic_run, "weight")
    assert not _has_section(at)


def test_block_format_and_unticking_dynamic(dynamic_run):
    at = dynamic_run
    _page(at, "run")
    at.selectbox(key="w:act_dtype").set_value("mxfp4").run()
    _run(at)
    _ranges(at, "input")
    assert _has_section(at)
    entry = at.session_state[ui.WORKSPACE].analysis.entry(LAYER, "input")
    hidden = entry.data.shape[1]
    assert at.dataframe[-1].value["scales"].iloc[0] == entry.data.shape[0] * -(-hidden // 32)
    _page(at, "run")
    at.checkbox(key="w:act_dynamic").uncheck().run()
    _run(at)
    _ranges(at, "input")
    assert not _has_section(at)
    assert len(at.get("plotly_chart")) == 3
