"""``EffectRunner.run_stacked``: several quantizations of the same layer in one pass, their hidden
states stacked along the batch, give each one's own ``run`` (an encoder's padded batches, a
decoder's rotary position embeddings and masks repeated along)."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from sample_models import open_model
from sample_models.effect import EffectRunner, TensorQuant


def _variants(model, layer: str) -> list[dict]:
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    weight = model.weight(layer)
    variants = []
    for name in ("minmax", "mse_grid", "imatrix_mse"):
        observer = ob.create(name, spec, kind="weight")
        observer.observe(weight)
        variants.append({(layer, "weight"): TensorQuant(spec, observer.qparams())})
    variants[1][(layer, "input")] = TensorQuant(ob.QuantSpec("int8", strategy="token", dynamic=True))
    variants[0][(layer, "input")] = variants[2][(layer, "input")] = variants[1][(layer, "input")]
    return variants


@pytest.mark.parametrize(
    ("source", "layer"),
    [("minilm", "encoder.layer.4.intermediate.dense"), ("tiny-llama", "model.layers.0.self_attn.q_proj")],
)
def test_stacked_runs_are_each_variants_own_run(source, layer):
    model = open_model(source)
    runner = EffectRunner(model, samples=12, seq_len=32)
    variants = _variants(model, layer)
    stacked = runner.run_stacked(variants)
    assert len(stacked) == 3
    for variant, together in zip(variants, stacked, strict=True):
        alone = runner.run(variant, sqnr=False)
        assert together.start == alone.start
        for a, b in zip(together.outputs, alone.outputs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    differs = [float((a.outputs[0] - b.outputs[0]).abs().max()) for a, b in zip(stacked, stacked[1:], strict=False)]
    assert max(differs) > 0  # the variants are different quantizations, each in its own share


def test_stacked_variants_must_quantize_the_same_tensors():
    model = open_model("tiny-llama")
    runner = EffectRunner(model, samples=4, seq_len=16)
    first, second = _variants(model, "model.layers.0.self_attn.q_proj")[:2]
    other = {("model.layers.1.mlp.up_proj", "weight"): first[("model.layers.0.self_attn.q_proj", "weight")]}
    with pytest.raises(ValueError, match="same tensors"):
        runner.run_stacked([first, other])
