"""GPTQ: round a weight column by column, pushing each column's rounding error onto the columns not
yet rounded through the inverse Hessian of the layer's inputs (Frantar et al. 2022, section 3).

The lab ranks observers by what round-to-nearest does with their ranges; most 4-bit models are made
with GPTQ instead, where an observer's range plays out differently (issue 33). This module is the
algorithm's core, torch only:

- ``HessianAccumulator``: ``H = 2/n · Σ xxᵀ`` streamed batch by batch (one matmul per batch, fp32,
  no token kept), merged exactly across ranks because it keeps the sum and the count, not a mean.
- ``gptq_quantize(weight, hessian, spec, qparams_fn, ...)``: the sweep, with the observer's qparams
  coming in through ``qparams_fn``, under either scale semantics:

  ``fixed``  llm-compressor 0.14: ``qparams_fn`` runs once on the original weight before the sweep
             (``GPTQModifier`` observes ``module.weight`` first) and every column is rounded with its
             group's unchanged scale, so updated weights pushed past a shrunk range clip.
  ``refit``  the GPTQ paper's code, AutoGPTQ, GPTQModel: each group's qparams come from the
             error-updated weights at the moment the sweep reaches the group's first column. Here
             "updated" means every earlier column's error applied (the definition, so the result does
             not depend on ``block_size``); the reference code reads the weight as of the current
             block's start, which is the same whenever group starts fall on block starts (group 128,
             block 128).

  Activation ordering sweeps the columns by decreasing ``H[c, c]``: ``weight`` (llm-compressor's
  ``static``, its default) keeps each column's positional group ``c // group_size``; ``group``
  (``dynamic``, GPTQModel's ``desc_act``) forms groups of consecutive swept columns, recorded as
  ``g_idx`` in the qparams' extras (llm-compressor 0.14 refuses it; 0.8 observed the permuted weight
  for it, which is what ``fixed`` does here).
- ``layer_output_error``: the relative ``‖WX − ŴX‖²`` GPTQ minimises, from the Hessian alone.

Bad input is handled as llm-compressor does: input columns that never saw a nonzero value (dead:
``H[c, c] = 0``) get weight 0 and a unit diagonal; a Hessian that is not positive definite even after
dampening, or is not finite, gives round-to-nearest with the observer's qparams and a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from observers.metrics import clip_ratio
from observers.qparams import QParams
from observers.quantize import element_codes
from observers.shared import Op, Reduce
from observers.spec import QuantSpec

ActOrder = Literal["none", "weight", "group"]
Scales = Literal["fixed", "refit"]
QParamsFn = Callable[[torch.Tensor], QParams]

ACTORDER_ALIASES = {"none": "none", "weight": "weight", "static": "weight", "group": "group", "dynamic": "group"}
"""llm-compressor's words (``static`` = ``weight``, ``dynamic`` = ``group``) and ours."""
SCALES = ("fixed", "refit")
GPTQ_SETTINGS = ("block_size", "dampening", "actorder", "scales")


@dataclass(frozen=True)
class GPTQSpec:
    """How a run applies GPTQ to its weight observers: the knobs of ``gptq_quantize`` and the scale
    semantics, validated once and serializable like ``QuantSpec``. Defaults are llm-compressor 0.14's
    ``GPTQModifier``: block 128, dampening 0.01 of the mean diagonal, activation order ``static``
    (= ``weight``, its default even when the scheme says none), scales fixed before the sweep."""

    block_size: int = 128
    dampening: float = 0.01
    actorder: str = "static"
    scales: str = "fixed"

    def __post_init__(self) -> None:
        _check_knobs(self.block_size, self.dampening)
        _choice("actorder", self.actorder, ACTORDER_ALIASES)
        _choice("scales", self.scales, SCALES)

    def kwargs(self) -> dict[str, object]:
        """The keyword arguments of ``gptq_quantize``."""
        return {name: getattr(self, name) for name in GPTQ_SETTINGS}

    def to_dict(self) -> dict[str, object]:
        return dict(self.kwargs())

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> GPTQSpec:
        unknown = set(data) - set(GPTQ_SETTINGS)
        if unknown:
            raise ValueError(f"unknown GPTQ setting(s) {sorted(unknown)}; allowed: {', '.join(GPTQ_SETTINGS)}")
        return cls(**data)


def hessian_of_rows(rows: torch.Tensor) -> torch.Tensor:
    """``2/n · XᵀX`` of one batch of input rows ``(n, in)`` in fp32: a batch's Hessian as a mean over
    its rows, so a token-weighted running mean of it (the lab's streamed statistics) is the
    Hessian over every token, ``HessianAccumulator``'s."""
    x = rows.reshape(-1, rows.shape[-1]).float()
    return (x.T @ x).mul_(2.0).div_(max(x.shape[0], 1))  # in place: one (in, in) matrix, not three


# ---------------------------------------------------------------------------------------- Hessian


class HessianAccumulator:
    """``H = 2/n · Σ xxᵀ`` over every row ``x`` of every batch of a layer's inputs.

    Keeps the fp32 sum ``Σ xxᵀ`` (on the first batch's device) and the row count, never the rows:
    each ``update`` is one matmul, whatever the batch's dtype or leading dims. Keeping the sum and
    not a running mean is what makes ``merge`` (and ``reduced`` across ranks) exact: two parts add.

    ``n`` counts rows (tokens). llm-compressor 0.14 divides by the number of sequences instead
    (``helpers.accumulate_hessian``); GPTQ's result does not depend on the Hessian's scale
    (dampening is relative to its mean diagonal and the error feedback cancels the scale), so only
    ``layer_output_error``-style figures read the factor, and there tokens are the right count.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive integer, got {in_features!r}")
        self.in_features = in_features
        self.device = None if device is None else torch.device(device)
        self.sum: torch.Tensor | None = None
        self.count = 0

    def update(self, inputs: torch.Tensor) -> None:
        """Add a batch ``(..., in_features)``: ``Σ xxᵀ += XᵀX`` in fp32, ``n += rows``."""
        if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0 or inputs.shape[-1] != self.in_features:
            shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(f"Hessian inputs must be shaped (..., {self.in_features}), got {shape}")
        if self.device is None:
            self.device = inputs.device
        rows = inputs.reshape(-1, self.in_features).to(device=self.device, dtype=torch.float32)
        total = self._sum()
        total.addmm_(rows.t(), rows)
        self.count += rows.shape[0]

    def _sum(self) -> torch.Tensor:
        if self.sum is None:
            self.sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float32, device=self.device)
        return self.sum

    def merge(self, other: HessianAccumulator) -> HessianAccumulator:
        """A new accumulator holding both parts (e.g. two ranks' batches): sums and counts added."""
        if not isinstance(other, HessianAccumulator) or other.in_features != self.in_features:
            raise ValueError("merge needs another HessianAccumulator over the same in_features")
        merged = HessianAccumulator(self.in_features, self.device or other.device)
        merged.sum = self._sum().clone()
        merged.sum += other._sum().to(merged.sum.device)
        merged.count = self.count + other.count
        return merged

    def reduced(self, across: Reduce) -> HessianAccumulator:
        """The accumulator over every rank's batches (``observers.shared``'s ``reduce``, called in
        lockstep on every rank; a rank that saw no batch adds zeros, on the ``device`` it was made
        with, which a GPU process group needs to be that rank's GPU)."""
        merged = HessianAccumulator(self.in_features, self.device)
        total = self._sum()
        merged.sum = across(total.clone(), Op.SUM)
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=total.device)
        merged.count = int(across(count, Op.SUM).item())
        return merged

    def hessian(self) -> torch.Tensor:
        """``2/n · Σ xxᵀ`` (fp32, ``(in, in)``); a ValueError before any row was seen."""
        if self.count == 0:
            raise ValueError("the Hessian has seen no calibration inputs; GPTQ needs calibration data")
        return self._sum() * (2.0 / self.count)


def layer_output_error(
    weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor, energy: float | None = None
) -> float:
    """Relative ``‖WX − ŴX‖² / ‖WX‖²`` on the inputs behind ``hessian``, as ``tr(ΔHΔᵀ) / tr(WHWᵀ)``:
    the figure GPTQ minimises, computed without the tokens (0 when ``WX`` and ``Δ`` are both 0).
    ``energy`` is ``output_energy(weight, hessian)`` when the caller compares several ``approx``."""
    w = weight.reshape(weight.shape[0], -1).float()
    h = hessian.to(device=w.device, dtype=torch.float32)
    if approx.shape != weight.shape or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(
            f"layer_output_error needs approx shaped like the weight {tuple(weight.shape)} and a "
            f"({w.shape[1]}, {w.shape[1]}) Hessian, got {tuple(approx.shape)} and {tuple(h.shape)}"
        )
    delta = w - approx.reshape(w.shape).to(w.device).float()
    error = float((delta @ h).mul_(delta).sum())  # in place: one layer-sized product fewer at a time
    reference = output_energy(weight, hessian) if energy is None else energy
    if reference > 0:
        return error / reference
    return 0.0 if error == 0 else math.inf


def output_energy(weight: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(WHWᵀ)``: ``‖WX‖²`` (times 2/n) on the inputs behind ``hessian``, the error's reference."""
    w = weight.reshape(weight.shape[0], -1).float()
    return float((w @ hessian.to(device=w.device, dtype=torch.float32)).mul_(w).sum())


# ------------------------------------------------------------------------------------- the result


@dataclass
class GPTQResult:
    """What ``gptq_quantize`` made of one weight.

    - ``weight``: the GPTQ weight, fake-quantized, the input weight's shape and dtype.
    - ``codes``: the element codes ``quantize`` would give (int32 for integer formats, fp32 grid
      values for float formats), so ``dequantize(codes, qparams, spec)`` is ``weight`` in fp32.
    - ``qparams``: the qparams every column was rounded with, in the spec's qparam shape and the
      original column order (``extras["g_idx"]`` with ``actorder="group"``).
    - ``updated``: fp32, each weight as the sweep found it just before rounding (the original plus
      the error fed forward): what the range has to hold.
    - ``clip_ratio``: the share of ``updated`` beyond the qparams' representable range (the lab's
      ``clip_ratio`` rule), i.e. the weights the error feedback pushed out and that saturated.
    - ``loss``: llm-compressor's logged loss, ``½ Σ ((w − q) / U[j, j])²``.
    - ``perm``: the order the columns were swept in (None: positional).
    - ``dead_columns``: input columns whose Hessian diagonal was 0 (their weights were set to 0).
    - ``fallback``: True when the layer was rounded to nearest instead (see ``notes``).
    - ``notes``: sentences for a person (dead columns, fallback).
    """

    weight: torch.Tensor
    codes: torch.Tensor
    qparams: QParams
    updated: torch.Tensor
    clip_ratio: float
    loss: float
    perm: torch.Tensor | None
    dead_columns: int
    fallback: bool
    notes: tuple[str, ...]


# ------------------------------------------------------------------------------- checks and plans


def check_gptq_spec(spec: QuantSpec, scales: str = "fixed", actorder: str = "none") -> None:
    """One-line ValueError for a scheme this GPTQ does not serve.

    Served: integer and float elements with a free scale, per tensor, per output channel or in
    groups along the input; block formats (MX, NVFP4, BFP) with ``fixed`` scales in positional
    groups. Not served: casts (no grid), dynamic specs (no static scale to sweep with), token and
    2-D block strategies, per-input-channel scales, and ``refit`` / ``group`` ordering for block
    formats (their qparams carry a global scale or exponent codes that a per-group refit would
    split)."""
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"GPTQ needs a QuantSpec, got {type(spec).__name__}")
    actorder = ACTORDER_ALIASES.get(actorder, actorder)  # llm-compressor's "dynamic" is "group"
    fmt = spec.format
    if fmt.kind == "cast":
        raise ValueError(f"GPTQ does not serve {spec.dtype!r}: a plain cast has no grid to round onto")
    if spec.dynamic:
        raise ValueError("GPTQ does not serve dynamic specs: it needs the weight's static qparams")
    if spec.strategy not in ("tensor", "channel", "group"):
        raise ValueError(f"GPTQ serves tensor, channel and group strategies, not {spec.strategy!r}")
    if spec.strategy == "channel" and spec.channel_axis("weight") not in (0, -2):
        raise ValueError("GPTQ serves per-output-channel scales (ch_axis 0), not per input column")
    if fmt.is_block and (scales == "refit" or actorder == "group"):
        raise ValueError(
            f"GPTQ serves block format {spec.dtype!r} with scales='fixed' and positional groups only "
            "(its block qparams cannot be refit or reordered group by group)"
        )


def _choice(name: str, value: object, allowed: dict[str, str] | tuple[str, ...]) -> str:
    key = "none" if value is None and name == "actorder" else value
    if not isinstance(key, str) or key not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")
    return allowed[key] if isinstance(allowed, dict) else key


def _check_knobs(block_size: int, dampening: float) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if isinstance(dampening, bool) or not isinstance(dampening, (int, float)) or not 0 <= dampening < math.inf:
        raise ValueError(f"dampening must be a finite number >= 0, got {dampening!r}")


def _as_matrices(weight: torch.Tensor, hessian: torch.Tensor | HessianAccumulator) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as ``(out, in)`` (conv weights flattened like ``granularity.as_2d``) and the Hessian
    as fp32 ``(in, in)`` on the weight's device, or a one-line ValueError."""
    if not isinstance(weight, torch.Tensor) or weight.ndim < 2 or not weight.dtype.is_floating_point:
        raise ValueError("GPTQ needs a floating-point weight shaped (out, in, ...)")
    if isinstance(hessian, HessianAccumulator):
        hessian = hessian.hessian()
    if not isinstance(hessian, torch.Tensor):
        raise ValueError(f"hessian must be a tensor or a HessianAccumulator, got {type(hessian).__name__}")
    w = weight.reshape(weight.shape[0], -1)
    if w.numel() == 0:
        raise ValueError(f"GPTQ needs a non-empty weight, got shape {tuple(weight.shape)}")
    if tuple(hessian.shape) != (w.shape[1], w.shape[1]):
        raise ValueError(
            f"the Hessian is {tuple(hessian.shape)} but a weight with {w.shape[1]} input columns needs "
            f"({w.shape[1]}, {w.shape[1]})"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError("the weight has NaN/Inf values; GPTQ needs a finite weight")
    return w, hessian.to(device=w.device, dtype=torch.float32)


def sweep_order(hessian: torch.Tensor, actorder: str) -> torch.Tensor | None:
    """Columns by decreasing ``H[c, c]`` (the mean squared input they see), or None for positional
    order. Ties break as llm-compressor's do: torch's default (unstable) sort, the very call it
    makes. Ties are real: a massive activation channel planted in the embedding reaches a first
    block's q/k/v as equal columns, and a stable order there parts GPTQ's codes from
    llm-compressor's in a quarter of those weights (BENCHMARKS.md, NVFP4 of a decoder)."""
    if actorder == "none":
        return None
    return torch.argsort(torch.diagonal(hessian), descending=True)


def column_groups(in_features: int, spec: QuantSpec, actorder: str, perm: torch.Tensor | None) -> torch.Tensor:
    """The qparam group of the column swept at each position (int64 ``(in,)``, in sweep order).

    Tensor and channel scales are one group. Group scales: positional ``c // group_size`` of the
    swept column ``c`` (``none``, ``weight``), or ``position // group_size`` (``group``: consecutive
    swept columns share a scale)."""
    device = perm.device if perm is not None else None
    if spec.strategy != "group":
        return torch.zeros(in_features, dtype=torch.long, device=device)
    if actorder == "group" or perm is None:
        return torch.arange(in_features, device=device) // spec.group_size
    return perm // spec.group_size


def _expected_qparam_shape(spec: QuantSpec, rows: int, columns: int) -> tuple[int, ...]:
    if spec.strategy == "tensor":
        return (1,)
    if spec.strategy == "channel":
        return (rows, 1)
    return (rows, -(-columns // spec.group_size))


def _checked(qp: QParams, shape: tuple[int, ...], what: str) -> QParams:
    """``qp`` if it fits ``shape`` with finite positive scales, else a one-line ValueError (a
    ``qparams_fn`` built for another spec or kind lands here)."""
    if not isinstance(qp, QParams):
        raise ValueError(f"qparams_fn must return QParams, got {type(qp).__name__} ({what})")
    if tuple(qp.scale.shape) != shape or tuple(qp.zero_point.shape) != shape:
        raise ValueError(
            f"qparams_fn gave scales shaped {tuple(qp.scale.shape)} for {what}; expected {shape} "
            "(an observer made for this spec with kind='weight')"
        )
    scale = qp.effective_scale
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"qparams_fn gave a scale that is not finite and positive ({what})")
    return qp


# ------------------------------------------------------------------------------------ the factor


def dead_columns(hessian: torch.Tensor) -> torch.Tensor:
    """Columns whose inputs were all zero (``H[c, c] == 0``): bool ``(in,)``."""
    return torch.diagonal(hessian) == 0


def inverse_hessian_factor(hessian: torch.Tensor, dampening: float) -> torch.Tensor | None:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` with ``λ = dampening · mean(diag H)`` (fp32,
    on ``hessian``'s device), or None when ``H + λI`` or its inverse is not positive definite.

    The row ``U[j, j:]`` is what GPTQ's update needs once columns before ``j`` are fixed (the
    inverse Hessian with those columns eliminated, scaled by ``√`` of its pivot). Computed as
    llm-compressor does (Cholesky, ``cholesky_inverse``, upper Cholesky), so the rounding agrees.
    Dead columns must already carry a unit diagonal (``dead_columns``)."""
    return _factor_of_own(hessian.clone(), dampening)


def _factor_of_own(h: torch.Tensor, dampening: float) -> torch.Tensor | None:
    """``inverse_hessian_factor`` of a Hessian copy no one else holds, dampened in place, each step's
    input let go once the next is made: two ``(in, in)`` matrices at a time, not four (an 11008-wide
    ``down_proj``'s are 485 MB each)."""
    diagonal = torch.diagonal(h)
    diagonal.add_(dampening * diagonal.mean())
    lower, info = torch.linalg.cholesky_ex(h)
    del h, diagonal
    if int(info) != 0:
        return None
    inverse = torch.cholesky_inverse(lower)
    del lower
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    del inverse
    if int(info) != 0 or not bool(torch.isfinite(upper).all()) or not bool((torch.diagonal(upper) > 0).all()):
        return None
    return upper


# ------------------------------------------------------------------------------------- the sweep


@dataclass
class _GroupQParams:
    """Per-group qparams as ``(G, R)`` tables (R: rows, or 1 for a tensor scale), row ``g`` of which
    rounds the columns of group ``g`` (a contiguous read per column); refit fills a row when the
    sweep reaches its group."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    @classmethod
    def of(cls, qp: QParams, rows: int, groups: int, device: torch.device) -> _GroupQParams:
        table = lambda t: t.reshape(rows, groups).t().contiguous().to(device)  # noqa: E731
        return cls(
            table(qp.effective_scale.float()),
            table(qp.zero_point),
            table(qp.min_val.float()),
            table(qp.max_val.float()),
        )

    @classmethod
    def empty(cls, rows: int, groups: int, device: torch.device) -> _GroupQParams:
        blank = lambda dtype: torch.zeros(groups, rows, dtype=dtype, device=device)  # noqa: E731
        return cls(blank(torch.float32), blank(torch.int32), blank(torch.float32), blank(torch.float32))

    def fill(self, group: int, qp: QParams) -> None:
        self.scale[group] = qp.scale.reshape(-1).float()
        self.zero_point[group] = qp.zero_point.reshape(-1).to(torch.int32)
        self.min_val[group] = qp.min_val.reshape(-1).float()
        self.max_val[group] = qp.max_val.reshape(-1).float()

    def as_qparams(self, shape: tuple[int, ...]) -> QParams:
        """The tables in the spec's qparam shape (``(G, R)`` back to ``(R, G)``)."""
        spec_shape = lambda t: t.t().reshape(shape)  # noqa: E731
        return QParams(
            spec_shape(self.scale),
            spec_shape(self.zero_point),
            spec_shape(self.min_val),
            spec_shape(self.max_val),
            None,
            {},
            "weight",
        )


@dataclass
class _Refit:
    """What refit needs: each group's swept positions (ordered by original column) and the
    position where the sweep first meets it, and the observer."""

    members: list[torch.Tensor]
    first: dict[int, int]
    qparams_fn: QParamsFn
    shape: tuple[int, ...]


def _refit_plan(groups: torch.Tensor, perm: torch.Tensor | None, qparams_fn: QParamsFn, shape: tuple) -> _Refit:
    original = perm if perm is not None else torch.arange(groups.numel(), device=groups.device)
    order = torch.argsort(original)  # swept positions in original column order
    by_group = groups[order]
    grouped = order[torch.argsort(by_group, stable=True)]
    counts = torch.bincount(by_group).tolist()
    members = list(torch.split(grouped, counts))
    first = {int(m.min()): g for g, m in enumerate(members)}
    return _Refit(members, first, qparams_fn, shape)


def _group_values(
    members: torch.Tensor, j: int, i1: int, i2: int, columns: torch.Tensor, errors: torch.Tensor, factor: torch.Tensor
) -> torch.Tensor:
    """A group's weights ``(out, k)`` with every earlier column's error applied, at swept position
    ``j`` of the block ``[i1, i2)``: the block's columns are up to date (updated column by column),
    those past it still lack the block's errors so far (the lazy update, made when the block ends),
    which are added here. ``columns`` and ``errors`` are column-major (one row per column)."""
    values = columns[members].clone()
    beyond = members >= i2
    if j > i1 and bool(beyond.any()):
        values[beyond] -= factor[i1:j, members[beyond]].t() @ errors[: j - i1]
    return values.t().contiguous()


def _sweep(
    columns: torch.Tensor,
    factor: torch.Tensor,
    groups: torch.Tensor,
    table: _GroupQParams,
    spec: QuantSpec,
    block_size: int,
    refit: _Refit | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ over ``columns`` (fp32 ``(in, out)``: the weight transposed, in sweep order, so each
    column is one contiguous row; overwritten with the updated weights): returns the fake-quantized
    weight and the codes, both ``(in, out)``, and the loss of each output row.

    Column ``j`` is rounded with its group's qparams, its error ``e = (w − q) / U[j, j]`` goes to
    the rest of its block at once (``w[j+1:] −= U[j, j+1:] ⊗ e``) and to the columns past the block
    in one matmul when the block ends (the lazy batch update of section 3.4). The output rows are
    one vector throughout; the only Python loops are over blocks and the columns of a block."""
    count = columns.shape[0]
    is_int = spec.format.kind == "int"
    quantized = torch.empty_like(columns)
    codes = torch.empty_like(columns)
    column_group = groups.tolist()
    loss = torch.zeros(columns.shape[1], dtype=torch.float64, device=columns.device)
    for i1 in range(0, count, block_size):
        i2 = min(i1 + block_size, count)
        errors = torch.empty(i2 - i1, columns.shape[1], dtype=torch.float32, device=columns.device)
        for i in range(i2 - i1):
            j = i1 + i
            group = column_group[j]
            if refit is not None and j in refit.first:
                values = _group_values(refit.members[group], j, i1, i2, columns, errors, factor)
                table.fill(group, _checked(refit.qparams_fn(values), refit.shape, f"group {group} under refit"))
            scale, zero_point = table.scale[group], table.zero_point[group]
            w = columns[j]
            code = element_codes(w, scale, zero_point, spec)
            codes[j] = code
            q = code.sub_(zero_point).mul_(scale) if is_int else code.mul_(scale)
            quantized[j] = q
            error = torch.sub(w, q, out=errors[i]).div_(factor[j, j])
            if j + 1 < i2:
                columns[j + 1 : i2].addr_(factor[j, j + 1 : i2], error, alpha=-1)
        loss += errors.double().square().sum(0) / 2
        if i2 < count:
            columns[i2:].addmm_(factor[i1:i2, i2:].t(), errors, alpha=-1)
    return quantized, codes, loss


# ---------------------------------------------------------------------------------- the algorithm


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    qparams_fn: QParamsFn,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    actorder: ActOrder | str | None = "none",
    scales: Scales | str = "fixed",
    factors: dict[tuple[str, float], torch.Tensor | None] | None = None,
) -> GPTQResult:
    """GPTQ of ``weight`` ``(out, in, ...)`` with the inputs' ``hessian`` ``(in, in)`` (or its
    ``HessianAccumulator``), rounding with an observer's qparams: ``qparams_fn(tensor) -> QParams``
    for ``spec`` and kind ``weight``, called once on the original weight (``fixed``; on its columns
    in sweep order with ``actorder="group"``) or per group on the updated weights (``refit``, the
    group's columns in original order).

    Defaults are llm-compressor's knobs (block 128, dampening 0.01 of the mean diagonal) except
    ``actorder``, whose llm-compressor default is ``static`` (= ``weight``) even when the scheme
    says none: pass ``actorder="weight"`` to reproduce a plain ``GPTQModifier``. Everything runs in
    fp32 on the weight's device. Bad input: one-line ValueError for shapes, knobs and unserved
    specs (``check_gptq_spec``); dead columns and an unusable Hessian are handled and noted.

    ``factors``: a dict the caller keeps for one layer and Hessian while several observers' qparams
    go through GPTQ on it; the inverse factor (a Cholesky, an inverse and another Cholesky, which
    depend on the Hessian, the order and the dampening only) is then computed once per order.
    """
    knobs = {"block_size": block_size, "dampening": dampening, "actorder": actorder, "factors": factors}
    return _gptq(weight, hessian, spec, [qparams_fn], scales, **knobs)[0]


def gptq_quantize_fixed(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    qparams_fns: list[QParamsFn],
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    actorder: ActOrder | str | None = "none",
    factors: dict[tuple[str, float], torch.Tensor | None] | None = None,
) -> list[GPTQResult]:
    """Several observers' ``fixed``-scale GPTQ of one weight in one sweep: ``gptq_quantize``'s
    result for each of ``qparams_fns``, in order. GPTQ treats the weight's rows independently (a
    column's error moves along its own row only), so the observers' copies of the weight are
    stacked as rows and swept together: the per-column steps, a Python loop, run once instead of
    once per observer. Costs ``len(qparams_fns)`` copies of the weight in fp32; callers with big
    layers pass the observers a few at a time."""
    if not qparams_fns:
        return []
    knobs = {"block_size": block_size, "dampening": dampening, "actorder": actorder, "factors": factors}
    return _gptq(weight, hessian, spec, list(qparams_fns), "fixed", **knobs)


def _gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    spec: QuantSpec,
    fns: list[QParamsFn],
    scales: Scales | str,
    *,
    block_size: int,
    dampening: float,
    actorder: ActOrder | str | None,
    factors: dict[tuple[str, float], torch.Tensor | None] | None,
) -> list[GPTQResult]:
    """The sweep for one ``refit`` observer, or for several ``fixed`` ones stacked as rows."""
    actorder = _choice("actorder", actorder, ACTORDER_ALIASES)
    scales = _choice("scales", scales, SCALES)
    check_gptq_spec(spec, scales, actorder)
    _check_knobs(block_size, dampening)
    if not all(callable(fn) for fn in fns):
        raise ValueError("qparams_fn must be a callable tensor -> QParams (an observer's qparams)")
    w, h = _as_matrices(weight, hessian)
    rows, columns = w.shape
    notes: list[str] = []

    usable = bool(torch.isfinite(h).all())
    if not usable:
        notes.append("the Hessian has NaN/Inf entries (non-finite calibration inputs?): round-to-nearest instead")
    perm = sweep_order(h, actorder) if usable else None
    group_perm = perm if actorder == "group" and spec.strategy == "group" else None
    groups = column_groups(columns, spec, actorder, perm)
    shape = _expected_qparam_shape(spec, rows, columns)
    fixed_qps: list[QParams | None] = [None]
    if scales == "fixed":
        observed = w if group_perm is None else w[:, group_perm]
        fixed_qps = [_checked(fn(observed), shape, "the weight") for fn in fns]
    table = _stacked_table([_start_table(qp, spec, shape, w.device) for qp in fixed_qps], rows)

    swept, dead = _swept_columns(w, h, perm, usable)
    if dead:
        notes.append(
            f"{dead} of {columns} input columns saw only zeros (dead): their weights were set to 0 and their "
            "Hessian diagonal to 1 before the sweep, as llm-compressor does"
        )
    if factors is not None and (actorder, dampening) in factors:
        factor = factors[(actorder, dampening)]
    else:
        factor = _factor_of_own(_swept_hessian(h, perm), dampening) if usable else None
        if factors is not None:
            factors[(actorder, dampening)] = factor
    fallback = factor is None
    if fallback:
        if usable:
            notes.append(
                f"the Hessian is not positive definite even after dampening {dampening}: "
                "round-to-nearest with the observer's qparams for this layer"
            )
        factor = torch.eye(columns, dtype=torch.float32, device=w.device)  # no error feedback: RTN

    refit = None
    if scales == "refit":
        refit = _refit_plan(groups, perm, fns[0], (1,) if spec.strategy == "tensor" else (rows, 1))
    stacked = swept.repeat(1, len(fixed_qps)) if len(fixed_qps) > 1 else swept
    del swept  # the repeat holds every observer's copy
    quantized, codes, losses = _sweep(stacked, factor, groups, table, spec, block_size, refit)
    outputs = [stacked, quantized, codes]
    del stacked, quantized, codes  # ``_restored`` lets each go once its last observer's part is restored

    inverse = None if perm is None else torch.argsort(perm)
    restore = lambda t: (t if inverse is None else t[inverse]).t().reshape(weight.shape)  # noqa: E731
    results = []
    for k, fixed_qp in enumerate(fixed_qps):
        part = slice(k * rows, (k + 1) * rows)
        qparams = _final_qparams(fixed_qp, table, shape, group_perm, spec)
        updated, fake, found = _restored(outputs, part, k == len(fixed_qps) - 1, restore)
        clipped = clip_ratio(updated, qparams, spec)  # before the codes' integer copy joins them
        results.append(
            GPTQResult(
                weight=fake.to(weight.dtype),
                codes=found.to(torch.int32) if spec.format.kind == "int" else found,
                qparams=qparams,
                updated=updated,
                clip_ratio=clipped,
                loss=float(losses[part].sum()),
                perm=perm,
                dead_columns=dead,
                fallback=fallback,
                notes=tuple(notes),
            )
        )
    return results


def _restored(
    outputs: list[torch.Tensor | None], part: slice, last: bool, restore: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """One observer's ``part`` (its rows) of each of the sweep's ``outputs`` (updated weights,
    fake-quantized weights, codes: ``(in, rows · observers)`` in sweep order), in the weight's
    shape and column order; with the ``last`` observer's part each output is let go from the list
    as soon as that part is restored, so a weight swept alone has its restored copies take the
    sweep's place one by one rather than join it."""
    found = []
    for index in range(len(outputs)):
        piece = outputs[index][:, part]
        if last:
            outputs[index] = None
        found.append(restore(piece))
        del piece
    return found


def _stacked_table(tables: list[_GroupQParams], rows: int) -> _GroupQParams:
    """Several observers' tables side by side, one block of ``rows`` each (a tensor scale spread
    over its rows first); one table as it is."""
    if len(tables) == 1:
        return tables[0]
    spread = lambda t: t.expand(t.shape[0], rows) if t.shape[1] == 1 else t  # noqa: E731
    fields = ("scale", "zero_point", "min_val", "max_val")
    return _GroupQParams(*(torch.cat([spread(getattr(t, name)) for t in tables], dim=1) for name in fields))


def _start_table(fixed: QParams | None, spec: QuantSpec, shape: tuple[int, ...], device: torch.device) -> _GroupQParams:
    """The per-group tables the sweep reads: the observer's fixed qparams, or blanks refit fills."""
    rows = 1 if spec.strategy == "tensor" else shape[0]
    groups = shape[1] if spec.strategy == "group" else 1
    if fixed is None:
        return _GroupQParams.empty(rows, groups, device)
    return _GroupQParams.of(fixed, rows, groups, device)


def _swept_columns(
    w: torch.Tensor, h: torch.Tensor, perm: torch.Tensor | None, usable: bool
) -> tuple[torch.Tensor, int]:
    """The sweep's working copy of the weight: fp32 ``(in, out)`` (one contiguous row per column) in
    sweep order, dead columns' weights 0 (as llm-compressor's ``factorize_hessian``); and how many
    columns were dead."""
    columns = w.float().t()
    if perm is not None:
        columns = columns[perm]
    columns = columns.contiguous() if perm is not None else columns.clone(memory_format=torch.contiguous_format)
    dead = dead_columns(h) if usable else torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
    if perm is not None:
        dead = dead[perm]
    count = int(dead.sum())
    if count:
        columns[dead] = 0.0
    return columns, count


def _swept_hessian(h: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """A copy of the Hessian in sweep order (one gather), dead columns' diagonal 1 (as
    llm-compressor's ``factorize_hessian``): made only when the layer's factor is, and given to
    ``_factor_of_own`` to be dampened and let go in place."""
    swept = h[perm.unsqueeze(1), perm] if perm is not None else h.clone()
    dead = dead_columns(swept)
    if bool(dead.any()):
        swept[dead, dead] = 1.0
    return swept


def _final_qparams(
    fixed: QParams | None,
    table: _GroupQParams,
    shape: tuple[int, ...],
    group_perm: torch.Tensor | None,
    spec: QuantSpec,
) -> QParams:
    """The qparams in the spec's shape: the observer's own under ``fixed``, the refit tables
    otherwise; with ``group`` ordering, ``extras["g_idx"]`` maps each original column to its group."""
    if fixed is not None:
        qp = QParams(
            fixed.scale,
            fixed.zero_point,
            fixed.min_val,
            fixed.max_val,
            fixed.global_scale,
            dict(fixed.extras),
            "weight",
        )
    else:
        qp = table.as_qparams(shape)
    if group_perm is not None:
        g_idx = torch.empty_like(group_perm)
        g_idx[group_perm] = torch.arange(group_perm.numel(), device=group_perm.device) // spec.group_size
        qp.extras["g_idx"] = g_idx.to(torch.int64)
    return qp


__all__ = [
    "GPTQResult",
    "HessianAccumulator",
    "check_gptq_spec",
    "column_groups",
    "dead_columns",
    "gptq_quantize",
    "gptq_quantize_fixed",
    "inverse_hessian_factor",
    "layer_output_error",
    "sweep_order",
]
