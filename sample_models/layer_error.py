"""Layer-output error: how much a quantized weight (and optionally a quantized input) changes a
layer's output on real captured activations.

Runs the layer functionally with the given tensors, never touching the loaded model, so it is safe
on a shared model and needs no module at all (weights come from the store).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import Model

LINEAR_LIKE = {"Linear", "Conv1D", "ExpertLinear"}


def layer_output_error(
    model: Model,
    name: str,
    inputs: torch.Tensor,
    quantized_weight: torch.Tensor,
    quantized_inputs: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> dict[str, float]:
    """Compare the layer's float output with its output under ``quantized_weight`` (and
    ``quantized_inputs`` if given), both on ``inputs`` of shape (tokens, in_features).
    ``weight``: the float weight that goes with ``inputs`` (default the layer's own; a rotated or
    smoothed model's weight with its transformed inputs, which give the same output).

    Computed in float32 so that the error measured is the quantization error, not low-precision
    matmul noise. Returns ``observers.metrics.compare_tensors`` (mse, sqnr_db, cosine,
    max_abs_error).
    """
    from observers.metrics import compare_tensors

    info = model.layer(name)
    if info.type not in LINEAR_LIKE:
        raise ValueError(f"layer-output error supports linear layers; {name!r} is {info.type}")
    if tuple(quantized_weight.shape) != info.shape:
        shape = tuple(quantized_weight.shape)
        raise ValueError(f"quantized weight for {name!r} has shape {shape}, expected {info.shape}")
    if inputs.ndim != 2 or inputs.shape[1] != info.shape[1]:
        raise ValueError(f"inputs for {name!r} must be (tokens, {info.shape[1]}), got {tuple(inputs.shape)}")
    if quantized_inputs is not None and quantized_inputs.shape != inputs.shape:
        raise ValueError(f"quantized inputs for {name!r} must match inputs {tuple(inputs.shape)}")
    x = inputs.float()
    bias = model.bias(name)
    bias = None if bias is None else bias.float().to(x.device)
    weight = model.weight(name) if weight is None else weight
    reference = F.linear(x, weight.float().to(x.device), bias)
    approx_x = x if quantized_inputs is None else quantized_inputs.float().to(x.device)
    approx = F.linear(approx_x, quantized_weight.float().to(x.device), bias)
    return compare_tensors(reference, approx)
