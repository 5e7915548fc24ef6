"""One layer's tensors as compressed-tensors packs them: the lab's fake-quantized weight (or its
GPTQ weight) handed to the compressor of the layer's config group, with every chosen scale. The
compressor quantizes the fake-quantized weight again with the same scales, which gives back the
lab's own codes, so a dequantized load equals the lab's weight bit for bit."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import observers as ob
from lab.export.compressed_tensors import CT_ARG_NAMES, CtLayer, ct_tensors, ct_zero_point
from lab.gptq.deploy import GPTQDeploy

CHUNK_ELEMENTS = 4 << 20
"""Weight elements packed at once: a bigger weight (a head, an embedding-sized layer) is packed a
slice of rows at a time, so the fp32 copies fake-quantization and packing make stay small."""


def compress_layer(
    layer: CtLayer,
    scheme: dict[str, Any],
    weight: torch.Tensor | None,
    gptq: GPTQDeploy | None = None,
    input_scales: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The layer's tensors under local names: the weight packed by the compressor of the group's
    format (from the lab's fake-quantized weight, or its GPTQ weight: on inputs AWQ divided by
    ``input_scales`` when AWQ ran first), and every chosen scale."""
    args = {kind: scheme[CT_ARG_NAMES[kind]] for kind in layer.args}
    prefix = f"{layer.layer}."
    state = {name.removeprefix(prefix): value for name, value in ct_tensors(layer, args).items()}
    if weight is None or "weight" not in layer.args:
        return state
    entry = layer.entries["weight"]
    qparams = entry.qparams
    if gptq is not None:
        weight, qparams = gptq.apply(entry, weight, input_scales)
    qparams = qparams.to("cpu")
    rows = weight.shape[0]
    per_row = entry.spec.strategy != "block" and qparams.scale.dim() >= 1 and qparams.scale.shape[0] == rows > 1
    step = max(1, CHUNK_ELEMENTS // max(1, weight[0].numel())) if per_row else rows
    pieces = [
        _compress_rows(weight[start : start + step], _row_slice(qparams, start, step, per_row), entry, scheme)
        for start in range(0, rows, step)
    ]
    stacked = {"weight_packed", "weight"} | ({"weight_scale", "weight_zero_point"} if per_row else set())
    for name in pieces[0]:
        parts = [piece[name] for piece in pieces]
        state[name] = torch.cat(parts) if name in stacked and len(parts) > 1 else parts[0]
    state["weight_shape"] = torch.tensor(weight.shape)
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _row_slice(qparams: ob.QParams, start: int, count: int, per_row: bool) -> ob.QParams:
    """The qparams of weight rows ``start`` to ``start + count`` (all of them when not per row)."""
    if not per_row:
        return qparams
    rows = qparams.scale.shape[0]

    def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or tensor.dim() == 0 or tensor.shape[0] != rows:
            return tensor
        return tensor[start : start + count]

    extras = {name: part(value) for name, value in qparams.extras.items()}
    fields = {name: part(getattr(qparams, name)) for name in ("scale", "zero_point", "min_val", "max_val")}
    return replace(qparams, extras=extras, **fields)


def _compress_rows(
    weight: torch.Tensor, qparams: ob.QParams, entry: Any, scheme: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Some rows of a weight, fake-quantized by the lab and packed by compressed-tensors' compressor
    of the group's format: a big weight (a head) is packed a slice at a time, never whole in fp32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    args = scheme[CT_ARG_NAMES["weight"]]
    state = {"weight": ob.fake_quantize(weight.float(), qparams, entry.spec)}
    # Every compressor takes the scale as a float; the block formats' store it in their own form
    # (E8M0 exponents, FP8) themselves.
    state["weight_scale"] = qparams.scale.float()
    if qparams.global_scale is not None:
        state["weight_global_scale"] = qparams.global_scale.float().reshape(1)
    if not args["symmetric"]:
        state["weight_zero_point"] = ct_zero_point(qparams, entry.spec, args["num_bits"])
    compressor = BaseCompressor.get_value_from_registry(scheme["format"])
    return compressor.compress(state, QuantizationScheme(**scheme))
