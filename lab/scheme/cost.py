"""What a layer costs under a scheme: the bytes the packed checkpoint (``lab.export.checkpoint``,
compressed-tensors' compressors) stores for its weight and the scales around it, so that a budget in
bits per weight or in gigabytes is the real checkpoint's size.

A quantized ``Linear`` weight is stored in the format compressed-tensors picks for its scheme
(``stored.packed_format``): ``pack-quantized`` packs ``32 // bits`` integer codes into each int32 of a
row, the FP4 formats two codes a byte, 8-bit formats one byte a code; its scales are float32 (as the
lab writes them) or the block format's own 1-byte scale (NVFP4's E4M3, MX's E8M0); NVFP4 adds a
float32 global scale; every packed weight carries its int64 ``(rows, columns)`` shape. A static
input scale adds its float32 values, NVFP4's dynamic input its global scale. What the checkpoint
leaves dense (a setting compressed-tensors cannot express, an asymmetric integer weight, a layer
that is not ``Linear``: ``stored.dense_reason``) costs its dense bytes. The bias is stored as it
is under every scheme and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import observers as ob
from lab.scheme.stored import ct_args, dense_reason, expected_qparam_shape, packed_format, ragged_groups

SHAPE_BYTES = 16
"""A packed weight's ``weight_shape``: two int64."""
FLOAT32_BYTES = 4
_ONE_BYTE_SCALES = ("torch.uint8", "torch.float8_e4m3fn")


def weight_bytes(
    spec: ob.QuantSpec | None,
    shape: tuple[int, int],
    dense_element_bytes: int,
    layer_type: str = "Linear",
    input_spec: ob.QuantSpec | None = None,
) -> int:
    """Bytes the checkpoint stores for a ``(rows, columns)`` weight under ``spec`` (None: kept in
    its dtype, ``dense_element_bytes`` a value) and, with ``input_spec``, its input's scales."""
    rows, columns = shape
    inputs = _input_bytes(input_spec, shape) if layer_type == "Linear" else 0
    dense = rows * columns * dense_element_bytes + inputs
    if spec is None or why_dense(spec, shape, layer_type) is not None:
        return dense
    args, _ = ct_args(spec, "weight")
    total = _element_bytes(args, rows, columns) + SHAPE_BYTES + inputs
    scales = math.prod(expected_qparam_shape(spec, "weight", shape) or (1,))
    total += scales * (1 if args.get("scale_dtype") in _ONE_BYTE_SCALES else FLOAT32_BYTES)
    if args["strategy"] == "tensor_group":
        total += FLOAT32_BYTES  # NVFP4's global scale
    return total


def why_dense(spec: ob.QuantSpec, shape: tuple[int, int], layer_type: str = "Linear") -> str | None:
    """Why the checkpoint would keep a ``(rows, columns)`` weight dense under ``spec`` (None: it
    packs it): ``stored.dense_reason``, a spec compressed-tensors cannot express, ragged groups."""
    reason = dense_reason(spec, "weight", layer_type)
    if reason is not None:
        return reason
    args, notes = ct_args(spec, "weight")
    if args is None:
        return "; ".join(notes) or "compressed-tensors cannot express it"
    return ragged_groups(args, shape[1])


def bits_per_weight(spec: ob.QuantSpec | None, shape: tuple[int, int], dense_element_bytes: int) -> float:
    """``weight_bytes`` of one weight as bits per weight (NVFP4 on a 4096 × 4096 weight: 4.5)."""
    return 8 * weight_bytes(spec, shape, dense_element_bytes) / (shape[0] * shape[1])


def _element_bytes(args: dict, rows: int, columns: int) -> int:
    """The codes as the format compressed-tensors picks for these args stores them."""
    weights = {k: v for k, v in args.items() if k not in ("scale_dtype", "zp_dtype")}
    stored = packed_format({"targets": ["Linear"], "weights": weights})
    bits = args["num_bits"]
    if stored == "pack-quantized":
        return rows * math.ceil(columns / (32 // bits)) * 4
    if stored in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return rows * math.ceil(columns / 2)
    if bits == 8:
        return rows * columns
    raise ValueError(f"no cost rule for {bits}-bit codes stored as {stored!r}")


def _input_bytes(spec: ob.QuantSpec | None, shape: tuple[int, int]) -> int:
    """A static input scale's float32 values, or NVFP4's dynamic input global scale."""
    if spec is None:
        return 0
    args, _ = ct_args(spec, "input")
    if args is None:
        return 0
    if args["strategy"] == "tensor_group":
        return FLOAT32_BYTES
    if args["dynamic"]:
        return 0
    return FLOAT32_BYTES * math.prod(expected_qparam_shape(spec, "input", shape) or (1,))


@dataclass(frozen=True)
class LayerSizes:
    """The chosen layers as the budget sees them: each one's shape, type and stored element size,
    and ``rest_bytes``, what the checkpoint stores beside their weights (embeddings, norms, biases,
    the layers not chosen), copied as it is."""

    shapes: dict[str, tuple[int, int]]
    types: dict[str, str]
    element_bytes: dict[str, int]
    rest_bytes: int

    @classmethod
    def of(cls, model: Any, layers: Sequence[str]) -> LayerSizes:
        """From the sizes of the model's stored tensors (its files' headers: no tensor is read)."""
        infos = {info.name: info for info in model.layers()}
        shapes = {layer: tuple(infos[layer].shape[:2]) for layer in layers}
        types = {layer: infos[layer].type for layer in layers}
        chosen = {f"{layer}.weight": layer for layer in layers}
        element_bytes, rest = {}, 0
        for key in model.stored_keys():
            size = model.stored_bytes(key)
            if key in chosen:
                rows, columns = shapes[chosen[key]]
                element_bytes[chosen[key]] = size // (rows * columns)
            else:
                rest += size
        missing = [layer for layer in layers if layer not in element_bytes]
        if missing:
            raise ValueError(f"no stored weight for {', '.join(missing)}: cannot size them")
        return cls(shapes, types, element_bytes, rest)

    @property
    def weights(self) -> int:
        """Weight elements of the chosen layers: what bits per weight are averaged over."""
        return sum(rows * columns for rows, columns in self.shapes.values())

    def why_dense(self, layer: str, spec: ob.QuantSpec) -> str | None:
        """Why the checkpoint would keep ``layer`` dense under ``spec`` (None: it packs it)."""
        return why_dense(spec, self.shapes[layer], self.types[layer])

    def layer_bytes(self, layer: str, spec: ob.QuantSpec | None, input_spec: ob.QuantSpec | None = None) -> int:
        return weight_bytes(spec, self.shapes[layer], self.element_bytes[layer], self.types[layer], input_spec)

    def scheme_bits(self, spec: ob.QuantSpec | None, input_spec: ob.QuantSpec | None, layers: Sequence[str]) -> float:
        """Average bits per weight a scheme takes on ``layers`` (the figure each scheme is quoted by)."""
        total = sum(self.layer_bytes(layer, spec, input_spec) for layer in layers)
        return 8 * total / sum(self.shapes[layer][0] * self.shapes[layer][1] for layer in layers)

    def bits_per_weight(self, layer_bytes: int) -> float:
        """Bytes of the chosen layers as average bits per weight over them."""
        return 8 * layer_bytes / self.weights

    def checkpoint_bytes(self, layer_bytes: int) -> int:
        """The whole checkpoint's tensor bytes with the chosen layers taking ``layer_bytes``."""
        return self.rest_bytes + layer_bytes
