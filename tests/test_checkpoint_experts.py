"""Fused MoE experts in a compressed checkpoint (issue 41, deliverable 4 on tiny-moe): each expert's
projection packed under the name transformers saves it by, and loaded by transformers into the
fused experts as the lab's quantized weights; schemes its expert loader cannot read stay dense with
a note; an experts module packed in part, or experts in two weight schemes, is refused in one line."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import checkpoint, lab_json
from lab.export.compressed_tensors import CtLayer
from lab.export.experts import UNPLACED, saved_layers
from sample_models import open_model
from sample_models.layers import _tagged_view, expert_of, expert_weight, saved_expert_names

BLOCK0 = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
SMALL = {"samples": 2, "seq_len": 32}


@pytest.fixture(scope="module")
def moe():
    return open_model("tiny-moe")


def _lab_file(model, layers, preset: str, **weight):
    specs = {kind: spec for kind, spec in ob.preset(preset).items() if spec is not None}
    specs["weight"] = replace(specs["weight"], **weight)
    analysis = analyse(model, layers, RunConfig(specs, ("memoryless_minmax",), **SMALL))
    choices = {(e.layer, e.tensor): "memoryless_minmax" for e in analysis.entries}
    return lab_json.as_lab_file(analysis, choices, allow_uncalibrated=True)


def _keys(directory) -> set[str]:
    return {key for part in directory.glob("*.safetensors") for key in safe_open(part, "pt").keys()}


def test_saved_names_are_where_transformers_saves_each_expert(moe, tmp_path) -> None:
    names = saved_expert_names(moe.module())
    assert len(names) == 2 * 4 * 3
    assert names["model.layers.1.mlp.experts.2.up_proj"] == "model.layers.1.block_sparse_moe.experts.2.w3"
    moe.module().save_pretrained(tmp_path)
    with safe_open(next(tmp_path.glob("*.safetensors")), "pt") as saved:
        for view, name in names.items():
            assert torch.equal(saved.get_tensor(f"{name}.weight"), moe.weight(view)), view
    assert moe.saved_expert_names() == names  # from the skeleton, without the weights
    assert open_model("tiny-llama").saved_expert_names() == {}


def test_experts_whose_conversion_cannot_run_on_the_tags_get_no_names(moe, monkeypatch) -> None:
    import transformers.core_model_loading as loading

    def refuses(model, state_dict):
        raise RuntimeError("this conversion needs the real weights")

    monkeypatch.setattr(loading, "revert_weight_conversion", refuses)
    assert saved_expert_names(moe.module()) == {}


def test_a_saved_tensor_is_placed_only_when_it_holds_one_projection_whole() -> None:
    rows = 8
    tags = torch.arange(3 * rows, dtype=torch.float64).reshape(3, rows, 1)
    assert _tagged_view("gate_up_proj", rows, tags[1, :4]) == (1, "gate_proj")
    assert _tagged_view("gate_up_proj", rows, tags[2, 4:]) == (2, "up_proj")
    assert _tagged_view("down_proj", rows, tags[0]) == (0, "down_proj")
    assert _tagged_view("gate_up_proj", rows, tags[1, :3]) is None  # part of a projection
    assert _tagged_view("gate_up_proj", rows, tags[1, 2:6]) is None  # rows of two
    assert _tagged_view("down_proj", rows, tags[0].t()) is None  # transposed
    assert _tagged_view("gate_up_proj", rows, tags[1, :4].flip(0)) is None  # out of order


@pytest.mark.parametrize(("preset", "weight"), [("W4A16", {"group_size": 16}), ("W8A8", {}), ("MXFP4", {})])
def test_packed_experts_load_in_transformers_as_the_lab_quantized_them(moe, tmp_path, preset, weight) -> None:
    lab_file = _lab_file(moe, BLOCK0, preset, **weight)
    written = checkpoint.write(lab_file, moe, tmp_path / "ck")
    keys = _keys(tmp_path / "ck")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys  # written per expert, not fused
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys  # not chosen: as stored
    [group] = written.quantization_config["config_groups"].values()
    assert all(
        target.startswith("re:^model\\.layers\\.0\\.block_sparse_moe\\.experts\\.") for target in group["targets"]
    )
    assert group["input_activations"] is None  # an expert's activation scales are not read by transformers
    has_input = ob.preset(preset).get("input") is not None
    assert has_input == any("input: stays dense" in note for note in written.notes)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").state_dict()
    fused = {p: loaded[f"model.layers.0.mlp.experts.{p}"].float() for p in ("gate_up_proj", "down_proj")}
    for entry in lab_file.entries:
        if entry.tensor == "weight":
            _, _, expert, projection = expert_of(entry.layer)
            expected = ob.fake_quantize(moe.weight(entry.layer).float(), entry.qparams, entry.spec)
            assert torch.equal(expert_weight(fused, expert, projection), expected), entry.layer
    other = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(loaded[other], moe.stored(other))


@pytest.mark.parametrize("preset", ["NVFP4A16", "FP8_DYNAMIC"])
def test_experts_in_a_scheme_transformers_cannot_load_stay_dense_with_the_reason(moe, tmp_path, preset) -> None:
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    layers = [*qkv, *BLOCK0]
    written = checkpoint.write(_lab_file(moe, layers, preset), moe, tmp_path / "ck")
    assert written.packed_layers == qkv
    dtype = ob.preset(preset)["weight"].dtype
    reason = f"stays dense (transformers' loader of packed experts reads int4/int8 or MXFP4 weights, not {dtype})"
    assert f"model.layers.0.mlp.experts.0.gate_proj weight: {reason}" in written.notes
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(loaded[key], moe.stored(key))


def test_an_experts_module_packed_in_part_is_refused_and_nothing_written(moe, tmp_path) -> None:
    layers = [name for name in BLOCK0 if ".experts.3." not in name]
    with pytest.raises(
        checkpoint.CheckpointError, match=r"0\.w1, 1\.w1, 2\.w1, 0\.w3, 1\.w3, 2\.w3 quantized but 3\.w1, 3\.w3 not"
    ):
        checkpoint.write(_lab_file(moe, layers, "W4A16", group_size=16), moe, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_experts_in_two_weight_schemes_are_refused_in_one_line(moe, tmp_path) -> None:
    block1 = [name.replace(".layers.0.", ".layers.1.") for name in BLOCK0]
    first = _lab_file(moe, BLOCK0, "W4A16", group_size=16)
    second = _lab_file(moe, block1, "W4A16", group_size=32)
    both = replace(first, entries=[*first.entries, *second.entries])
    with pytest.raises(
        checkpoint.CheckpointError, match="transformers loads every expert of a checkpoint with one"
    ) as err:
        checkpoint.write(both, moe, tmp_path / "ck")
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_experts_transformers_saves_fused_stay_dense_with_a_note() -> None:
    layers = [CtLayer("model.layers.0.mlp.experts.0.gate_proj", {"weight": {}}, {}), CtLayer("lm_head", {}, {})]
    notes: list[str] = []
    assert [layer.layer for layer in saved_layers(layers, {}, notes)] == ["lm_head"]
    assert notes == [f"model.layers.0.mlp.experts.0.gate_proj: stays dense ({UNPLACED})"]


def test_a_checkpoint_in_the_saved_layout_packs_its_expert_layers_as_they_are_stored(moe, tmp_path) -> None:
    # tiny-moe as transformers saves it: its experts are stored one projection per expert, listed as
    # such, packed under their own names and targeted as experts; transformers loads them fused
    moe.module().save_pretrained(tmp_path / "saved")
    moe.tokenizer().save_pretrained(tmp_path / "saved")
    saved = open_model(str(tmp_path / "saved"))
    layers = [info.name for info in saved.layers(r"re:.*\.block_sparse_moe\.experts\.\d+\.w[123]$")]
    assert len(layers) == 24
    lab_file = _lab_file(saved, layers, "W4A16", group_size=16)
    written = checkpoint.write(lab_file, saved, tmp_path / "ck")
    assert sorted(written.packed_layers) == sorted(layers)
    [group] = written.quantization_config["config_groups"].values()
    assert sorted(group["targets"]) == sorted(f"re:^{re.escape(name)}$" for name in layers)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck").state_dict()
    names = {saved_name: view for view, saved_name in moe.saved_expert_names().items()}
    for entry in lab_file.entries:
        module, _, expert, projection = expert_of(names[entry.layer])
        fused = {p: loaded[f"{module}.{p}"].float() for p in ("gate_up_proj", "down_proj")}
        expected = ob.fake_quantize(saved.weight(entry.layer).float(), entry.qparams, entry.spec)
        assert torch.equal(expert_weight(fused, expert, projection), expected), entry.layer
    # the attention alone: its experts stay dense one per expert, which transformers 5.23 cannot
    # load beside packed layers (it merges only packed experts), and the notes say so
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    written = checkpoint.write(_lab_file(saved, qkv, "W4A16", group_size=16), saved, tmp_path / "attention")
    assert any(note.startswith("24 expert projection(s) stored one per expert stay dense") for note in written.notes)
    with pytest.raises(RuntimeError, match="conversion"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "attention")


def test_gptq_packs_the_experts_no_token_reached_round_to_nearest_and_says_so(moe, tmp_path) -> None:
    # block 0's experts under GPTQ on 4 short windows: experts 2 and 3 see no token, so the run keeps
    # that (an empty Hessian, not a missing one) and the checkpoint packs them with their chosen
    # qparams, as llm-compressor leaves a module its GPTQ never saw; the others get their GPTQ codes
    import io

    from lab.cli import main
    from lab.gptq import hessians
    from lab.gptq.deploy import GPTQDeploy

    target, directory = tmp_path / "x.json", tmp_path / "ck"
    argv = ["run", "tiny-moe", "--layers", r"re:model\.layers\.0\.mlp\.experts\.\d+\.(gate|up|down)_proj"]
    argv += ["--format", "int4", "--strategy", "group", "--group-size", "16", "--observers", "minmax", "--gptq"]
    argv += ["--samples", "4", "--seq-len", "32", "--out", str(target), "--checkpoint", str(directory), "--quiet"]
    err = io.StringIO()
    assert main(argv, out=io.StringIO(), err=err) == 0, err.getvalue()
    lab_file = lab_json.load_file(target)
    kept = hessians.read(hessians.directory_for(target))
    deploy = GPTQDeploy.of_config(lab_file.config, kept)
    unreached = {e.layer for e in lab_file.entries if not kept(e.layer).numel()}
    assert {name.split(".")[-2] for name in unreached} == {"2", "3"} and len(unreached) == 6
    notes = (directory / "observer_lab_checkpoint.txt").read_text()
    assert all(f"{name} weight: {checkpoint.UNREACHED_BY_GPTQ}" in notes for name in unreached)
    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    fused = {p: loaded[f"model.layers.0.mlp.experts.{p}"].float() for p in ("gate_up_proj", "down_proj")}
    for entry in lab_file.entries:
        _, _, expert, projection = expert_of(entry.layer)
        rounded = ob.fake_quantize(moe.weight(entry.layer).float(), entry.qparams, entry.spec)
        expected = rounded if entry.layer in unreached else deploy.apply(entry, moe.weight(entry.layer))[0]
        assert torch.equal(expert_weight(fused, expert, projection), expected), entry.layer
        assert (entry.layer in unreached) == torch.equal(expert_weight(fused, expert, projection), rounded)
    # a Hessian file that is missing is not taken for a layer no token reached
    first = lab_file.entries[0]
    with pytest.raises(ValueError, match="its run kept no GPTQ Hessian"):
        GPTQDeploy(deploy.gptq, lambda layer: None).apply(first, moe.weight(first.layer))
