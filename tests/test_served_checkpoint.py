"""Every checkpoint the lab writes loads correct where it is served (issue 39): read as vLLM's
compressed-tensors loader reads it (``tests/vllm_loader.py``: fused shards' NVFP4 global scales
collapsed with ``max()``, FP8 per-tensor weights requantized with the largest shard scale, static
input scales at the largest), every layer is the weight the lab chose, and no layer is rescaled.

For every preset on tiny-llama and tiny-moe (its attention; its packed experts are
``tests/test_checkpoint_experts.py``'s), a dense checkpoint whose fused members chose different
observers where they could; with GPTQ for the presets it serves; and mixed-precision checkpoints
from an allocation. A checkpoint with per-layer global scales, written past the lab's refusal,
shows what the loader does to it, so these tests can fail."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import vllm_loader

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.export import checkpoint, lab_json
from lab.gptq.deploy import GPTQDeploy
from lab.gptq.hessians import of_analysis
from lab.results import choose
from lab.runtime.fusion import Level, fused_groups
from sample_models import open_model

MODELS = ("tiny-llama", "tiny-moe")
SMALL = {"samples": 4, "seq_len": 32}
GPTQ_PRESETS = ("NVFP4A16", "NVFP4", "FP8", "W4A16", "W8A8")


@pytest.fixture(scope="module")
def models():
    return {name: open_model(name) for name in MODELS}


def _linear(model) -> list[str]:
    return [i.name for i in model.layers() if i.type == "Linear" and i.name.startswith("model.layers.")]


def _observers(spec: ob.QuantSpec) -> tuple[str, ...]:
    """Two observers a fused group's members can split between: min-max and a search (for NVFP4 the
    FP8 scale sweep, which searches again under the group's global scale)."""
    second = "nvfp4_fp8_sweep" if spec.dtype == "nvfp4" else "mse_grid"
    return ("memoryless_minmax", second) if second in ob.applicable(spec) else ("memoryless_minmax",)


def _mixed(analysis) -> dict[tuple[str, str], str]:
    """The best observer per tensor, then every fused group's members alternating between the run's
    observers (so a group shares the scale of the member whose own choice reaches farthest)."""
    choices = choose(analysis)
    names = analysis.config.observer_names
    weights = [e.layer for e in analysis.entries if e.tensor == "weight"]
    for _, members in fused_groups(weights, Level.LINEAR):
        for i, layer in enumerate(members):
            choices[(layer, "weight")] = names[i % len(names)]
    return choices


def _served_as_chosen(directory, lab_file, model, weights=None) -> None:
    """The loader's weights are the lab's chosen ones (``weights``: the GPTQ weights, else the
    fake-quantized ones) and its input scales the lab's; no layer is read differently served than
    alone."""
    served, alone = vllm_loader.served(directory), vllm_loader.own(directory)
    entries = {(e.layer, e.tensor): e for e in lab_file.entries}
    assert served, "nothing was packed"
    for layer, found in served.items():
        entry = entries[(layer, "weight")]
        weight = model.weight(layer).float()
        expected = weights[layer] if weights else ob.fake_quantize(weight, entry.qparams, entry.spec)
        assert torch.equal(found.weight, expected.float()), layer
        assert torch.equal(found.weight, alone[layer].weight), f"{layer} is rescaled where it is served"
        if found.input_scale is not None:
            mine = entries[(layer, "input")].qparams
            value = mine.global_scale if mine.global_scale is not None else mine.scale
            assert float(found.input_scale) == float(value) == float(alone[layer].input_scale), layer


@pytest.mark.slow
@pytest.mark.parametrize("preset", ob.PRESET_NAMES)
@pytest.mark.parametrize("name", MODELS)
def test_every_preset_loads_as_the_lab_chose_it(models, name, preset, tmp_path):
    model = models[name]
    specs = {kind: spec for kind, spec in ob.preset(preset).items() if spec is not None}
    config = RunConfig(specs, observers=_observers(specs["weight"]), **SMALL)
    analysis = analyse(model, _linear(model), config)
    lab_file = lab_json.as_lab_file(analysis, _mixed(analysis))
    written = checkpoint.write(lab_file, model, tmp_path / "out")
    assert written.packed_layers or all("stays dense" in note for note in written.notes)
    if written.packed_layers:
        _served_as_chosen(tmp_path / "out", lab_file, model)


@pytest.mark.slow
@pytest.mark.parametrize("preset", GPTQ_PRESETS)
@pytest.mark.parametrize("name", MODELS)
def test_gptq_checkpoints_load_as_the_lab_chose_them(models, name, preset, tmp_path):
    model = models[name]
    specs = {kind: spec for kind, spec in ob.preset(preset).items() if spec is not None}
    layers = [layer for layer in _linear(model) if ".layers.0." in layer]
    config = RunConfig(specs, observers=_observers(specs["weight"]), gptq=ob.GPTQSpec(), **SMALL)
    analysis = analyse(model, layers, config)
    lab_file = lab_json.as_lab_file(analysis, _mixed(analysis))
    hessians = of_analysis(analysis.entries)
    checkpoint.write(lab_file, model, tmp_path / "out", hessians=hessians)
    deploy = GPTQDeploy.of_config(lab_file.config, hessians)
    weights = {e.layer: deploy.apply(e, model.weight(e.layer))[0] for e in lab_file.entries if e.tensor == "weight"}
    _served_as_chosen(tmp_path / "out", lab_file, model, weights)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_mixed_precision_allocations_load_as_the_lab_chose_them(models, name, tmp_path):
    argv = ["allocate", name, "--layers", r"re:model\.layers\.0\.self_attn\..*|model\.layers\.0\.mlp\.[a-z_]+proj"]
    argv += ["--schemes", "NVFP4,FP8,W4A16,none", "--budget", "7", "--observers", "memoryless_minmax,mse_grid"]
    argv += ["--samples", "4", "--held-out-samples", "8", "--quiet", "--out", str(tmp_path / "a.json")]
    argv += ["--checkpoint", str(tmp_path / "out")]
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == 0, err.getvalue()
    lab_file = lab_json.load_file(tmp_path / "a.json")
    _served_as_chosen(tmp_path / "out", lab_file, models[name])


def test_per_layer_global_scales_are_rescaled_where_served_so_the_lab_refuses_them(models, tmp_path, monkeypatch):
    """What every NVFP4 checkpoint of a decoder was before issue 39: each q/k/v its own global scale.
    The lab refuses it; written anyway, the loader reads k and v against q's global scale."""
    model = models["tiny-llama"]
    qkv = [f"model.layers.3.self_attn.{p}_proj" for p in "qkv"]
    analysis = analyse(model, qkv, RunConfig({"weight": ob.preset("NVFP4A16")["weight"]}, ("memoryless_minmax",)))
    lab_file = lab_json.as_lab_file(analysis, {(layer, "weight"): "memoryless_minmax" for layer in qkv})
    own = {e.layer: e.per_layer[0].qparams for e in analysis.entries}
    forced = replace(lab_file, entries=[replace(e, qparams=own[e.layer]) for e in lab_file.entries])
    with pytest.raises(checkpoint.CheckpointError, match="self_attn qkv_proj: weight global scales differ"):
        checkpoint.write(forced, model, tmp_path / "refused")
    monkeypatch.setattr(checkpoint, "check_served", lambda layers, facts, experts=(): None)
    checkpoint.write(forced, model, tmp_path / "out")
    served, alone = vllm_loader.served(tmp_path / "out"), vllm_loader.own(tmp_path / "out")
    ratios = {}
    for layer in qkv:
        fake = ob.fake_quantize(model.weight(layer).float(), own[layer], forced.entries[0].spec)
        assert torch.equal(alone[layer].weight, fake)
        ratios[layer] = float(served[layer].weight.abs().sum() / alone[layer].weight.abs().sum())
    smallest = min(float(own[layer].global_scale) for layer in qkv)
    largest = max(float(own[layer].global_scale) for layer in qkv)
    for layer in qkv:  # a shard is read against the largest global scale: shrunk by its ratio
        assert ratios[layer] == pytest.approx(float(own[layer].global_scale) / largest, rel=1e-6)
    assert min(ratios.values()) < 0.5 and float(own[qkv[0]].global_scale) == smallest

