"""A GPTQ choice deployed (issue 33, "Deployable"): the checkpoint holds each chosen observer's GPTQ
codes with its scales (``fixed``) or the refit ones, made again from the Hessians the run keeps
beside its JSON; ``export`` gives the same checkpoint from the saved file; the recipe becomes a
``GPTQModifier`` with the run's knobs; propagation calibrates the next block behind the GPTQ
weights; bad input is one line."""

from __future__ import annotations

import gc
import io
import json
import threading
from pathlib import Path

import pytest
import safetensors.torch as safetensors_torch
import torch
import yaml
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.export import lab_json, recipe
from lab.export.compressed_tensors import CT_OBSERVER_NAMES
from lab.gptq import hessians
from lab.gptq.layer import entry_gptq
from lab.results import choose
from sample_models import open_model
from sample_models.effect import TensorQuant, quantizing_hooks

LAYERS = "model.layers.0.mlp.*"
RUN = ("--kinds", "weight", "--format", "int4", "--strategy", "group", "--group-size", "16")
CALIBRATION = ("--samples", "4", "--seq-len", "32")
GPTQ_MINMAX = RunConfig(
    specs={"weight": ob.QuantSpec(dtype="int4", strategy="group", group_size=16)},
    observers=("minmax",),
    samples=4,
    seq_len=32,
    gptq=ob.GPTQSpec(),
)


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _run(tmp_path, *gptq: str, observers: str = "minmax,mse_grid") -> tuple[str, str]:
    tmp_path.mkdir(exist_ok=True)
    target, directory = tmp_path / "run.json", tmp_path / "ckpt"
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", LAYERS, *RUN, "--observers", observers, *CALIBRATION, "--gptq", *gptq,
        "--out", str(target), "--checkpoint", str(directory), "--recipe", str(tmp_path / "recipe.yaml"), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    return str(target), str(directory)


def _dequantized(directory: str):
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=CompressedTensorsConfig(dequantize=True))


def _expected(llama, target: str, scales: str, actorder: str = "static"):
    """What the checkpoint must hold: each chosen observer's GPTQ of the layer, made here from the
    model's weight and the kept Hessian, and its round-to-nearest weight for contrast."""
    saved = lab_json.load_file(target)
    kept = hessians.read(hessians.directory_for(target))
    gptq = ob.GPTQSpec(actorder=actorder, scales=scales)
    for entry in saved.entries:
        weight = llama.weight(entry.layer).float()

        def fixed(tensor, entry=entry, weight=weight):
            if torch.equal(tensor, weight):
                return entry.qparams
            return ob.run_one(entry.observer, tensor, entry.spec, "weight").qparams

        done = ob.gptq_quantize(weight, kept(entry.layer), entry.spec, fixed, **gptq.kwargs())
        yield entry, done, ob.fake_quantize(weight, entry.qparams, entry.spec)


def test_the_checkpoint_holds_the_gptq_codes_with_the_observers_fixed_scales(llama, tmp_path):
    target, directory = _run(tmp_path)
    assert sorted(p.name for p in hessians.directory_for(target).iterdir()) == sorted(
        f"model.layers.0.mlp.{name}.safetensors" for name in ("down_proj", "gate_proj", "up_proj")
    )
    loaded = _dequantized(directory)
    for entry, done, rtn in _expected(llama, target, "fixed"):
        got = loaded.get_submodule(entry.layer).weight.detach()
        assert torch.equal(got, done.weight), entry.layer
        assert not torch.equal(got, rtn)  # the error feedback moved codes
        assert torch.equal(done.qparams.scale, entry.qparams.scale)  # fixed: the observer's scales
    packed = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        assert packed.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_refit_scales_are_the_ones_the_sweep_found(llama, tmp_path):
    target, directory = _run(tmp_path, "--gptq-scales", "refit", "--gptq-actorder", "none", observers="mse_grid")
    loaded = _dequantized(directory)
    for entry, done, _ in _expected(llama, target, "refit", "none"):
        assert torch.equal(loaded.get_submodule(entry.layer).weight.detach(), done.weight), entry.layer
        stored = _stored(directory, f"{entry.layer}.weight_scale")
        assert torch.equal(stored.float(), done.qparams.scale.float())
        assert not torch.equal(done.qparams.scale, entry.qparams.scale)  # refit: not the original weight's


def _stored(directory: str, key: str) -> torch.Tensor:
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors = safetensors_torch.load_file(str(path))
        if key in tensors:
            return tensors[key]
    raise KeyError(key)


def test_export_writes_the_same_checkpoint_from_the_saved_file(tmp_path):
    target, directory = _run(tmp_path)
    again = tmp_path / "again"
    code, _, err = _cli("export", target, "--model", "tiny-llama", "--checkpoint", str(again))
    assert code == 0, err
    for path in sorted(Path(directory).glob("*.safetensors")):
        first, second = safetensors_torch.load_file(str(path)), safetensors_torch.load_file(str(again / path.name))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_the_recipe_is_a_gptq_modifier_with_the_runs_knobs(tmp_path):
    _run(tmp_path, "--gptq-block-size", "64", "--gptq-dampening", "0.05", "--gptq-actorder", "none")
    stage = yaml.safe_load((tmp_path / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert list(stage) == ["GPTQModifier"]
    modifier = stage["GPTQModifier"]
    assert (modifier["block_size"], modifier["dampening_frac"], modifier["actorder"]) == (64, 0.05, None)
    targets = sorted(t for group in modifier["config_groups"].values() for t in group["targets"])
    assert targets == [f"model.layers.0.mlp.{name}" for name in ("down_proj", "gate_proj", "up_proj")]
    assert all(group["weights"]["group_size"] == 16 for group in modifier["config_groups"].values())


def test_a_refit_recipe_says_llm_compressor_fixes_the_scales():
    notes: list[str] = []
    args = recipe.gptq_modifier_args({"scales": "refit", "actorder": "weight"}, notes)
    assert args == {"block_size": 128, "dampening_frac": 0.01, "actorder": "static"}
    assert len(notes) == 1 and "fixes them before the sweep" in notes[0]
    assert recipe.gptq_modifier_args({"actorder": "dynamic"}, [])["actorder"] == "group"


def test_deploying_without_the_runs_hessians_is_one_line(tmp_path):
    target, _ = _run(tmp_path)
    for path in hessians.directory_for(target).iterdir():
        path.unlink()
    hessians.directory_for(target).rmdir()
    code, _, err = _cli("export", target, "--model", "tiny-llama", "--checkpoint", str(tmp_path / "x"))
    assert code == 2 and "run.gptq-hessians is missing" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_group_activation_order_with_groups_cannot_be_packed(tmp_path):
    target = tmp_path / "run.json"
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", "model.layers.0.mlp.up_proj", *RUN, "--observers", "minmax", *CALIBRATION,
        "--gptq", "--gptq-actorder", "group", "--out", str(target), "--checkpoint", str(tmp_path / "c"), "--quiet",
    )  # fmt: skip
    assert code == 2 and "needs g_idx" in err and not (tmp_path / "c").exists()


def test_propagation_calibrates_the_next_block_behind_the_gptq_weights(llama):
    """llm-compressor's sequential pipeline: block 1's Hessian is that of its inputs with block 0's
    chosen weights replaced by their GPTQ weights, not by round-to-nearest ones."""
    first = ["model.layers.0.mlp.down_proj"]
    second = "model.layers.1.mlp.up_proj"
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    config = RunConfig(
        specs={"weight": spec}, observers=("minmax",), samples=4, seq_len=32, gptq=ob.GPTQSpec(), propagate=True
    )
    analysis = analyse(llama, [*first, second], config)
    chosen = choose(analysis)
    quant = {}
    for layer in first:
        entry = analysis.entry(layer, "weight")
        gptq_weight = entry_gptq(entry, chosen[(layer, "weight")], config.gptq).weight
        quant[(layer, "weight")] = TensorQuant(spec, entry.result("minmax").qparams, gptq_weight)
    heads = llama.config.num_attention_heads
    with quantizing_hooks(llama.module(), quant, heads, threading.get_ident()):
        behind = llama.capture([second], sequential=False, max_bytes=1 << 30, samples=4, seq_len=32)[second]
    expected = ob.hessian_of_rows(behind.float())
    seen = analysis.entry(second, "weight").hessian
    torch.testing.assert_close(seen, expected, rtol=1e-4, atol=1e-6)
    rtn = {key: TensorQuant(spec, q.qparams) for key, q in quant.items()}
    with quantizing_hooks(llama.module(), rtn, heads, threading.get_ident()):
        behind_rtn = llama.capture([second], sequential=False, max_bytes=1 << 30, samples=4, seq_len=32)[second]
    assert not torch.allclose(seen, ob.hessian_of_rows(behind_rtn.float()), rtol=1e-4, atol=1e-6)


def test_propagation_makes_the_widest_gptq_weight_first_and_none_for_the_last_block(llama, monkeypatch):
    # the hooks hold every GPTQ weight of the block: the widest sweep (its (in, in) matrices) runs
    # before any is held, and the hooks still get each layer's own; the last block asked for is
    # not run again, so it makes none
    import lab.analyse.pipeline as pipeline

    block = ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    config = RunConfig(
        specs={"weight": spec}, observers=("minmax",), samples=4, seq_len=32, gptq=ob.GPTQSpec(), propagate=True
    )
    made, hooked = [], []
    weight_quant = pipeline.weight_quant
    monkeypatch.setattr(pipeline, "weight_quant", lambda e, *a: made.append(e.layer) or weight_quant(e, *a))
    hooks = pipeline.quantizing_hooks
    monkeypatch.setattr(pipeline, "quantizing_hooks", lambda m, q, *a: hooked.append(dict(q)) or hooks(m, q, *a))
    analysis = analyse(llama, [*block, "model.layers.1.mlp.up_proj"], config)
    assert made[0] == "model.layers.0.mlp.down_proj" and sorted(made) == sorted(block)  # 688 columns before 256
    (quant,) = hooked  # block 1 is the last one asked for: nothing reads its outputs, it makes no GPTQ weight
    assert list(quant) == [(layer, "weight") for layer in block]  # the block's order, each its own
    for layer in block:
        entry = analysis.entry(layer, "weight")
        assert quant[(layer, "weight")].weight.shape == entry.shape


def test_a_quantized_weight_of_another_shape_is_refused():
    quant = TensorQuant(ob.QuantSpec("int8"), None, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="quantized weight of shape"):
        quant(torch.zeros(3, 2), "weight")


def test_the_hessians_beside_the_json_are_those_of_the_analysis(llama, tmp_path):
    config = GPTQ_MINMAX
    analysis = analyse(llama, ["model.layers.0.mlp.up_proj"], config)
    assert hessians.save(tmp_path / "h", analysis.entries) == 1
    read = hessians.read(tmp_path / "h")
    assert torch.equal(read("model.layers.0.mlp.up_proj"), analysis.entries[0].hessian)
    assert read("model.layers.0.mlp.down_proj") is None
    of_analysis = hessians.of_analysis(analysis.entries)
    assert torch.equal(of_analysis("model.layers.0.mlp.up_proj"), analysis.entries[0].hessian)
    with pytest.raises(ValueError, match="not a layer name"):
        read("../escape")
    assert json.loads(json.dumps(config.to_dict()))["gptq"]["scales"] == "fixed"


def test_the_model_level_effect_runs_the_gptq_weights(llama):
    """A GPTQ run's choices run in the model as their GPTQ weights (what the checkpoint holds), so
    the model-level metrics measure what a GPTQ model gets."""
    from dataclasses import replace

    from lab.effect.evaluate import Evaluator, from_analysis

    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    config = RunConfig(specs={"weight": spec}, observers=("minmax",), samples=4, seq_len=32, gptq=ob.GPTQSpec())
    layers = ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    analysis = analyse(llama, layers, config)
    chosen = {(layer, "weight"): "minmax" for layer in layers}
    under_gptq = from_analysis(analysis, chosen, "gptq")
    for layer in layers:
        expected = entry_gptq(analysis.entry(layer, "weight"), "minmax", config.gptq).weight
        assert torch.equal(under_gptq.tensors[(layer, "weight")].weight, expected)
    rounded = from_analysis(replace(analysis, config=replace(config, gptq=None)), chosen, "rtn")
    assert all(quant.weight is None for quant in rounded.tensors.values())
    evaluator = Evaluator(llama, samples=2, seq_len=16)
    sqnr = [evaluator.evaluate(s).block_sqnr_db[0] for s in (under_gptq, rounded)]
    assert all(0 < value < float("inf") for value in sqnr) and sqnr[0] != sqnr[1]


def test_evaluate_runs_a_saved_gptq_choice_from_its_hessians(tmp_path):
    target, _ = _run(tmp_path, observers="minmax")
    code, out, err = _cli("evaluate", "tiny-llama", "--choices", target, "--out", str(tmp_path / "e.json"))
    assert code == 0, err
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert "kl" in out and len(evaluated["evaluations"]) == 2
    for path in hessians.directory_for(target).iterdir():
        path.unlink()
    code, _, err = _cli("evaluate", "tiny-llama", "--choices", target, "--out", str(tmp_path / "f.json"))
    assert code == 2 and "Hessian" in err and not (tmp_path / "f.json").exists()


def test_a_sweep_keeps_its_hessians_and_deploys_the_same_checkpoint_as_a_run(tmp_path):
    _, directory = _run(tmp_path / "run", observers="minmax")
    swept, swept_dir = tmp_path / "sweep.json", tmp_path / "sweep-ckpt"
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", LAYERS, *RUN, "--observers", "minmax", *CALIBRATION, "--gptq",
        "--chunk", "2", "--out", str(swept), "--checkpoint", str(swept_dir), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert len(list(hessians.directory_for(swept).glob("*.safetensors"))) == 3
    for path in sorted(Path(directory).glob("*.safetensors")):
        first, second = safetensors_torch.load_file(str(path)), safetensors_torch.load_file(str(swept_dir / path.name))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_sensitivity_of_a_gptq_run_measures_each_observers_gptq_weight(llama):
    from dataclasses import replace

    from lab.effect.evaluate import Evaluator
    from lab.effect.sensitivity import sensitivity

    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    config = RunConfig(
        specs={"weight": spec}, observers=("minmax", "mse_grid"), samples=4, seq_len=32, gptq=ob.GPTQSpec()
    )
    analysis = analyse(llama, ["model.layers.0.mlp.down_proj"], config)
    evaluator = Evaluator(llama, samples=2, seq_len=16)
    under_gptq = sensitivity(evaluator, analysis, metric="top1_agreement").frame
    rounded = sensitivity(evaluator, replace(analysis, config=replace(config, gptq=None)), metric="top1_agreement")
    assert len(under_gptq) == 2 and under_gptq["perplexity"].notna().all()
    assert not (under_gptq["perplexity"].to_numpy() == rounded.frame["perplexity"].to_numpy()).all()


def test_the_cli_propagates_behind_what_choose_picks_under_gptq(llama, tmp_path):
    """``--choose`` decides what propagation quantizes too: block 1's Hessian (kept beside the JSON)
    is that of its inputs behind block 0's weight as GPTQ with the observer ``--choose`` named."""
    first, second = "model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj"
    target = tmp_path / "run.json"
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", f"{first},{second}", *RUN, "--observers", "minmax,mse_grid", *CALIBRATION,
        "--gptq", "--sequential", "--propagate", "--choose", "model.layers.0.*=minmax", "--out", str(target), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    kept = hessians.read(hessians.directory_for(target))
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    weight = llama.weight(first).float()
    qparams = ob.run_one("minmax", weight, spec, "weight").qparams
    gptq_weight = ob.gptq_quantize(weight, kept(first), spec, lambda _: qparams, actorder="static").weight
    quant = {(first, "weight"): TensorQuant(spec, qparams, gptq_weight)}
    with quantizing_hooks(llama.module(), quant, llama.config.num_attention_heads, threading.get_ident()):
        behind = llama.capture([second], sequential=False, max_bytes=1 << 30, samples=4, seq_len=32)[second]
    torch.testing.assert_close(kept(second), ob.hessian_of_rows(behind.float()), rtol=1e-4, atol=1e-6)


def test_the_recipe_asks_llm_compressor_for_what_the_checkpoint_holds(tmp_path):
    """The recipe round trip without llm-compressor (the bench runs its oneshot on this file): each
    config group reads as a compressed-tensors scheme, and the recipe's groups are the checkpoint's
    (same targets, weight args and observer), under a GPTQModifier with the run's knobs."""
    from compressed_tensors.quantization import QuantizationScheme

    _, directory = _run(tmp_path, observers="minmax")
    modifier = yaml.safe_load((tmp_path / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]["GPTQModifier"]
    packed = json.loads((Path(directory) / "config.json").read_text())["quantization_config"]["config_groups"]
    asked = {name: QuantizationScheme(**group) for name, group in modifier["config_groups"].items()}
    without_format = {name: {k: v for k, v in group.items() if k != "format"} for name, group in packed.items()}
    assert asked == {name: QuantizationScheme(**group) for name, group in without_format.items()}
    assert {scheme.weights.observer for scheme in asked.values()} == {CT_OBSERVER_NAMES["minmax"]}
    assert (modifier["block_size"], modifier["dampening_frac"], modifier["actorder"]) == (128, 0.01, "static")


def test_a_gptq_run_keeps_each_layers_hessian_on_disk_not_in_memory(llama):
    # every layer's (in, in) Hessian in memory would be 0.9 GB a 7B-wide block for the whole run:
    # once a layer's rows are made its Hessian waits in a file (q, k and v share one), and the
    # calibration's statistics let theirs go
    config = GPTQ_MINMAX
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj"]
    analysis = analyse(llama, layers, config)
    sources = [entry.hessian_source for entry in analysis.entries]
    assert all(callable(source) and not isinstance(source, torch.Tensor) for source in sources)
    q, k, up = (entry.hessian for entry in analysis.entries)
    assert q.shape == (q.shape[0], q.shape[0]) and torch.equal(q, k) and not torch.equal(q, up)
    assert bool((torch.diagonal(up) >= 0).all()) and torch.allclose(up, up.T)
    files = {Path(source.func.__self__._files[source.args[0]]) for source in sources}
    assert len(files) == 2  # q and k read one input: one file
    # the GPTQ weight a choice deploys is made from the read Hessian as from the one in memory
    entry = analysis.entries[2]
    qparams = entry.results[0].qparams
    in_memory = ob.gptq_quantize(entry.data, up, entry.spec, lambda _: qparams, **config.gptq.kwargs())
    assert torch.equal(entry_gptq(entry, "minmax", config.gptq).weight, in_memory.weight)
    folder = next(iter(files)).parent
    del analysis, entry, sources
    gc.collect()
    assert not folder.exists()
