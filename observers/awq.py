"""AWQ's core (issue 41): the smoothing scales a grid search tries, the clip ratios a clip search
tries, and how a search picks, as pure tensor functions a stage feeds with a layer's statistics.

AWQ protects the input channels that carry large activations: a balance layer's weight columns
are multiplied by ``s`` and its input divided by ``s`` (folded into the norm or linear before it),
so ``Q(W·s)·(x/s)`` replaces ``Q(W)·x``. llm-compressor 0.14's ``AWQModifier`` tries ``n_grid``
strengths ``r`` of ``s = x̄^r / (w̄^(1-r) + 1e-4)`` (``duo_scaling``; ``x̄`` the mean absolute
input per channel, ``w̄`` the mean of each group's weights normalised by the group's max), each
normalised to ``max·min = 1``, and keeps the one whose quantized parent module output is nearest
the float one. ``candidate_scales`` gives every candidate at once as rows, in llm-compressor's
order and arithmetic (float64 where its weight means are float64), so a search that picks the
first strict minimum in that order picks what llm-compressor picks.

ModelOpt's ``awq_clip`` then shrinks each group's range by a ratio in ``[clip_min, 1)`` stepped by
``clip_step`` (and 1), keeping per group the ratio whose part of the layer's output is nearest:
``group_output_errors`` is that part for every group at once, ``dᵀ H_g d`` with ``H_g`` the
group's block of the input's second moment. ``AWQSpec`` holds the knobs, declared once
(``AWQ_KNOBS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from observers import clip_kernel
from observers.knobs import Knob
from observers.qparams import QParams, range_rule
from observers.quantize import fake_quantize
from observers.spec import QuantSpec

DUO_SCALING = ("on", "off", "both")
"""llm-compressor's ``duo_scaling`` True / False / ``"both"`` (half the grid each way)."""

AWQ_KNOBS: dict[str, Knob] = {
    "n_grid": Knob(
        20, int, low=3, high=1000, doc="Smoothing strengths the scale search tries (llm-compressor's n_grid)"
    ),
    "duo_scaling": Knob(
        "on",
        str,
        choices=DUO_SCALING,
        doc="Scales from activations and weights (on), activations only (off), or half the grid each (both)",
    ),
    "clip_min": Knob(
        0.5, float, low=0.05, high=1.0, high_open=True, doc="Smallest share of a group's range the clip search tries"
    ),
    "clip_step": Knob(0.05, float, low=0.01, high=0.5, doc="Step between the shares the clip search tries"),
}
"""AWQ's knobs, declared once: the CLI flags, the app's widgets and ``AWQSpec`` read them."""

SCALE_FLOOR = 1e-4
"""llm-compressor's floor of a candidate scale and its term added to the weight means."""


@dataclass(frozen=True)
class AWQSpec:
    """How a run searches AWQ's scales and clips: llm-compressor 0.14's defaults for the scale
    grid, ModelOpt 0.47's ``awq_clip`` defaults for the clip ratios. Validated once, serializable
    like ``QuantSpec``."""

    n_grid: int = AWQ_KNOBS["n_grid"].default
    duo_scaling: str = AWQ_KNOBS["duo_scaling"].default
    clip_min: float = AWQ_KNOBS["clip_min"].default
    clip_step: float = AWQ_KNOBS["clip_step"].default

    def __post_init__(self) -> None:
        for name, knob in AWQ_KNOBS.items():
            object.__setattr__(self, name, knob.coerce(f"awq {name}", getattr(self, name)))
        if self.duo_scaling == "both" and self.n_grid < 4:
            raise ValueError(
                f"awq duo_scaling 'both' tries half of n_grid each way and needs n_grid >= 4, got {self.n_grid}"
            )

    def grid(self) -> list[tuple[float, bool]]:
        """``(ratio, duo)`` per candidate, in llm-compressor's order (``_get_grid_search_params``):
        with duo scaling on, the identity ``(0, off)`` first and ``n_grid - 1`` duo strengths."""
        if self.duo_scaling == "both":
            half = self.n_grid // 2
            return [(i / (half - 1), duo) for i in range(half) for duo in (False, True)]
        if self.duo_scaling == "off":
            return [(i / (self.n_grid - 1), False) for i in range(self.n_grid)]
        return [(0.0, False)] + [(i / (self.n_grid - 2), True) for i in range(self.n_grid - 1)]

    def clip_ratios(self) -> list[float]:
        """The shares of a group's range the clip search tries, ModelOpt's ``awq_clip`` list:
        ``clip_min`` up to (not including) 1 by ``clip_step``, rounded to two places, then 1."""
        steps = torch.arange(self.clip_min, 1.0, self.clip_step)
        ratios = [round(float(k), 2) for k in steps if round(float(k), 2) < 1.0]
        return list(dict.fromkeys(ratios)) + [1.0]

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in AWQ_KNOBS}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> AWQSpec:
        unknown = set(data) - set(AWQ_KNOBS)
        if unknown:
            raise ValueError(f"unknown AWQ setting(s) {sorted(unknown)}; allowed: {', '.join(AWQ_KNOBS)}")
        return cls(**data)


def _chunk_size(weight: torch.Tensor, spec: QuantSpec) -> int:
    """How many weights one scale covers, along a row (what ``weight_means`` normalises over)."""
    if spec.strategy == "tensor":
        return weight.numel()
    if spec.strategy == "channel":
        return weight.shape[1]
    if spec.strategy == "group":
        if weight.shape[1] % spec.group_size:
            raise ValueError(
                f"AWQ's weight means need the group size {spec.group_size} to divide the {weight.shape[1]} "
                "input columns of every balance layer"
            )
        return spec.group_size
    raise ValueError(f"AWQ smooths group, channel or tensor weight scales, not {spec.strategy!r}")


def weight_means(weights: Sequence[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """``w̄``: per input column, the mean over the balance layers' rows of ``|w| / (max|w| of its
    group + 1e-6)``, in float64 as llm-compressor 0.14 sums it (``_compute_layer_means``)."""
    if not weights:
        raise ValueError("AWQ needs at least one balance layer")
    columns = {w.shape[1] for w in weights}
    if len(columns) != 1:
        raise ValueError(f"balance layers of one mapping take the same input, got widths {sorted(columns)}")
    total = torch.zeros(columns.pop(), dtype=torch.float64, device=weights[0].device)
    rows = 0
    for weight in weights:
        chunks = weight.reshape(-1, _chunk_size(weight, spec)).abs()
        normalised = (chunks / (chunks.amax(dim=1, keepdim=True) + 1e-6)).reshape(weight.shape)
        total += normalised.sum(0, dtype=torch.float64)
        rows += weight.shape[0]
    return total / rows


def candidate_scales(
    x_mean: torch.Tensor, w_mean: torch.Tensor | None, grid: Sequence[tuple[float, bool]]
) -> torch.Tensor:
    """Every candidate's scales as a row ``(len(grid), in)`` (float64), llm-compressor's formula and
    order: ``x̄^r / (w̄^(1-r) + 1e-4)`` with duo scaling, else ``x̄^r``, floored at 1e-4,
    divided by ``sqrt(max·min)``, an infinite or NaN entry set to 1. ``w_mean`` may be None when
    no candidate uses duo scaling.

    Each row is made with a Python exponent, in the dtype llm-compressor's expression has (float64
    with duo scaling, where the weight means are float64; the activations' float32 without), so it
    is bit-identical to llm-compressor's: torch computes a scalar power like 0.5 as a square root,
    not as a general power, and one last-bit difference can move a search's pick. The rows are
    ``n_grid`` vectors; the search's cost is judging them (stacked), not making them."""
    x = x_mean.reshape(-1)
    rows = []
    for ratio, duo in grid:
        if duo:
            if w_mean is None:
                raise ValueError("duo scaling needs the balance layers' weight means")
            scales = (x.pow(ratio) / (w_mean.reshape(-1).pow(1 - ratio) + SCALE_FLOOR)).clamp(min=SCALE_FLOOR)
        else:
            scales = x.pow(ratio).clamp(min=SCALE_FLOOR)
        scales = scales / (scales.max() * scales.min()).sqrt()
        rows.append(torch.where(scales.isfinite(), scales, torch.ones_like(scales)).double())
    return torch.stack(rows)


def shrunk(qp: QParams, spec: QuantSpec, ratios: Sequence[float]) -> list[QParams]:
    """An observer's qparams with every group's chosen range shrunk by each of ``ratios`` (the
    clip search's candidates), by the spec's own range rule. Integer grids only: a float grid's
    block scales are rounded to a scale format a shrunk range does not simply map onto."""
    if spec.format.kind != "int" or spec.strategy not in ("group", "channel"):
        raise ValueError(
            f"the clip search shrinks each group's range of an integer grid with group or channel scales; "
            f"{spec.dtype} {spec.strategy} is not one"
        )
    factors = torch.tensor(list(ratios), dtype=qp.min_val.dtype, device=qp.min_val.device)
    factors = factors.reshape(-1, *([1] * qp.min_val.dim()))
    every = range_rule(qp.min_val.unsqueeze(0) * factors, qp.max_val.unsqueeze(0) * factors, spec)
    return [
        QParams(scale, zero_point, min_val, max_val, kind=qp.kind)
        for scale, zero_point, min_val, max_val in zip(
            every.scale, every.zero_point, every.min_val, every.max_val, strict=True
        )
    ]


def group_output_errors(difference: torch.Tensor, block_moment: torch.Tensor) -> torch.Tensor:
    """Each group's part of a layer's output error: ``dᵀ H_g d`` for the difference ``d`` of a
    row's group of weights and ``H_g`` the group's ``(g, g)`` block of the mean ``x xᵀ`` of the
    layer's inputs, so the sum over a row's groups is the row's output error without the terms
    across groups.

    ``difference`` is ``(k, n, rows, in)``: ``k`` differences (a clip search's ratios) of ``n``
    weights, each weight with its own inputs' blocks in ``block_moment`` ``(n, groups, g, g)``;
    the result is ``(k, n, rows, groups)``, from one batched matrix product per weight and group."""
    k, n, rows, columns = difference.shape
    groups, size = block_moment.shape[1], block_moment.shape[2]
    if block_moment.shape != (n, groups, size, size) or groups * size != columns:
        raise ValueError(
            f"group_output_errors needs differences (k, n, rows, groups·g) and blocks (n, groups, g, g), got "
            f"{tuple(difference.shape)} and {tuple(block_moment.shape)}"
        )
    d = difference.float().reshape(k, n, rows, groups, size).permute(1, 3, 0, 2, 4).reshape(n * groups, k * rows, size)
    h = block_moment.float().reshape(n * groups, size, size).to(d.device)
    errors = (torch.bmm(d, h) * d).sum(-1)
    return errors.reshape(n, groups, k, rows).permute(2, 0, 3, 1)


def clip_picks(
    weights: torch.Tensor, shrunk_ranges: Sequence[QParams], block_moment: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Per row and group of ``weights`` ``(n, rows, in)`` the index into ``shrunk_ranges`` (qparams of
    the ``n·rows`` rows, one per clip ratio: ``shrunk``) whose part of the layer's output error
    (``group_output_errors`` with weight ``i``'s blocks ``block_moment[i]``) is least: the first,
    then a ratio only when strictly less, as ModelOpt's ``awq_clip`` keeps one. ``(n·rows, groups)``
    int64, from ``clip_kernel`` where it takes the data (the same codes, the errors summed in another
    order), else eager: one fake-quantized copy of the weights per ratio."""
    n, rows, columns = weights.shape
    groups, size = block_moment.shape[1], block_moment.shape[2]
    flat = weights.reshape(n * rows, columns)
    if weights.dtype == torch.float32 and spec.format.kind == "int":
        qmin, qmax = spec.int_range
        picked = clip_kernel.group_clip_picks(
            weights.reshape(n, rows, groups, size).contiguous(),
            block_moment.float().contiguous(),
            torch.stack(
                [qp.effective_scale.float().reshape(n * rows, -1).expand(-1, groups) for qp in shrunk_ranges]
            ).contiguous(),
            torch.stack(
                [qp.zero_point.float().reshape(n * rows, -1).expand(-1, groups) for qp in shrunk_ranges]
            ).contiguous(),
            float(qmin),
            float(qmax),
        )
        if picked is not None:
            return picked
    least = best = None
    for index, shrunk_range in enumerate(shrunk_ranges):
        difference = (flat.float() - fake_quantize(flat, shrunk_range, spec).float()).reshape(1, n, rows, columns)
        errors = group_output_errors(difference, block_moment)[0].reshape(n * rows, groups)
        if least is None:
            least, best = errors, torch.zeros_like(errors, dtype=torch.long)
            continue
        better = errors < least
        least, best = torch.where(better, errors, least), torch.where(better, index, best)
    return best
