"""The Allocate page driven headless (AppTest) on the MiniLM sample: two layers of the last block
under W4A16, FP8 and none, scored on one part of the held-out text and measured on the other (and in
sample); the frontier and the allocation drawn, the
layer table, the downloads as a browser gets them, a checkpoint saved only inside the output root,
and bad input as one error line, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import app_button, app_ok, app_page, app_workspace
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "app.py")
LAYERS = ["encoder.layer.5.attention.output.dense", "encoder.layer.5.output.dense"]
SCHEMES = ["W4A16", "FP8", "none"]


@pytest.fixture(scope="module")
def allocated() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=300).run()
    app_page(at, "model")
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    app_page(at, "allocate")
    at.multiselect(key="w:alloc_layers").set_value(LAYERS)
    at.multiselect(key="w:alloc_schemes").set_value(SCHEMES)
    at.multiselect(key="w:alloc_observers").set_value(["minmax", "mse_grid"])
    at.number_input(key="w:alloc_samples").set_value(8)
    at.number_input(key="w:alloc_seq_len").set_value(64)  # a part's 8 sentences are under 128 tokens
    at.text_input(key="w:alloc_budget").set_value("6")
    at.text_input(key="w:alloc_budgets").set_value("4.5, 8, 16").run()
    app_ok(at)
    app_button(at, "Score and allocate").click().run()
    app_ok(at)
    return at


def _state(at: AppTest):
    return app_workspace(at).allocation


def _downloads(at: AppTest, monkeypatch) -> dict[str, bytes]:
    """Run the page again and keep what each download button hands the browser, by file name."""
    files: dict[str, bytes] = {}
    keep = MemoryMediaFileStorage.load_and_get_id

    def kept(self, data, mimetype, kind, filename=None):
        files[filename] = data
        return keep(self, data, mimetype, kind, filename)

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", kept)
    at.run()
    return files


def test_score_and_allocate_draws_the_frontier_the_allocation_and_the_layer_table(allocated):
    at, state = allocated, _state(allocated)
    result = state.result
    assert [p.budget for p in result.frontier.allocations] == ["4.5", "6", "8", "16"]
    assert {p.name for p in result.frontier.uniforms} == {"all W4A16", "all FP8", "all none"}
    figures = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    assert len(figures) == 2
    frontier, allocation = figures
    assert {"allocation, measured", "allocation, in sample"} <= {trace["name"] for trace in frontier["data"]}
    heat = allocation["data"][0]
    assert heat["type"] == "heatmap" and heat["y"] == LAYERS and set(heat["x"]) == set(SCHEMES)
    assert allocation["layout"]["title"]["text"].startswith("budget 6:")  # the exports' budget is viewed
    points, layers = at.dataframe[0].value, at.dataframe[1].value
    assert len(points) == len(result.frontier.points) and "measured / predicted" in points.columns
    assert points["in-sample 1 − cosine"].notna().all() and points["measured 1 − cosine"].notna().all()
    held_out = state.held_out
    assert held_out.scoring.held_out["digest"] != held_out.measuring.held_out["digest"]  # two texts
    assert result.settings["held_out"] == held_out.describe()
    assert list(layers["layer"]) == LAYERS and set(layers["scheme"]) <= set(SCHEMES)
    assert any(
        m.value.startswith("**Measured (measuring part) against predicted (scoring part)**: Spearman")
        for m in at.markdown
    )
    assert any("No fusion assumed" in c.value for c in at.caption)  # an output projection and an FFN: never fused


def test_the_downloads_hold_the_viewed_allocation_and_a_rerun_does_not_recompute(allocated, monkeypatch):
    at, state = allocated, _state(allocated)
    result = state.result
    files = _downloads(at, monkeypatch)
    app_ok(at)
    assert state.result is result  # kept in the session, not scored again
    point = result.point(state.viewed)
    quantized = {c.layer: c.scheme for c in point.choices if c.scheme != "none"}
    assert quantized, "the budget of 6 bits per weight quantizes at least one layer"
    document = json.loads(files["allocation.json"])
    assert {e["layer"] for e in document["entries"] if e["tensor"] == "weight"} == set(quantized)
    assert document["config"]["allocation"]["budget"] == "6"
    assert {layer: v["scheme"] for layer, v in document["config"]["allocation"]["layers"].items()} == point.schemes()
    recipe = files["recipe.yaml"].decode()
    assert all(layer in recipe for layer in quantized)

    at.selectbox(key="w:alloc_view").set_value("budget 16").run()
    app_ok(at)
    chart = json.loads(at.get("plotly_chart")[1].proto.spec)
    assert chart["layout"]["title"]["text"].startswith("budget 16:")
    shown = result.point("budget 16")
    assert list(at.dataframe[1].value["scheme"]) == [c.scheme for c in shown.choices]


def test_save_checkpoint_writes_inside_the_output_root_only(allocated, served_roots):
    at = allocated
    shutil.rmtree(served_roots / "alloc-ckpt", ignore_errors=True)
    at.selectbox(key="w:alloc_view").set_value("budget 6").run()
    at.text_input(key="alloc_checkpoint_dir").input("alloc-ckpt").run()
    app_button(at, "Save checkpoint").click().run()
    app_ok(at)
    assert any("Saved" in s.value and "alloc-ckpt" in s.value for s in at.success)
    config = json.loads((served_roots / "alloc-ckpt" / "config.json").read_text())["quantization_config"]
    point = _state(at).result.point("budget 6")
    targets = sorted(t for group in config["config_groups"].values() for t in group["targets"])
    assert targets == sorted(c.layer for c in point.choices if c.scheme != "none")
    at.text_input(key="alloc_checkpoint_dir").input("../escape").run()
    app_button(at, "Save checkpoint").click().run()
    assert not at.exception and any("outside the output roots" in e.value for e in at.error)
    assert not (served_roots.parent / "escape").exists()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("w:alloc_budget", "1", "budget 1 is below the cheapest allocation of these schemes"),
        ("w:alloc_budgets", "4.5, 80MB", "mix bits per weight and sizes"),
        ("w:alloc_specs", "int4:group:64, bogus4", "unknown scheme 'bogus4'"),
    ],
)
def test_bad_input_is_one_error_line_and_the_button_is_off(allocated, field, value, says):
    at = allocated
    before = at.text_input(key=field).value
    at.text_input(key=field).set_value(value).run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith("Cannot allocate: ") and says in errors[0], errors
    assert app_button(at, "Score and allocate").disabled
    at.text_input(key=field).set_value(before).run()
    app_ok(at)


def test_page_without_a_model_asks_for_one():
    at = AppTest.from_file(APP, default_timeout=120).run()
    app_page(at, "allocate")
    assert not at.exception and any("open a model" in i.value for i in at.info)
