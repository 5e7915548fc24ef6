"""``EffectRunner.run_stacked``: several quantizations of the same layer in one pass, their hidden
states stacked along the batch, give each one's own ``run`` (an encoder's padded batches, a
decoder's rotary position embeddings and masks repeated along)."""

from __future__ import annotations

import copy

import pytest
import torch

import observers as ob
from sample_models import open_model
from sample_models.capture import forward_kwargs
from sample_models.effect import LOGIT_WINDOWS, EffectRunner, TensorQuant, logit_windows
from sample_models.layers import resolve_layer

LLAMA_UP = "model.layers.1.mlp.up_proj"


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


@pytest.mark.parametrize(("source", "layer"), [("minilm", "encoder.layer.1.output.dense"), ("tiny-llama", LLAMA_UP)])
def test_stacked_metrics_are_each_variants_own_without_holding_the_logits(source, layer):
    from lab.effect.evaluate import Evaluator

    evaluator = Evaluator(open_model(source), samples=8, seq_len=32)
    variants = _variants(evaluator.model, layer)
    found, start = evaluator.stacked_metrics(variants)
    runs = evaluator.runner.run_stacked(variants)
    assert start == runs[0].start
    for mine, theirs, variant in zip(found, evaluator.metrics_of(runs), variants, strict=True):
        alone = evaluator.metrics(evaluator.runner.run(variant, sqnr=False))
        assert mine.keys() == theirs.keys() == alone.keys()
        assert all(mine[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-9) for k in mine)
        assert all(mine[k] == pytest.approx(alone[k], rel=1e-4, abs=1e-8) for k in mine)
    assert len({repr(metrics) for metrics in found}) == 3  # three quantizations, three sets of figures
    if source == "tiny-llama":  # each variant's logits went into its sums a few windows at a time, none kept
        runner = evaluator.runner

        def seen(index, rows, float_logits, logits):
            torch.testing.assert_close(float_logits, runner.float_outputs[index][rows], rtol=1e-5, atol=1e-5)
            return rows, tuple(logits.shape)

        held = runner.run_stacked(variants, reduce=seen)
        vocabulary = runner.float_outputs[0].shape[-1]
        expected = [
            [
                (rows, (rows.stop - rows.start, batch.input_ids.shape[1], vocabulary))
                for rows in logit_windows(len(batch.input_ids))
            ]
            for batch in runner.batches
        ]
        assert all(run.outputs == expected for run in held) and len(held) == 3
        assert (
            max(shape[0] for parts in expected for _, shape in parts)
            == LOGIT_WINDOWS
            < len(runner.batches[0].input_ids)
        )


def test_stacked_variants_must_quantize_the_same_tensors():
    model = open_model("tiny-llama")
    runner = EffectRunner(model, samples=4, seq_len=16)
    first, second = _variants(model, "model.layers.0.self_attn.q_proj")[:2]
    other = {("model.layers.1.mlp.up_proj", "weight"): first[("model.layers.0.self_attn.q_proj", "weight")]}
    with pytest.raises(ValueError, match="same tensors"):
        runner.run_stacked([first, other])


def test_fused_moe_expert_weights_run_as_the_model_holding_them():
    """Weights of single experts of a fused experts module (transformers 5 stores Mixtral's as 3-D
    parameters, no module per expert), alone and stacked, give the outputs of a copy of the model
    whose 3-D parameters hold those quantized slices; the model's own parameters are untouched."""
    model = open_model("tiny-moe")
    runner = EffectRunner(model, samples=6, seq_len=32)
    spec = ob.QuantSpec("int4", strategy="group", group_size=16)
    layers = [
        "model.layers.0.mlp.experts.1.up_proj",
        "model.layers.1.mlp.experts.2.gate_proj",
        "model.layers.1.mlp.experts.2.down_proj",
    ]
    before = {name: p.detach().clone() for name, p in model.module().named_parameters() if "experts" in name}
    variants = []
    for name in ("minmax", "mse_grid"):
        variant = {}
        for layer in layers:
            observer = ob.create(name, spec, kind="weight")
            observer.observe(model.weight(layer))
            variant[(layer, "weight")] = TensorQuant(spec, observer.qparams())
        variants.append(variant)
    stacked = runner.run_stacked(variants)
    for variant, together in zip(variants, stacked, strict=True):
        alone = runner.run(variant, sqnr=False)
        hand = copy.deepcopy(model.module())
        with torch.no_grad():
            for (layer, _), quant in variant.items():
                view = resolve_layer(hand, layer).weight()
                view.copy_(quant(view, "weight"))
            expected = [hand(**forward_kwargs(hand, batch)).logits.float() for batch in runner.batches]
        for mine, theirs, ours in zip(alone.outputs, together.outputs, expected, strict=True):
            torch.testing.assert_close(mine, ours, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert float((stacked[0].outputs[0] - stacked[1].outputs[0]).abs().max()) > 0
    assert float((stacked[0].outputs[0] - runner.float_outputs[0]).abs().max()) > 0
    after = dict(model.module().named_parameters())
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_only_the_weights_of_fused_moe_experts_can_be_evaluated():
    runner = EffectRunner(open_model("tiny-moe"), samples=2, seq_len=32)
    spec = ob.QuantSpec("int8", strategy="token", dynamic=True)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj input: a fused MoE expert; only its weight"):
        runner.check({("model.layers.0.mlp.experts.0.gate_proj", "input"): TensorQuant(spec)})
    with pytest.raises(ValueError, match=r"experts\.9\.gate_proj: not a layer of the loaded model"):
        runner.check({("model.layers.0.mlp.experts.9.gate_proj", "weight"): TensorQuant(spec)})


def test_one_quantization_runs_a_fused_experts_module_once_and_puts_its_weights_back_whatever_happens(monkeypatch):
    """A single quantization of fused experts swaps the quantized weights in for the call: the experts
    module runs as often as without it (no second run per call), and its own parameters are back after
    a call that fails."""
    model = open_model("tiny-moe")
    runner = EffectRunner(model, samples=2, seq_len=16)
    spec = ob.QuantSpec("int4", strategy="group", group_size=16)
    layer = "model.layers.0.mlp.experts.1.up_proj"
    observer = ob.create("minmax", spec, kind="weight")
    observer.observe(model.weight(layer))
    experts_quant = {(layer, "weight"): TensorQuant(spec, observer.qparams())}
    q_proj = "model.layers.0.self_attn.q_proj"
    observer = ob.create("minmax", spec, kind="weight")
    observer.observe(model.weight(q_proj))
    attention_quant = {(q_proj, "weight"): TensorQuant(spec, observer.qparams())}
    experts = resolve_layer(model.module(), layer).module
    original, calls = type(experts).forward, []

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(experts), "forward", counted)
    runner.run(attention_quant, sqnr=False)
    plain = len(calls)
    calls.clear()
    runner.run(experts_quant, sqnr=False)
    assert len(calls) == plain > 0
    before = {name: p.detach().clone() for name, p in experts.named_parameters()}

    def failing(self, *args, **kwargs):
        raise RuntimeError("the experts failed")

    monkeypatch.setattr(type(experts), "forward", failing)
    with pytest.raises(RuntimeError, match="the experts failed"):
        runner.run(experts_quant, sqnr=False)
    assert all(torch.equal(p, before[name]) for name, p in experts.named_parameters())


def test_a_reduced_stacked_run_quantizes_each_variants_head_in_its_own_share_and_streams_the_head():
    """Variants that quantize the LM head, reduced a few windows at a time on a model streamed block
    by block: each variant's figures are its own run's (the float logits beside them made with no
    variant's head), and the head loaded for the run is freed once it is over."""
    from lab.effect.evaluate import Evaluator

    evaluator = Evaluator(open_model("tiny-llama"), samples=8, seq_len=32, sequential=True, max_memory=64 << 20)
    assert evaluator.runner.sequential
    variants = [
        {**v, **_variants(evaluator.model, "lm_head")[i]} for i, v in enumerate(_variants(evaluator.model, LLAMA_UP))
    ]
    found, _ = evaluator.stacked_metrics(variants)
    for mine, variant in zip(found, variants, strict=True):
        alone = evaluator.metrics(evaluator.runner.run(variant, sqnr=False))
        assert all(mine[k] == pytest.approx(alone[k], rel=1e-4, abs=1e-8) for k in mine)
    assert len({round(f["kl"], 9) for f in found}) == 3
    assert evaluator.runner._backend.loader.resident == 0
    # the float logits are made from the last hidden states when asked, the head loaded for them and let go
    float_logits = evaluator.runner.float_outputs[0]
    assert float_logits.shape[-1] == evaluator.model.config.vocab_size
    assert evaluator.runner._backend.loader.resident == 0
