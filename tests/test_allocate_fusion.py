"""Fused layers share a scheme (issue 34, ``lab.allocate.fusion``): a decoder's q/k/v and gate/up, a
mixture of experts' gate/up across experts and its down projections; everything else alone."""

from __future__ import annotations

from lab.allocate.fusion import fused_groups
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


def test_experts_share_a_scheme_across_the_moe_layer():
    groups = dict(fused_groups(_names("tiny-moe")))
    w13 = groups["model.layers.0.mlp.experts experts w13 (gate and up)"]
    assert len(w13) == 8 and all(name.endswith(("gate_proj", "up_proj")) for name in w13)
    assert len(groups["model.layers.0.mlp.experts experts w2 (down)"]) == 4
    assert groups["model.layers.0.mlp.gate"] == ["model.layers.0.mlp.gate"]  # the router stays alone


def test_an_encoder_fuses_nothing():
    names = _names("minilm")
    assert [members for _, members in fused_groups(names)] == [[name] for name in names]
