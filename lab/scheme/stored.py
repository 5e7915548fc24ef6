"""What a quantization scheme is once stored: the one home of the rules the checkpoint writes by,
the allocation's cost counts by and the recipe refuses by.

- ``ct_args``: the compressed-tensors ``QuantizationArgs`` a spec is written with on a tensor, or why
  compressed-tensors cannot express it;
- ``expected_qparam_shape``: the shape of the scales a spec stores on a layer's weight, input, output,
  or an attention block's keys and values;
- ``packed_format``: the format compressed-tensors packs a config group's weights into;
- ``dense_reason`` / ``expert_dense_reason`` / ``ragged_groups``: what stays dense whatever
  compressed-tensors expresses, and why (what compressed-tensors, transformers' loader of packed
  experts and llm-compressor do not read).

What a server keeps one of for layers it fuses is ``lab.runtime.scales``'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import observers as ob
from lab.vocab import KV_TENSORS
from sample_models.layers import EXPERT_TYPE

# Element formats with a compressed-tensors equivalent: (type, num_bits). uint formats map onto
# CT's signed ints by shifting the zero point by 2^(bits-1), which is exact (same scale, same grid).
_CT_ELEMENTS: dict[str, tuple[str, int]] = {
    "int2": ("int", 2),
    "int3": ("int", 3),
    "int4": ("int", 4),
    "int8": ("int", 8),
    "uint4": ("int", 4),
    "uint8": ("int", 8),
    "fp8_e4m3": ("float", 8),
    "fp6_e2m3": ("float", 6),
    "fp4_e2m1": ("float", 4),
}
# Block formats: (num_bits, group_size, scale_dtype, strategy) as compressed-tensors' MX/NVFP4 presets.
_CT_BLOCKS: dict[str, tuple[int, int, str, str]] = {
    "mxfp4": (4, 32, "torch.uint8", "group"),
    "mxfp6_e2m3": (6, 32, "torch.uint8", "group"),
    "mxfp8_e4m3": (8, 32, "torch.uint8", "group"),
    "nvfp4": (4, 16, "torch.float8_e4m3fn", "tensor_group"),
}
_ACTIVATION_STRATEGIES = ("tensor", "group", "token")


def ct_args(spec: ob.QuantSpec, tensor: str) -> tuple[dict[str, Any] | None, list[str]]:
    """compressed-tensors ``QuantizationArgs`` fields for ``spec`` on a ``tensor`` kind, or
    ``(None, reasons)`` when that format cannot express it."""
    reasons = []
    fmt = spec.format
    block = _CT_BLOCKS.get(spec.dtype)
    element = _CT_ELEMENTS.get(spec.dtype)
    if block is None and element is None:
        if fmt.kind == "cast":
            reasons.append(f"dtype {spec.dtype} is a plain cast (a placeholder), not a compressed-tensors scheme")
        else:
            reasons.append(f"compressed-tensors has no {spec.dtype} element type")
    if spec.reduce_range:
        reasons.append("reduce_range has no compressed-tensors equivalent")
    if spec.has_custom_range:
        reasons.append("a custom quant_min/quant_max has no compressed-tensors equivalent")
    if fmt.kind == "int" and spec.symmetric and spec.scale_rule != "half_range":
        reasons.append(f"scale_rule {spec.scale_rule!r} differs from compressed-tensors' (max - min) / 2 divisor")
    kv = tensor in KV_TENSORS
    if spec.strategy == "channel" and not kv and (tensor != "weight" or spec.channel_axis("weight") != 0):
        reasons.append("compressed-tensors has channel scales for weight output channels (ch_axis 0) only")
    if tensor not in ("weight", *KV_TENSORS) and spec.strategy not in _ACTIVATION_STRATEGIES:
        reasons.append(f"compressed-tensors has no {spec.strategy} strategy for activations")
    if block is not None and spec.group_size != block[1]:
        reasons.append(f"{spec.dtype} with group size {spec.group_size} (compressed-tensors uses {block[1]})")
    if reasons:
        return None, reasons
    args: dict[str, Any] = {"symmetric": spec.symmetric, "dynamic": spec.dynamic}
    if block is not None:
        bits, group, scale_dtype, strategy = block
        args |= {"num_bits": bits, "type": "float", "strategy": strategy, "group_size": group}
        args["scale_dtype"] = scale_dtype
        args["zp_dtype"] = scale_dtype
        if spec.dynamic and strategy == "tensor_group":
            args["dynamic"] = "local"
        return args, reasons
    kind, bits = element
    strategy = "attn_head" if kv and spec.strategy == "channel" else spec.strategy
    args |= {"num_bits": bits, "type": kind, "strategy": strategy}
    if spec.strategy == "group":
        args["group_size"] = spec.group_size
    if spec.strategy == "block":
        args["block_structure"] = list(spec.block_size)
    if spec.strategy == "token" and not spec.dynamic:
        args["dynamic"] = True
        reasons.append("per-token scales are dynamic in compressed-tensors: written as dynamic, no scales saved")
    return args, reasons


def expected_qparam_shape(
    spec: ob.QuantSpec, tensor: str, weight_shape: tuple[int, ...], g_idx: torch.Tensor | None = None
) -> tuple[int, ...] | None:
    """The qparam shape ``spec`` gives on this layer's weight, input or output, or on an
    attention block's keys or values (``tensor`` ``k``/``v``, ``weight_shape`` then
    ``(kv_heads, head_dim)``); None when it depends on the calibration data (per-token).
    Computed on a meta tensor, so no memory is used."""
    if spec.strategy == "token":
        return None
    if tensor in KV_TENSORS:
        heads, head_dim = weight_shape
        shape, kind = (1, heads, 1, head_dim), "attention"
    elif tensor == "weight":
        shape, kind = weight_shape, "weight"
    else:
        width = weight_shape[1] if tensor == "input" else weight_shape[0]
        shape, kind = (1, width), "activation"
    probe = torch.empty(shape, device="meta")
    return tuple(ob.flatten(probe, spec, kind, g_idx=g_idx).qparam_shape)


def packed_format(scheme: Mapping[str, Any]) -> str:
    """The format compressed-tensors packs a ``Linear`` under a config group's ``scheme`` (its
    ``QuantizationScheme`` fields) into, as its compressor picks it: ``pack-quantized``,
    ``nvfp4-pack-quantized``, ``float-quantized``..."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationScheme

    return infer_module_format(torch.nn.Linear, QuantizationScheme(**scheme)).value


def dense_reason(spec: ob.QuantSpec, tensor: str, layer_type: str | None) -> str | None:
    """Why the checkpoint leaves a chosen tensor of a layer of ``layer_type`` dense whatever
    compressed-tensors can express (None: it packs it if it can); the cost of a scheme
    (``lab.scheme.cost``) reads the same rule."""
    if tensor == "weight" and spec.format.kind == "int" and not spec.symmetric:
        return (
            "stays dense, unquantized (compressed-tensors 0.20 packs asymmetric integer zero points "
            "when it saves, but does not expect them packed when it loads)"
        )
    if layer_type == EXPERT_TYPE:
        return expert_dense_reason(spec, tensor)
    if tensor not in KV_TENSORS and layer_type != "Linear":
        return f"stays dense (compressed-tensors compresses Linear layers, this is a {layer_type})"
    return None


def expert_dense_reason(spec: ob.QuantSpec, tensor: str) -> str | None:
    """Why transformers 5 could not load an expert's ``tensor`` packed in ``spec`` (None: it can).
    Its expert loader reads a packed weight with its scale and shape (symmetric int4/int8 weights,
    MXFP4) and nothing else that loads right (measured on tiny-moe): an NVFP4 weight loads without
    its global scale (wrong by that factor), FP8 weights fail to load, and activation scales are
    not read."""
    if tensor != "weight":
        return "stays dense (transformers' loader of packed experts reads weights, not activation scales)"
    if spec.format.kind == "int" and spec.format.bits in (4, 8) and spec.symmetric:
        return None
    if spec.dtype == "mxfp4":
        return None
    return f"stays dense (transformers' loader of packed experts reads int4/int8 or MXFP4 weights, not {spec.dtype})"


def ragged_groups(args: Mapping[str, Any] | None, columns: int) -> str | None:
    """Why weight ``args`` cannot be exported over ``columns`` columns: grouped scales over a column
    count the group size does not divide (the lab allows a ragged last group), which llm-compressor
    refuses when the modifier initializes. None when they can."""
    if args is None or args["strategy"] not in ("group", "tensor_group") or columns < args["group_size"]:
        return None
    if columns % args["group_size"] == 0:
        return None
    return f"{columns} columns are not a multiple of group size {args['group_size']}, which llm-compressor refuses"
