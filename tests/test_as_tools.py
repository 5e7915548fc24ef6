"""``--as`` / "what each tool would produce": the tools' defaults (``lab.analyse.tools``) run beside the
observers, recorded in the JSON and drawn on the Ranges page, never chosen or exported."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import ui
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.export import lab_json
from lab.results import choose
from sample_models import open_model

LAYER = "model.layers.0.mlp.down_proj"
TOOLS = ("llm-compressor", "modelopt", "quark", "torch.ao")
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "lab/export/schema/observer_lab.schema.json").read_text())


@pytest.fixture(scope="module")
def analysis():
    specs = {"weight": ob.QuantSpec(dtype="int8", strategy="channel"), "input": ob.QuantSpec(dtype="int8")}
    config = RunConfig(specs=specs, observers=("minmax", "percentile"), samples=2, seq_len=16, tools=TOOLS)
    return analyse(open_model("tiny-llama"), [LAYER], config)


def test_each_tool_runs_beside_the_observers_and_is_never_chosen(analysis):
    for entry in analysis.entries:
        assert [run.tool for run in entry.tool_results] == list(TOOLS)
        for run in entry.tool_results:
            assert run.result.error is None, (run.tool, run.result.error)
            assert run.result.name == f"{run.tool}: {run.profile.observer}"
            assert run.result.metrics["sqnr_db"] > 10
    assert set(choose(analysis).values()) <= {"minmax", "percentile"}


def test_tools_differ_where_their_conventions_differ(analysis):
    """int8 weights per channel: ModelOpt divides amax by 127 on a narrow grid, the others by 127.5 or by
    the half range, so its scales are not llm-compressor's."""
    runs = {run.tool: run for run in analysis.entry(LAYER, "weight").tool_results}
    assert runs["modelopt"].profile.spec != runs["llm-compressor"].profile.spec
    assert not (runs["modelopt"].result.qparams.scale == runs["llm-compressor"].result.qparams.scale).all()


def test_the_json_records_what_each_tool_would_produce(analysis):
    document = lab_json.build_document(analysis, choose(analysis))
    jsonschema.validate(document, SCHEMA)
    assert document["config"]["tools"] == list(TOOLS)
    for record in document["entries"]:
        assert [t["tool"] for t in record["tools"]] == list(TOOLS)
        assert all(t["qparams"]["scale"]["shape"] == record["qparams"]["scale"]["shape"] for t in record["tools"])
    assert lab_json.load(lab_json.dumps(document)).choices == choose(analysis)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return main(list(argv), out=out, err=err), out.getvalue(), err.getvalue()


def test_the_cli_prints_each_tool_and_refuses_an_unknown_one(tmp_path):
    base = ["run", "tiny-llama", "--layers", LAYER, "--format", "int8", "--observers", "minmax", "--quiet"]
    base += ["--samples", "2", "--seq-len", "16", "--out", str(tmp_path / "q.json")]
    code, out, err = _cli(*base, "--as", "all")
    assert code == 0, err
    assert all(f"as {tool}: " in out for tool in TOOLS)
    code, _, err = _cli(*base, "--as", "modelopt,tensorrt")
    assert code == 2 and err.count("\n") == 1 and "unknown tool(s) tensorrt; allowed: llm-compressor" in err


def test_the_ranges_page_draws_each_tool():
    app = str(Path(__file__).resolve().parents[1] / "app.py")
    at = AppTest.from_file(app, default_timeout=300).run()
    at.switch_page("pages/model.py").run()
    at.multiselect(key="w:layers").set_value(["encoder.layer.0.attention.self.query"])
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    at.switch_page("pages/run.py").run()
    at.multiselect(key="w:observers").set_value(["minmax"])
    at.multiselect(key="w:as_tools").set_value(["modelopt", "torch.ao"]).run()
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert len(at.session_state[ui.WORKSPACE].analysis.entries[0].tool_results) == 2
    at.switch_page("pages/ranges.py").run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert any(h.value == "As each tool would run it" for h in at.subheader)


def test_a_rerun_reuses_the_tools_results_from_the_cache():
    from lab.analyse.result_cache import ResultCache

    model, cache = open_model("tiny-llama"), ResultCache()
    config = RunConfig(specs={"weight": ob.QuantSpec(dtype="int8")}, observers=("minmax",), tools=("modelopt",))
    analyse(model, [LAYER], config, cache=cache)
    assert (cache.misses, cache.hits) == (2, 0)  # the observer and the tool's default
    again = analyse(model, [LAYER], config, cache=cache)
    assert (cache.misses, cache.hits) == (2, 2) and again.entries[0].tool_results[0].result.qparams is not None
