"""Figures as served (issue 39): a run's layers that a server fuses share the scales it keeps one of,
every figure that ranks is the served one, each layer's own figure stands beside it, and a choice
whose fused members chose different observers shares the scale of the one reaching farthest."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.analyse.served import as_chosen
from lab.cli import main
from lab.export import checkpoint, lab_json
from lab.results import check_metric, choose, error_table, metric_options, rank
from lab.vocab import PER_LAYER_PREFIX
from sample_models import open_model

QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
GATE_UP = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
NVFP4A16 = {"weight": ob.preset("NVFP4A16")["weight"]}
SMALL = {"samples": 4, "seq_len": 32}


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


@pytest.fixture(scope="module")
def nvfp4(llama):
    config = RunConfig(NVFP4A16, observers=("memoryless_minmax", "mse_grid", "nvfp4_fp8_sweep"), **SMALL)
    return analyse(llama, [QKV[0], GATE_UP[1], "model.layers.0.mlp.down_proj"], config)


def test_a_layer_brings_the_layers_a_server_fuses_it_with_and_says_so(nvfp4):
    assert [e.layer for e in nvfp4.entries] == [*QKV, *GATE_UP, "model.layers.0.mlp.down_proj"]
    added = [w for w in nvfp4.warnings if w.startswith("added ")]
    assert len(added) == 2 and "k_proj, model.layers.0.self_attn.v_proj" in added[0] and "qkv_proj" in added[0]
    assert nvfp4.entry("model.layers.0.mlp.down_proj", "weight").served is None  # served alone


def test_every_observer_shares_one_global_scale_per_group_and_the_farthest_member_sets_it(nvfp4):
    for group in (QKV, GATE_UP):
        entries = [nvfp4.entry(layer, "weight") for layer in group]
        for index, result in enumerate(entries[0].results):
            served = [e.results[index].qparams.global_scale for e in entries]
            own = [e.per_layer[index].qparams.global_scale for e in entries]
            assert all(torch.equal(served[0], g) for g in served)
            assert float(served[0]) == min(float(g) for g in own)
            setter = entries[0].served.set_by[result.name]
            mine = entries[group.index(setter)]
            assert mine.results[index] is mine.per_layer[index]  # the one setting it keeps its own
        assert entries[0].served.members == tuple(group) and entries[0].served.collapse == "global scale"


def test_the_served_figures_are_the_shared_qparams_on_each_weight(nvfp4, llama):
    entry = nvfp4.entry(QKV[1], "weight")
    for served, own in zip(entry.results, entry.per_layer, strict=True):
        weight = llama.weight(QKV[1]).float()
        assert served.metrics == pytest.approx(ob.quantization_metrics(weight, served.qparams, entry.spec))
        assert own.metrics == pytest.approx(ob.quantization_metrics(weight, own.qparams, entry.spec))
    sweep = entry.result("nvfp4_fp8_sweep")  # searched again under the group's global scale
    assert float(sweep.qparams.global_scale) == min(
        float(r.qparams.global_scale) for r in _per_layer(nvfp4, "nvfp4_fp8_sweep")
    )


def _per_layer(analysis, observer):
    return [analysis.entry(layer, "weight").per_layer[_index(analysis, observer)] for layer in QKV]


def _index(analysis, observer):
    return [r.name for r in analysis.entry(QKV[0], "weight").results].index(observer)


def test_memoryless_minmax_is_llm_compressors_linked_observers_on_every_layer(llama):
    """All 28 decoder layers of tiny-llama under NVFP4A16 with memoryless_minmax: global and block
    scales equal llm-compressor 0.14's linked observers, rebuilt with the compressed-tensors functions
    llm-compressor calls (``generate_gparam`` over the fused group's absmax, ``calculate_qparams``)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    layers = [info.name for info in llama.layers() if info.name.startswith("model.layers.")]
    analysis = analyse(llama, layers, RunConfig(NVFP4A16, observers=("memoryless_minmax",), **SMALL))
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    stats = {}
    for layer in layers:
        grouped = llama.weight(layer).float().unflatten(-1, (-1, 16))
        stats[layer] = (grouped.amin(dim=-1), grouped.amax(dim=-1))
    assert len(layers) == 28
    for layer in layers:
        parent, _, name = layer.rpartition(".")
        siblings = [f"{parent}.{p}_proj" for p in ("qkv" if name in ("q_proj", "k_proj", "v_proj") else ())]
        siblings = siblings or (
            [f"{parent}.gate_proj", f"{parent}.up_proj"] if name in ("gate_proj", "up_proj") else [layer]
        )
        absmax = torch.stack([torch.max(-stats[s][0].min(), stats[s][1].max()) for s in siblings]).max()
        global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        scale, _ = calculate_qparams(*stats[layer], args, global_scale=global_scale)
        qp = analysis.entry(layer, "weight").result("memoryless_minmax").qparams
        assert torch.equal(qp.global_scale, global_scale.float()), layer
        assert torch.equal(qp.scale, scale.float()), layer


def test_per_layer_figures_rank_on_request_and_never_change_what_is_served(nvfp4):
    assert PER_LAYER_PREFIX + "sqnr_db" in metric_options(nvfp4)
    assert check_metric("per-layer:mse") == "per-layer:mse"
    with pytest.raises(ValueError, match="per-layer:sqnr_db"):
        check_metric("per-layer:nope")
    entry = nvfp4.entry(QKV[2], "weight")
    by_own = [r.name for r in sorted(entry.per_layer, key=lambda r: -r.metrics["sqnr_db"])]
    assert [r.name for r in rank(entry, "per-layer:sqnr_db")] == by_own
    chosen = choose(nvfp4, "per-layer:sqnr_db")
    served = as_chosen(nvfp4, chosen)[(QKV[2], "weight")]
    assert served.result is entry.result(chosen[(QKV[2], "weight")])  # the qparams are still the served ones
    table = error_table(nvfp4)
    row = table[(table["layer"] == QKV[1]) & (table["observer"] == "mse_grid")].iloc[0]
    assert row["per-layer:sqnr_db"] == entry_metric(nvfp4, QKV[1], "mse_grid", own=True)
    assert row["scale set by"] in QKV and row["fused as"] == "model.layers.0.self_attn qkv_proj (one global scale)"


def entry_metric(analysis, layer, observer, own=False):
    entry = analysis.entry(layer, "weight")
    results = entry.per_layer if own else entry.results
    return next(r for r in results if r.name == observer).metrics["sqnr_db"]


def test_members_choosing_different_observers_share_the_scale_of_the_one_reaching_farthest(nvfp4, llama):
    choices = {(QKV[0], "weight"): "memoryless_minmax", (QKV[1], "weight"): "nvfp4_fp8_sweep"}
    choices[(QKV[2], "weight")] = "mse_grid"
    served = as_chosen(nvfp4, choices)
    own = [served[key].own.qparams.global_scale for key in choices]
    shared = [served[key].result.qparams.global_scale for key in choices]
    assert all(torch.equal(shared[0], g) for g in shared) and float(shared[0]) == min(map(float, own))
    setter = served[(QKV[0], "weight")].set_by
    assert setter == QKV[[float(g) for g in own].index(min(map(float, own)))]
    sweep = served[(QKV[1], "weight")].result  # the sweep searched again under that scale
    spec = nvfp4.entry(QKV[1], "weight").spec
    again = ob.run_one("nvfp4_fp8_sweep", llama.weight(QKV[1]), spec, group_global_scale=shared[0])
    assert torch.equal(sweep.qparams.scale, again.qparams.scale)
    document = lab_json.build_document(nvfp4, choices)
    records = {e["layer"]: e for e in document["entries"]}
    assert records[QKV[2]]["fused"]["set_by"] == setter and records[QKV[2]]["fused"]["shares"] == "global scale"
    assert records[QKV[2]]["chosen"]["metrics"]["sqnr_db"] == pytest.approx(
        served[(QKV[2], "weight")].result.metrics["sqnr_db"]
    )


def test_fp8_per_tensor_weights_and_static_inputs_share_the_largest_scale(llama):
    specs = {k: v for k, v in ob.preset("FP8").items() if v is not None}
    analysis = analyse(llama, QKV, RunConfig(specs, observers=("minmax",), **SMALL))
    weights = [analysis.entry(layer, "weight") for layer in QKV]
    scales = [e.result("minmax").qparams.scale for e in weights]
    assert all(torch.equal(scales[0], s) for s in scales)
    assert float(scales[0]) == max(float(e.per_layer[0].qparams.scale) for e in weights)
    inputs = [analysis.entry(layer, "input").result("minmax").qparams.scale for layer in QKV]
    assert all(torch.equal(inputs[0], s) for s in inputs)


def test_moe_static_input_scales_are_shared_across_the_experts_of_a_layer():
    moe = open_model("tiny-moe")
    specs = {k: v for k, v in ob.preset("FP8").items() if v is not None}
    experts = [f"model.layers.0.mlp.experts.{i}.{p}_proj" for i in range(4) for p in ("gate", "up")]
    analysis = analyse(moe, experts[:2], RunConfig(specs, observers=("minmax",), **SMALL))
    assert [e.layer for e in analysis.entries if e.tensor == "weight"] == experts  # the whole kernel
    calibrated = [analysis.entry(layer, "input") for layer in experts if analysis.entry(layer, "input").num_tokens]
    scales = [e.result("minmax").qparams.scale for e in calibrated]
    assert len(scales) >= 4 and all(torch.equal(scales[0], s) for s in scales)
    weight = analysis.entry(experts[0], "weight")  # weights are shared per expert (w1/w3) only
    assert weight.served.members == tuple(experts[:2])


def _lab_file(analysis, choices):
    return lab_json.parse_document(lab_json.build_document(analysis, choices))


def test_a_checkpoint_with_per_layer_global_scales_is_refused_naming_the_group(nvfp4, llama, tmp_path):
    lab_file = _lab_file(nvfp4, {(layer, "weight"): "memoryless_minmax" for layer in QKV})
    own = {layer: nvfp4.entry(layer, "weight").per_layer[_index(nvfp4, "memoryless_minmax")].qparams for layer in QKV}
    forced = replace(lab_file, entries=[replace(e, qparams=own[e.layer]) for e in lab_file.entries])
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.write(forced, llama, tmp_path / "out")
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith("  - model.layers.0.self_attn qkv_proj: weight global scales differ")
    assert not (tmp_path / "out").exists()
    partial = _lab_file(nvfp4, {(QKV[0], "weight"): "memoryless_minmax"})
    with pytest.raises(checkpoint.CheckpointError, match="q_proj quantized but k_proj, v_proj not"):
        checkpoint.write(partial, llama, tmp_path / "out")


def test_the_cli_shows_each_layers_own_figure_and_who_sets_the_scale(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", "tiny-llama", "--layers", QKV[1], "--preset", "NVFP4A16", "--kinds", "weight"]
    argv += ["--observers", "memoryless_minmax", "--samples", "4", "--seq-len", "32", "--out", str(tmp_path / "a.json")]
    assert main(argv, out=out, err=err) == 0, err.getvalue()
    assert "warning: added model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj" in err.getvalue()
    lines = {line.split("\t")[0]: line.split("\t") for line in out.getvalue().splitlines() if "\t" in line}
    fused = json.loads((tmp_path / "a.json").read_text())["entries"][1]["fused"]
    assert lines[QKV[1]][4] == (
        f"served as model.layers.0.self_attn qkv_proj, one global scale set by {fused['set_by'].rpartition('.')[2]}; "
        f"per layer sqnr_db={fused['per_layer_metrics']['sqnr_db']:.6g}"
    )


def test_the_model_level_effect_runs_the_served_qparams(nvfp4):
    """Evaluations, sensitivity and the allocation's scores build their choice sets here: a fused
    member quantized alone runs with its group's shared global scale, a mixed choice with the one
    its group shares under every member's own choice."""
    from lab.effect.evaluate import from_analysis

    alone = from_analysis(nvfp4, {(QKV[1], "weight"): "mse_grid"}, "one").tensors[(QKV[1], "weight")]
    assert alone.qparams is nvfp4.entry(QKV[1], "weight").result("mse_grid").qparams
    choices = {(QKV[0], "weight"): "memoryless_minmax", (QKV[1], "weight"): "mse_grid"}
    mixed = from_analysis(nvfp4, choices, "mixed").tensors
    served = as_chosen(nvfp4, choices)
    for key in choices:
        assert torch.equal(mixed[key].qparams.scale, served[key].result.qparams.scale)
    q, k = (mixed[(layer, "weight")].qparams.global_scale for layer in QKV[:2])
    assert torch.equal(q, k)
