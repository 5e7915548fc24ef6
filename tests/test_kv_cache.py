"""Key/value states of attention blocks (KV cache) through the pipeline, the exports, the CLI
and the app: per-head scales against a naive loop, compressed-tensors' own k_scale/v_scale
layout and fake-quant, JSON round trip, and the app's Model → Run → Ranges → Export flow."""

from __future__ import annotations

import copy
import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from safetensors import safe_open
from streamlit.testing.v1 import AppTest

import observers as ob
from lab import cli, ui
from lab.analyse.model_facts import ModelFacts
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import compressed_tensors, lab_apply, lab_json
from lab.results import choose, plots, ranges
from lab.scheme import stored
from sample_models import open_model

OBSERVERS = ("minmax", "mse_grid", "percentile")
CALIBRATION = {"samples": 4, "seq_len": 32}
APP = str(Path(__file__).resolve().parents[1] / "app.py")


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


@pytest.fixture(scope="module")
def blocks(llama):
    return llama.attention_blocks()[:2]


def _kv_run(model, blocks, spec: ob.QuantSpec, observers=OBSERVERS):
    config = RunConfig(specs={"kv": spec}, observers=observers, **CALIBRATION)
    return analyse(model, [], config, attention=blocks)


@pytest.fixture(scope="module")
def per_head(llama, blocks):
    return _kv_run(llama, blocks, ob.QuantSpec(dtype="fp8_e4m3", strategy="channel"))


def test_entries_hold_the_captured_states_per_kv_head(llama, blocks, per_head):
    captured = llama.capture_kv(blocks, **CALIBRATION)
    assert [(e.layer, e.tensor) for e in per_head.entries] == [(b, t) for b in blocks for t in ("k", "v")]
    heads, head_dim = llama.kv_shape(blocks[0])
    assert (heads, head_dim) == (2, 32)  # grouped-query attention: fewer kv heads than query heads
    for entry in per_head.entries:
        torch.testing.assert_close(entry.data, captured[entry.layer][entry.tensor])
        assert entry.data.shape[:2] == (1, heads) and entry.data.shape[3] == head_dim
        assert entry.num_tokens == entry.data.shape[2] > 0
        assert all(r.num_observed_tokens == entry.num_tokens for r in entry.results)


def test_per_head_minmax_scales_match_a_loop_over_heads(per_head):
    fp8_max = ob.get_format("fp8_e4m3").max_value
    for entry in per_head.entries:
        qp = entry.result("minmax").qparams
        assert qp.kind == "attention" and tuple(qp.scale.shape) == (entry.data.shape[1],)
        for head in range(entry.data.shape[1]):
            expected = entry.data[:, head].abs().max() / fp8_max
            torch.testing.assert_close(qp.scale[head], expected, rtol=1e-6, atol=0)


def test_per_tensor_kv_scale_is_the_global_absmax(llama, blocks):
    analysis = _kv_run(llama, blocks[:1], ob.QuantSpec(dtype="fp8_e4m3"), observers=("minmax",))
    for entry in analysis.entries:
        scale = entry.result("minmax").qparams.scale
        assert tuple(scale.shape) == (1,)
        torch.testing.assert_close(scale[0], entry.data.abs().max() / 448.0, rtol=1e-6, atol=0)


def test_kv_config_errors_are_clear(llama, blocks):
    with pytest.raises(ValueError, match="strategy 'group' is not valid for kind='attention'"):
        RunConfig(specs={"kv": ob.QuantSpec(dtype="int8", strategy="group", group_size=16)})
    weights_only = RunConfig(specs={"weight": ob.QuantSpec(dtype="int8")})
    with pytest.raises(ValueError, match="no KV-cache spec"):
        analyse(llama, ["model.layers.0.self_attn.q_proj"], weights_only, attention=blocks)
    with pytest.raises(ValueError, match="needs at least one attention block"):
        analyse(llama, [], RunConfig(specs={"kv": ob.QuantSpec(dtype="fp8_e4m3")}))
    with pytest.raises(ValueError, match="no attention block named"):
        _kv_run(llama, ["model.layers.0.mlp"], ob.QuantSpec(dtype="fp8_e4m3"))


def test_compressed_tensors_registers_the_same_kv_scales_and_quantizes_alike(llama, blocks, per_head):
    choices = choose(per_head)
    built = compressed_tensors.build(per_head, choices)
    config = QuantizationConfig.model_validate(built.quantization_config)
    args = config.kv_cache_scheme
    assert (args.type, args.num_bits, args.strategy, args.dynamic) == ("float", 8, "attn_head", False)
    module = copy.deepcopy(llama.module())
    apply_quantization_config(module, config)
    theirs = {k: v for k, v in module.state_dict().items() if k.endswith(("k_scale", "v_scale"))}
    ours = built.tensors
    assert set(ours) == {f"{b}.{t}_scale" for b in blocks for t in "kv"}
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (theirs[k].shape, theirs[k].dtype) for k in ours}
    missing, unexpected = module.load_state_dict(ours, strict=False)
    assert unexpected == []
    left = sorted(set(theirs) - set(ours))
    assert left and all(not k.startswith(tuple(blocks)) for k in left)
    assert any("not analysed" in note and llama.attention_blocks()[2] in note for note in built.notes)
    for entry in per_head.entries:
        qp = entry.result(choices[(entry.layer, entry.tensor)]).qparams
        reference = ct_fake_quantize(entry.data, ours[f"{entry.layer}.{entry.tensor}_scale"], None, args)
        torch.testing.assert_close(reference, ob.fake_quantize(entry.data, qp, entry.spec), rtol=0, atol=1e-6)


def test_asymmetric_int8_kv_writes_zero_points_compressed_tensors_accepts(llama, blocks):
    analysis = _kv_run(llama, blocks[:1], ob.QuantSpec(dtype="uint8", symmetric=False), observers=("minmax",))
    built = compressed_tensors.build(analysis, choose(analysis))
    config = QuantizationConfig.model_validate(built.quantization_config)
    assert config.kv_cache_scheme.symmetric is False and config.kv_cache_scheme.strategy == "tensor"
    name = f"{blocks[0]}.k"
    zero_point = built.tensors[f"{name}_zero_point"]
    assert zero_point.dtype == torch.int8 and tuple(zero_point.shape) == (1,)
    qp = analysis.entry(blocks[0], "k").result("minmax").qparams
    assert int(zero_point) == int(qp.zero_point) - 128  # uint8 codes shifted onto CT's signed int8
    data = analysis.entry(blocks[0], "k").data
    reference = ct_fake_quantize(data, built.tensors[f"{name}_scale"], zero_point, config.kv_cache_scheme)
    torch.testing.assert_close(reference, ob.fake_quantize(data, qp, analysis.entries[0].spec), rtol=0, atol=1e-6)


def test_json_round_trip_and_model_checks_for_kv_entries(llama, per_head):
    document = lab_json.build_document(per_head, choose(per_head))
    text = lab_json.dumps(document)
    assert lab_json.schema_problems(document) == []
    assert {e["tensor"] for e in document["entries"]} == {"k", "v"}
    restored = lab_apply.apply_choices(lab_json.load(text), ModelFacts.of(llama, with_kv=True))
    for (layer, tensor), qp in restored["qparams"].items():
        original = per_head.entry(layer, tensor).result(restored["choices"][(layer, tensor)]).qparams
        assert torch.equal(qp.scale, original.scale) and qp.kind == "attention"
    minilm = open_model("minilm")
    with pytest.raises(ValueError, match="has no attention block 'model.layers.0.self_attn'"):
        lab_apply.apply_choices(lab_json.load(text), ModelFacts.of(minilm))
    assert stored.expected_qparam_shape(ob.QuantSpec(dtype="fp8_e4m3", strategy="channel"), "k", (2, 32)) == (2,)
    assert stored.expected_qparam_shape(ob.QuantSpec(dtype="fp8_e4m3"), "v", (2, 32)) == (1,)


def test_per_head_plots_cover_every_head(per_head):
    entry = per_head.entries[0]
    fig = plots.head_range_figure(entry.data)
    heads = entry.data.shape[1]
    bars = fig.data[0]
    assert len(bars.x) == heads and sorted(bars.x) == [f"head {h}" for h in range(heads)]
    for label, low, span in zip(bars.x, bars.base, bars.y, strict=True):
        values = entry.data[:, int(label.split()[1])]
        assert low == pytest.approx(float(values.min())) and low + span == pytest.approx(float(values.max()))
    rows = plots.per_token_view(entry.data)
    assert rows.shape == (entry.num_tokens, heads * entry.data.shape[3])
    torch.testing.assert_close(rows[5, 32:64], entry.data[0, 1, 5])
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        plots.head_range_figure(entry.data[0])


def test_cli_writes_kv_scales(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(
        [
            "run",
            "tiny-llama",
            "--layers",
            "model.layers.0.self_attn.q_proj",
            "--format",
            "int8",
            "--kv-cache",
            "fp8_e4m3",
            "--attention",
            "model.layers.1.*",
            "--observers",
            "minmax",
            "--samples",
            "2",
            "--seq-len",
            "16",
            "--quiet",
            "--out",
            str(tmp_path / "lab.json"),
            "--compressed-tensors",
            str(tmp_path / "ct"),
        ],
        out,
        err,
    )
    assert code == 0, err.getvalue()
    assert "model.layers.1.self_attn\tk\tminmax" in out.getvalue()
    with safe_open(str(tmp_path / "ct" / "qparams.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"} <= names
    config = json.loads((tmp_path / "ct" / "quantization_config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == "tensor"
    err = io.StringIO()
    assert (
        cli.main(
            ["run", "tiny-llama", "--layers", "*q_proj", "--format", "int8", "--kv-per-head", "--out", "x"], out, err
        )
        == 2
    )
    assert "--kv-per-head and --attention need --kv-cache" in err.getvalue()
    err = io.StringIO()
    args = ["run", "tiny-llama", "--layers", "*q_proj", "--format", "int8", "--kv-cache", "fp8_e4m3"]
    assert cli.main([*args, "--attention", "nothing*", "--out", "x"], out, err) == 2
    assert "matches no attention block" in err.getvalue()


def test_app_analyses_and_exports_kv_states():
    at = AppTest.from_file(APP, default_timeout=300).run()
    at.switch_page("pages/model.py").run()
    at.radio(key="w:source_kind").set_value("tiny-llama").run()
    at.checkbox(key="w:want_kv").check().run()
    at.checkbox(key="w:want_input").uncheck().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    blocks = at.multiselect(key="w:attention").value
    assert blocks == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    at.multiselect(key="w:layers").set_value(["model.layers.0.self_attn.q_proj"])
    at.number_input(key="w:samples").set_value(2)
    at.number_input(key="w:seq_len").set_value(16).run()
    at.switch_page("pages/run.py").run()
    at.selectbox(key="w:kv_strategy").set_value("channel")
    at.multiselect(key="w:observers").set_value(["minmax", "mse_grid"]).run()
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    analysis = at.session_state[ui.WORKSPACE].analysis
    keys = [(e.layer, e.tensor) for e in analysis.entries]
    assert keys == [("model.layers.0.self_attn.q_proj", "weight")] + [(b, t) for b in blocks for t in "kv"]
    assert analysis.entry(blocks[0], "k").spec.strategy == "channel"
    at.switch_page("pages/ranges.py").run()
    at.selectbox(key="w:tensor").set_value((blocks[0], "k")).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(h.value == "Per-head ranges" for h in at.subheader)
    for page in ("scales", "error", "overview", "export"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception and not at.error, (page, [e.value for e in at.error])
    built = compressed_tensors.build(analysis, choose(analysis))
    data, notes = built.to_zip(), built.notes
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        config = json.loads(archive.read("quantization_config.json"))["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == "attn_head"
    assert any("model.layers.2.self_attn" in note for note in notes)


def test_granularity_note_speaks_of_heads_for_kv_states():
    spec = ob.QuantSpec(dtype="fp8_e4m3", strategy="channel")
    assert "one range per head" in ranges.granularity_note(spec, "k")
    assert "one range per channel" in ranges.granularity_note(spec, "weight")
    assert ranges.granularity_note(ob.QuantSpec(dtype="fp8_e4m3"), "v") is None


def test_kv_cache_scheme_records_the_most_common_choice_and_notes_the_others(per_head, blocks):
    choices = {key: "mse_grid" for key in choose(per_head)}
    choices[(blocks[0], "k")] = "minmax"
    built = compressed_tensors.build(per_head, choices)
    assert built.quantization_config["kv_cache_scheme"]["observer"] == "memoryless_mse"
    assert any(
        note.startswith(f"{blocks[0]} k: chose 'minmax' but kv_cache_scheme records 'mse_grid'") for note in built.notes
    )
    minmax_scale = per_head.entry(blocks[0], "k").result("minmax").qparams.scale
    torch.testing.assert_close(built.tensors[f"{blocks[0]}.k_scale"].flatten(), minmax_scale)
