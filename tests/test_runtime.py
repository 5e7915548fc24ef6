"""What the server runs (``lab.runtime``, issue 39): which layers a server fuses, the one rule every
stage reads, and which of their scales it keeps one of."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from lab.runtime.fusion import Level, fused_groups, missing_members, unit
from lab.runtime.scales import Collapse, collapse, load_problems, serving_level
from sample_models import open_model


def _names(model: str) -> list[str]:
    return [info.name for info in open_model(model).layers() if len(info.shape) >= 2]


def test_a_decoder_fuses_qkv_and_gate_up_per_block():
    groups = dict(fused_groups(_names("tiny-llama")))
    assert groups["model.layers.0.self_attn qkv_proj"] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert groups["model.layers.0.mlp gate_up_proj"] == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert groups["model.layers.0.self_attn.o_proj"] == ["model.layers.0.self_attn.o_proj"]
    assert groups["model.layers.1.mlp.down_proj"] == ["model.layers.1.mlp.down_proj"]
    assert "model.layers.1.self_attn qkv_proj" in groups
    assert sum(len(members) for members in groups.values()) == len(_names("tiny-llama"))
    assert dict(fused_groups(_names("tiny-llama"), Level.LINEAR)) == groups  # a dense decoder: one level


def test_experts_share_a_kernel_across_the_moe_layer_and_their_gate_up_per_expert():
    names = _names("tiny-moe")
    kernel = dict(fused_groups(names, Level.KERNEL))
    w13 = kernel["model.layers.0.mlp.experts experts w13 (gate and up)"]
    assert len(w13) == 8 and all(name.endswith(("gate_proj", "up_proj")) for name in w13)
    assert len(kernel["model.layers.0.mlp.experts experts w2 (down)"]) == 4
    assert kernel["model.layers.0.mlp.gate"] == ["model.layers.0.mlp.gate"]  # the router stays alone
    linear = dict(fused_groups(names, Level.LINEAR))
    assert linear["model.layers.0.mlp.experts.2 gate_up_proj"] == [
        "model.layers.0.mlp.experts.2.gate_proj",
        "model.layers.0.mlp.experts.2.up_proj",
    ]
    assert linear["model.layers.0.mlp.experts.2.down_proj"] == ["model.layers.0.mlp.experts.2.down_proj"]


def test_a_bert_encoder_fuses_query_key_value_as_vllm_loads_it():
    groups = dict(fused_groups(_names("minilm")))
    assert groups["encoder.layer.0.attention.self qkv_proj"] == [
        f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")
    ]
    assert groups["encoder.layer.0.intermediate.dense"] == ["encoder.layer.0.intermediate.dense"]


MOE = "m.layers.0.block_sparse_moe.experts"


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), "self_attn fused_qkv_a_proj"),
        (("block_sparse_moe.experts.1.w1", "block_sparse_moe.experts.1.w3"), "block_sparse_moe.experts.1 w13"),
        (("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp.shared_experts gate_up_proj"),
    ],
)
def test_llm_compressors_other_fused_names(names, expected):
    layers = [f"m.layers.0.{name}" for name in names]
    assert fused_groups(layers, Level.LINEAR) == [(f"m.layers.0.{expected}", layers)]
    assert unit(f"{MOE}.1.w2", Level.KERNEL) == f"{MOE} experts w2 (down)"


def test_missing_members_are_what_a_server_would_fuse_with_the_chosen():
    names = _names("tiny-llama")
    missing = missing_members(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"], names, Level.LINEAR)
    assert missing == {
        "model.layers.0.self_attn qkv_proj": ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    }


@pytest.mark.parametrize(
    ("preset", "weight", "input"),
    [
        ("NVFP4", Collapse.GLOBAL_SCALE, Collapse.GLOBAL_SCALE),
        ("NVFP4A16", Collapse.GLOBAL_SCALE, None),
        ("FP8", Collapse.TENSOR_SCALE, Collapse.TENSOR_SCALE),
        ("FP8_DYNAMIC", None, None),
        ("FP8_BLOCK", None, None),
        ("W4A16", None, None),
        ("W8A8", None, None),
        ("MXFP4", None, None),
        ("MXFP8", None, None),
    ],
)
def test_what_a_fusing_server_keeps_one_of_per_preset(preset, weight, input):
    specs = ob.preset(preset)
    assert collapse(specs["weight"], "weight") == weight
    assert (collapse(specs["input"], "input") if specs["input"] is not None else None) == input
    expected = Level.KERNEL if input else (Level.LINEAR if weight else None)
    assert serving_level({k: v for k, v in specs.items() if v is not None}) == expected


def test_integer_per_tensor_weights_keep_their_own_scale_and_static_inputs_share_one():
    assert collapse(ob.QuantSpec("int8"), "weight") is None  # vLLM expands them per channel
    assert collapse(ob.QuantSpec("int8"), "input") == Collapse.TENSOR_SCALE


def _qparams(global_scale: float | None = None, scale: float = 1.0) -> ob.QParams:
    one = torch.tensor([scale])
    g = None if global_scale is None else torch.tensor([global_scale])
    return ob.QParams(one, torch.zeros(1, dtype=torch.int32), -one, one, global_scale=g)


QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
NV = ob.preset("NVFP4A16")["weight"]


def test_a_checkpoint_load_problem_names_the_group_in_one_line():
    shared = {layer: {"weight": (NV, _qparams(300.0))} for layer in QKV}
    assert load_problems(shared, QKV) == []
    per_layer = {layer: {"weight": (NV, _qparams(g))} for layer, g in zip(QKV, (3561.6, 8985.8, 18985.0), strict=True)}
    (problem,) = load_problems(per_layer, QKV)
    assert problem.startswith("model.layers.0.self_attn qkv_proj: weight global scales differ (q_proj 3561.6")
    assert "\n" not in problem
    (partial,) = load_problems({QKV[0]: shared[QKV[0]]}, QKV)
    assert "q_proj quantized but k_proj, v_proj not" in partial
    mixed = dict(shared) | {QKV[2]: {"weight": (ob.preset("FP8")["weight"], _qparams(scale=0.1))}}
    (schemes,) = load_problems(mixed, QKV)
    assert "different schemes" in schemes
