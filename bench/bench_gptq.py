"""GPTQ's sweep (issue 33) against llm-compressor 0.14's ``quantize_weight``, in this process on
the same weight, Hessian and observer scales: MiniLM's FFN shapes (384 → 1536 and 1536 → 384),
int4 symmetric in groups of 128, the scales of ``memoryless_minmax`` fixed before the sweep (as
``GPTQModifier`` does), positional column order, block 128, dampening 0.01. The inputs are
correlated synthetic activations (2048 tokens), so the error feedback matters. The agreement
column says how many codes are the same; the row's time is one observer's sweep."""

from __future__ import annotations

import torch

import observers as ob
from bench.common import case, interleaved_medians, reference

SPEC = ob.QuantSpec(dtype="int4", strategy="group", group_size=128)
SHAPES = {"FFN up 1536x384": (1536, 384), "FFN down 384x1536": (384, 1536)}


def _inputs(columns: int, tokens: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight-like matrix's Hessian ``2/n XᵀX`` of correlated inputs, and the generator for the weight."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(columns, columns, generator=generator) / columns**0.5
    x = torch.randn(tokens, columns, generator=generator) @ (torch.eye(columns) + mixing)
    return 2 * x.T @ x / tokens, generator


def cases(device: str) -> list[dict]:
    gptq = reference("llmcompressor.modifiers.gptq.gptq_quantize")
    args = reference("compressed_tensors.quantization")
    return [_case(name, shape, device, gptq, args) for name, shape in SHAPES.items()]


def _case(name: str, shape: tuple[int, int], device: str, gptq, args) -> dict:
    out_features, in_features = shape
    hessian, generator = _inputs(in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(device)
    hessian = hessian.to(device)
    qparams = ob.run_one("memoryless_minmax", weight, SPEC, "weight").qparams
    label = f"gptq sweep int4 g128 fixed scales, {name}"
    if isinstance(gptq, str) or isinstance(args, str):
        return case(label, 0.0, agreement=gptq if isinstance(gptq, str) else args)
    quant_args = args.QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)

    def ours() -> torch.Tensor:
        return ob.gptq_quantize(weight, hessian, SPEC, lambda w: qparams, actorder="none").weight

    def theirs() -> torch.Tensor:
        stacked = (weight.unsqueeze(0).clone(), hessian.unsqueeze(0).clone())
        found = gptq.quantize_weight(
            *stacked, qparams.scale.unsqueeze(0), qparams.zero_point.unsqueeze(0), None, quant_args, 128, 0.01
        )
        return found[0][0].to(weight.dtype)

    times = interleaved_medians({"ours": ours, "theirs": theirs}, device)
    same = float((ob.quantize(ours(), qparams, SPEC) == ob.quantize(theirs(), qparams, SPEC)).float().mean())
    return case(
        label,
        times["ours"],
        times["theirs"],
        "llm-compressor quantize_weight",
        agreement=f"{same:.4%} of codes equal (the same scales)",
    )
