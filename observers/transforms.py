"""Ranges under transforms: the tensors a layer sees once the model is rotated or smoothed.

Rotating or smoothing a model changes what its layers' quantizers see while leaving the float
model's output alone, and it moves outliers: that is why QuaRot, SpinQuant and SmoothQuant exist.
These functions give the transformed weight and activations of one ``Linear`` layer (and of key /
value states), so every observer can be run on them beside the untransformed ones.

- **Hadamard rotation** of the input dimension (QuaRot / SpinQuant style): ``R = diag(signs) · H``
  with ``H`` a normalized Sylvester Hadamard matrix and random ``signs`` (a seed); the layer's
  inputs become ``x R`` and its weight ``W R`` (its columns), so ``(x R)(W R)ᵀ = x Wᵀ``. A size
  that is not a power of two is rotated block-diagonally: blocks of the largest power of two that
  divides it (an odd size has blocks of 1, i.e. only the sign flips; ``hadamard_block`` says so).
  Key and value states are rotated per head along ``head_dim`` (the query, and the output
  projection's input, take the same rotation in a rotated model, so attention is unchanged).
- **SmoothQuant** migration: per input channel ``s_j = max|x_j|^α / max|W_j|^(1-α)``; the inputs
  become ``x / s`` and the weight's columns ``W · s``, so the product is unchanged; ``α``
  (``alpha``) moves difficulty from activations (α → 1) to weights (α → 0). The scales come from
  the captured inputs, as SmoothQuant's calibration does. It has no meaning for KV states.

Everything is one tensor op per step (the block-diagonal rotation is a batched matmul), in fp32,
on the tensors' device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from observers.shared import Op, Reduce

SMOOTH_FLOOR = 1e-5
"""Smallest channel max used in the SmoothQuant ratio (SmoothQuant clamps the same way), so an
all-zero channel gets a finite scale."""


class TransformKind(StrEnum):
    """The transforms a run can look through."""

    HADAMARD = "hadamard"
    SMOOTHQUANT = "smoothquant"


@dataclass(frozen=True)
class TransformSpec:
    """One validated, serializable transform: ``kind``, the Hadamard sign ``seed``, SmoothQuant's
    ``alpha`` (migration strength, in [0, 1])."""

    kind: str
    seed: int = 0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        kinds = [member.value for member in TransformKind]
        if self.kind not in kinds:
            raise ValueError(f"transform {self.kind!r} is not known; allowed: {', '.join(kinds)}")
        object.__setattr__(self, "kind", TransformKind(self.kind).value)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"transform seed must be a non-negative integer, got {self.seed!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"SmoothQuant alpha must be a number in [0, 1], got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformSpec:
        unknown = set(data) - {"kind", "seed", "alpha"}
        if unknown:
            raise ValueError(f"unknown transform field(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    def label(self) -> str:
        """How plots and tables name it."""
        if self.kind == TransformKind.HADAMARD:
            return f"Hadamard rotation (seed {self.seed})"
        return f"SmoothQuant (alpha {self.alpha:g})"


def hadamard_block(size: int) -> int:
    """The block of the block-diagonal rotation of ``size`` features: the largest power of two
    dividing it (``size`` itself for powers of two, 1 for odd sizes)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"a rotation needs a positive feature size, got {size!r}")
    return size & -size


def sylvester_hadamard(block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``block x block`` Hadamard matrix (``block`` a power of two), normalized to be orthogonal."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {block}")
    matrix = torch.ones(1, 1, device=device)
    while matrix.shape[0] < block:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(block)


def random_signs(size: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``size`` random ±1 from ``seed`` (drawn on the CPU, so every device gets the same)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (size,), generator=generator) * 2 - 1).float().to(device)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x R`` along the last dimension: random signs, then the block-diagonal Hadamard rotation."""
    size = x.shape[-1]
    block = hadamard_block(size)
    signed = x.float() * random_signs(size, seed, x.device)
    blocks = signed.reshape(*x.shape[:-1], size // block, block)
    return (blocks @ sylvester_hadamard(block, x.device)).reshape(x.shape)


def smoothing_scales(
    inputs: torch.Tensor, weight: torch.Tensor, alpha: float, across: Reduce | None = None
) -> torch.Tensor:
    """SmoothQuant's per-input-channel ``s = max|x|^α / max|W|^(1-α)`` from captured ``inputs``
    ``(tokens, in)`` and the ``(out, in)`` weight; ``across``: ``inputs`` is one rank's part
    (``observers.shared``), and ``max|x|`` is taken over every rank's."""
    if inputs.shape[-1] != weight.shape[-1]:
        raise ValueError(f"inputs have {inputs.shape[-1]} features but the weight has {weight.shape[-1]} columns")
    rows = inputs.reshape(-1, inputs.shape[-1]).float().abs()
    act = rows.amax(dim=0) if rows.shape[0] else torch.zeros(rows.shape[1], device=rows.device)
    if across is not None:
        act = across(act, Op.MAX)
    if not bool((act > 0).any()):
        raise ValueError("SmoothQuant needs captured inputs to compute its scales; none were captured")
    act = act.clamp(min=SMOOTH_FLOOR)
    wgt = weight.float().abs().amax(dim=0).clamp(min=SMOOTH_FLOOR)
    return (act.pow(alpha) / wgt.pow(1 - alpha)).clamp(min=SMOOTH_FLOOR)


def transform_layer(
    spec: TransformSpec, weight: torch.Tensor | None, inputs: torch.Tensor | None, across: Reduce | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and inputs of a ``Linear`` layer as the transformed model's layer sees them (either
    may be None when not analysed; SmoothQuant needs both to find its scales)."""
    if spec.kind == TransformKind.HADAMARD:
        turn = lambda t: None if t is None else rotate(t, spec.seed)  # noqa: E731
        return turn(weight), turn(inputs)
    if weight is None or inputs is None:
        raise ValueError("SmoothQuant needs the layer's weight and its captured inputs")
    scales = smoothing_scales(inputs, weight, spec.alpha, across)
    return weight.float() * scales, inputs.float() / scales


def transform_states(spec: TransformSpec, states: torch.Tensor) -> torch.Tensor:
    """Key or value states ``(batch, heads, tokens, head_dim)`` in the transformed model."""
    if spec.kind != TransformKind.HADAMARD:
        raise ValueError("SmoothQuant applies to a Linear layer's inputs and weight, not to key/value states")
    return rotate(states, spec.seed)
