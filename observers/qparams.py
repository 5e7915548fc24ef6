"""Quantization parameters, and the rules that turn a chosen range ``(min, max)`` into them.

The rules follow section 2 of the reference doc, where torch.ao, compressed-tensors and Quark
agree: zero is always inside the range; symmetric scales divide ``amax`` by half the integer
range (or by ``qmax``, ModelOpt's rule, or by the float format's max); asymmetric zero points are
``qmin - round(min / scale)``, clamped; scales are at least ``spec.eps`` so a constant or
all-zero tensor still gives a finite positive scale.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from observers.granularity import all_finite
from observers.spec import QuantSpec

_DTYPES = {
    "float32": torch.float32,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "int64": torch.int64,
    "bool": torch.bool,
}


DATA_LIMIT = 4096
"""Elements up to which a serialized tensor also carries its values as a readable list; a bigger
one (a large model's group scales: millions) carries its bytes only, which read back faster and
take an eighth of the memory a list of floats takes once parsed."""


def tensor_to_dict(t: torch.Tensor) -> dict[str, Any]:
    """JSON-safe, lossless form of a tensor: shape, dtype, its raw little-endian bytes in base64,
    and, up to ``DATA_LIMIT`` elements, its values as a list a person can read (Python floats: an
    fp32 value converts to a double exactly and a JSON double reads back exactly)."""
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot serialize tensor of dtype {t.dtype}; supported: {', '.join(_DTYPES)}")
    record: dict[str, Any] = {"shape": list(t.shape), "dtype": name}
    if t.numel() <= DATA_LIMIT:
        record["data"] = t.flatten().tolist()
    record["bytes_b64"] = base64.b64encode(t.numpy().tobytes()).decode("ascii")
    return record


def tensor_from_dict(d: dict[str, Any]) -> torch.Tensor:
    """Inverse of ``tensor_to_dict``, from the bytes (checked against the values when both are
    there) or the values; clear errors for a missing field, a corrupt field or a shape mismatch."""
    missing = {"shape", "dtype"} - set(d)
    if missing or not {"data", "bytes_b64"} & set(d):
        lacking = sorted(missing) or ["data or bytes_b64"]
        raise ValueError(f"serialized tensor lacks field(s): {', '.join(lacking)}")
    if d["dtype"] not in _DTYPES:
        raise ValueError(f"serialized tensor has unknown dtype {d['dtype']!r}; allowed: {', '.join(_DTYPES)}")
    dtype = _DTYPES[d["dtype"]]
    t = None
    if "data" in d:
        try:
            t = torch.tensor(d["data"], dtype=dtype).flatten()
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise ValueError(f"serialized tensor data must be a flat list of {d['dtype']} values") from None
    if "bytes_b64" in d:
        try:
            raw = base64.b64decode(d["bytes_b64"], validate=True)
            from_bytes = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError("serialized tensor bytes_b64 is not base64 of whole values of its dtype") from None
        if t is not None and t.numpy().tobytes() != raw:
            raise ValueError("serialized tensor data and bytes_b64 disagree")
        t = from_bytes
    expected = 1
    for size in d["shape"]:
        expected *= size
    if t.numel() != expected:
        raise ValueError(f"serialized tensor has {t.numel()} values but shape {d['shape']} needs {expected}")
    return t.reshape(d["shape"])


@dataclass
class QParams:
    """The result of an observer.

    ``scale`` and ``zero_point`` have the qparam shape of the spec's strategy (see
    ``observers.granularity``); ``min_val``/``max_val`` are the chosen range, same shape;
    ``global_scale`` is a one-element fp32 tensor for formats that have one (NVFP4), else None.
    ``extras`` holds format-specific codes that exports need (e.g. MX exponent codes) and the
    ``g_idx`` of activation-ordered groups. ``kind`` (weight, activation, attention) says how the
    qparam shape maps onto the tensor.
    For NVFP4 the scale that multiplies an element is ``scale / global_scale``.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor
    global_scale: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    kind: str = "weight"

    @property
    def effective_scale(self) -> torch.Tensor:
        """The step size applied to elements (``scale``, divided by ``global_scale`` if any)."""
        if self.global_scale is None:
            return self.scale
        return self.scale / self.global_scale

    def to(self, device: torch.device | str) -> QParams:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QParams(
            move(self.scale),
            move(self.zero_point),
            move(self.min_val),
            move(self.max_val),
            move(self.global_scale),
            {k: move(v) for k, v in self.extras.items()},
            self.kind,
        )

    def same_grid(self, other: QParams) -> bool:
        """Whether ``other`` sets the same grid: scale, zero point, range and global scale equal
        tensor for tensor (``extras``, derived from them or from the run, are not compared)."""
        if (self.global_scale is None) != (other.global_scale is None):
            return False
        pairs = [(self.scale, other.scale), (self.zero_point, other.zero_point)]
        pairs += [(self.min_val, other.min_val), (self.max_val, other.max_val)]
        if self.global_scale is not None:
            pairs.append((self.global_scale, other.global_scale))
        return all(torch.equal(x, y) for x, y in pairs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; ``from_dict`` restores bit-identical tensors."""
        return {
            "scale": tensor_to_dict(self.scale),
            "zero_point": tensor_to_dict(self.zero_point),
            "min_val": tensor_to_dict(self.min_val),
            "max_val": tensor_to_dict(self.max_val),
            "global_scale": None if self.global_scale is None else tensor_to_dict(self.global_scale),
            "extras": {k: tensor_to_dict(v) for k, v in self.extras.items()},
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QParams:
        missing = {"scale", "zero_point", "min_val", "max_val"} - set(d)
        if missing:
            raise ValueError(f"QParams dict lacks field(s): {', '.join(sorted(missing))}")
        global_scale = d.get("global_scale")
        return cls(
            tensor_from_dict(d["scale"]),
            tensor_from_dict(d["zero_point"]),
            tensor_from_dict(d["min_val"]),
            tensor_from_dict(d["max_val"]),
            None if global_scale is None else tensor_from_dict(global_scale),
            {k: tensor_from_dict(v) for k, v in d.get("extras", {}).items()},
            d.get("kind", "weight"),
        )


def exact_divisor(value: float, like: torch.Tensor) -> float | torch.Tensor:
    """``value`` as the divisor of a division of ``like`` that is rounded as IEEE division on every
    device: torch on CUDA turns ``tensor / number`` into a multiplication by the number's
    reciprocal, which for divisors like 448, 127.5 or 6 lands one ulp from the quotient in about
    half the scales, so the same observer gave CPU and GPU runs different qparams. A 0-dim tensor
    on the device divides exactly; on CPU the number already does."""
    if like.device.type == "cpu":
        return value
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _free_scale(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """fp32 scale for integer and float elements (the section-2 rules).

    Written to allocate as few qparam-sized temporaries as possible (each fresh one costs page
    faults that, for the (4096, 32) qparams of a group-128 weight, add up to a sizeable share of
    the whole observer): ``max(-min, max)`` already contains zero when ``min <= max``, so the
    symmetric rules need no clamps, and the arithmetic runs in place on the one new tensor.
    """
    fmt = spec.format
    qmin, qmax = spec.int_range if fmt.kind == "int" else (0, 0)
    if fmt.kind == "float" or spec.symmetric:
        scale = torch.neg(min_val)
        torch.maximum(scale, max_val, out=scale)
        if fmt.kind == "float":
            divisor = fmt.max_value
        else:
            divisor = (qmax - qmin) / 2 if spec.scale_rule == "half_range" else float(qmax)
        scale.div_(exact_divisor(divisor, scale)).clamp_(min=spec.eps)
        if fmt.kind == "float" or fmt.signed:
            middle = 0
        elif spec.has_custom_range:
            middle = (qmin + qmax) // 2
        else:
            middle = 2 ** (fmt.bits - 1)
        return QParams(scale, torch.full_like(scale, middle, dtype=torch.int32), min_val, max_val)
    min_neg = torch.clamp(min_val, max=0.0)
    scale = torch.clamp(max_val, min=0.0).sub_(min_neg)
    scale.div_(exact_divisor(float(qmax - qmin), scale)).clamp_(min=spec.eps)
    zero_point = min_neg.div_(scale).round_().neg_().add_(qmin).clamp_(qmin, qmax).to(torch.int32)
    return QParams(scale, zero_point, min_val, max_val)


SCALE_RULES: dict[str, Callable[[torch.Tensor, torch.Tensor, QuantSpec], QParams]] = {"float": _free_scale}
"""Range -> qparams rule for each ``ElementFormat.scale_kind``; block formats register theirs."""


def calculate_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """QParams for the chosen range ``[min_val, max_val]`` (fp32 tensors in the qparam shape)."""
    min_val = min_val.float()
    max_val = max_val.float()
    if not (all_finite(min_val) and all_finite(max_val)):
        raise ValueError("the range given to calculate_qparams is not finite; observe finite data first")
    return range_rule(min_val, max_val, spec)


def range_rule(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """``calculate_qparams`` without its finiteness check, for the candidate ranges a search derives
    from a range it has checked (on a GPU each check is a host sync, one per chunk of candidates)."""
    return SCALE_RULES[spec.format.scale_kind](min_val.float(), max_val.float(), spec)


def representable_range(qp: QParams, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: where the format clips, per group (fp32 tensors in the qparam shape).

    ``min_val``/``max_val`` are the range an observer *chose*; the values that survive
    quantization unclipped are the grid's ends, and the two differ: the ``half_range`` rule puts
    ``-128·s`` below the chosen min, a rounded MX exponent moves ``6·2^e`` off the block's amax, a
    search observer's range is rarely on a grid point. An integer element covers
    ``[(qmin - zp)·s, (qmax - zp)·s]``, a float element ``±max_value·s`` (``s`` the effective
    scale: NVFP4 divides by the global scale, MXINT8/BFP16 store the code step), a plain cast
    (fp16/bf16) ± the cast type's largest finite value. The same ends that ``clip_ratio`` counts
    against, so a plot of these lines and the clipped share agree.
    """
    fmt = spec.format
    if fmt.kind == "cast":
        hi = torch.full(qp.scale.shape, fmt.max_value, dtype=torch.float32, device=qp.scale.device)
        return -hi, hi
    scale = qp.effective_scale.float()
    if fmt.kind == "int":
        qmin, qmax = spec.int_range
        zero_point = qp.zero_point.float()
        return (qmin - zero_point) * scale, (qmax - zero_point) * scale
    hi = scale * fmt.max_value
    return -hi, hi
