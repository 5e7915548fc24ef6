"""Shrink-grid MSE search per qparam group (llm-compressor's ``memoryless_mse`` / ``mse``).

The search runs on the flattened view ``(num_observations, *qparam_shape, group)`` for every
granularity, and goes through ``calculate_qparams`` and the element rounding of
``observers.quantize``, so any format whose range -> qparams rule is registered there (block
formats included: for MX, shrinking the range chooses among power-of-two exponents) is searched
the same way. Candidates are evaluated in chunks as one batched tensor op each; the chunk size
follows ``max_working_bytes``.
"""

from __future__ import annotations

import warnings

import torch

from observers.base import Observer, register
from observers.granularity import Flat, as_2d, flatten, reduce_min_max
from observers.qparams import calculate_qparams
from observers.quantize import _element_codes
from observers.spec import QuantSpec

DEFAULT_WORKING_BYTES = 1 << 28


def fake_quant_batched(
    data: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Fake-quantize ``data`` with qparams that broadcast against it (e.g. a leading candidate dim).

    The same element rounding as ``observers.quantize.fake_quantize``; fp32 result.
    """
    codes = _element_codes(data, scale, zero_point, spec)
    if spec.format.kind == "int":
        return codes.sub_(zero_point).mul_(scale)
    return codes.mul_(scale)


def shrink_factors(maxshrink: float, grid: float) -> list[float]:
    """LC's candidates ``p = 1 - i/grid`` for ``i < int(maxshrink·grid)``, in search order."""
    return [1 - i / grid for i in range(int(maxshrink * grid))]


def _chunk_errors(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    base_min: torch.Tensor,
    base_max: torch.Tensor,
    factors: list[float],
    spec: QuantSpec,
    norm: float,
) -> torch.Tensor:
    """``Σ weight·|fake_quant(x) - x|^norm`` per group for each factor, (C, *qparam_shape).

    ``calculate_qparams`` is called once per candidate on the small qparam tensors so that any
    scale rule (one with a per-tensor global scale included) sees exactly one candidate range;
    the element-wise work runs on all candidates of the chunk at once.
    """
    scales, zero_points = [], []
    for p in factors:
        qp = calculate_qparams(base_min * p, base_max * p, spec)
        scales.append(qp.effective_scale.expand_as(base_min))
        zero_points.append(qp.zero_point.expand_as(base_min))
    shape = (len(factors), 1, *base_min.shape, 1)
    scale = torch.stack(scales).reshape(shape)
    zero_point = torch.stack(zero_points).reshape(shape).float()
    x = data.unsqueeze(0)
    err = fake_quant_batched(x, scale, zero_point, spec).sub_(x).abs_().pow_(norm)
    if weight is not None:
        err.mul_(weight)
    return err.sum(dim=(1, err.ndim - 1))


def _apply_patience(
    errors: torch.Tensor, best: torch.Tensor, stale: int, patience: int
) -> tuple[int, int, bool]:
    """Replay the sequential early-stop rule over one chunk of candidate errors (C, *groups).

    Returns (candidates of this chunk the sequential loop would have evaluated, the stale count
    after them, whether it stopped). A candidate "improves" when any group's error is strictly
    below that group's best so far; the loop stops once ``patience`` consecutive candidates
    improved nothing.
    """
    count = errors.shape[0]
    previous = torch.cat([best.unsqueeze(0), errors[:-1]]).cummin(dim=0).values
    improved = (errors < previous).reshape(count, -1).any(dim=1)
    index = torch.arange(count, device=errors.device)
    last_improved = torch.where(improved, index, -1).cummax(dim=0).values
    run = torch.where(last_improved >= 0, index - last_improved, stale + index + 1)
    stops = torch.nonzero(run >= patience)
    if stops.numel():
        stop = int(stops[0, 0])
        return stop + 1, int(run[stop]), True
    return count, int(run[-1]), False


def mse_grid_search(
    flat: Flat,
    spec: QuantSpec,
    maxshrink: float = 0.2,
    grid: float = 100,
    patience: int = 5,
    norm: float = 2.4,
    expand: float = 1.0,
    max_working_bytes: int = DEFAULT_WORKING_BYTES,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ``(min, max)`` minimising ``Σ weight·|fake_quant(x) - x|^norm`` over LC's shrink grid.

    Identical to this sequential loop (llm-compressor ``_grid_search_mse``): start from
    ``expand·(min, max)``; for ``p = 1 - i/grid``, ``i < int(maxshrink·grid)``, scale both ends by
    ``p``; each group keeps the first candidate with its lowest error; stop after ``patience``
    consecutive candidates that improved no group. Here candidates run in chunks sized so that
    about ``max_working_bytes`` are live, and the early-stop rule is replayed over each chunk's
    errors, so the result equals the sequential loop's. ``weight`` (broadcastable to
    ``flat.data``) weighs each element's error; padding of ragged groups is excluded.
    """
    data = flat.data.float()
    low, high = reduce_min_max(flat)
    base_min, base_max = low * expand, high * expand
    if flat.valid is not None:
        weight = flat.valid.float() if weight is None else weight * flat.valid
    factors = shrink_factors(maxshrink, grid)
    per_candidate = max(1, data.numel() * 4 * 3)
    chunk = max(1, min(len(factors), max_working_bytes // per_candidate))
    best = torch.full_like(base_min, torch.finfo(torch.float32).max)
    best_factor = torch.ones_like(base_min)
    stale = 0
    for first in range(0, len(factors), chunk):
        chunk_factors = factors[first : first + chunk]
        errors = _chunk_errors(data, weight, base_min, base_max, chunk_factors, spec, norm)
        errors = torch.nan_to_num(errors, nan=torch.inf)
        used, stale, stopped = _apply_patience(errors, best, stale, patience)
        errors = errors[:used]
        candidates = torch.cat([best.unsqueeze(0), errors])
        pick = candidates.argmin(dim=0)
        factor_values = torch.tensor([1.0, *chunk_factors[:used]], dtype=torch.float32, device=data.device)
        best_factor = torch.where(pick > 0, factor_values[pick], best_factor)
        best = candidates.gather(0, pick.unsqueeze(0)).squeeze(0)
        if stopped:
            break
    return base_min * best_factor, base_max * best_factor


def _check_grid_knobs(obs: Observer) -> None:
    if isinstance(obs.maxshrink, bool) or not isinstance(obs.maxshrink, (int, float)) or not 0 < obs.maxshrink <= 1:
        raise ValueError(f"maxshrink must be in (0, 1], got {obs.maxshrink!r}")
    if isinstance(obs.grid, bool) or not isinstance(obs.grid, (int, float)) or obs.grid <= 0:
        raise ValueError(f"grid must be a positive number, got {obs.grid!r}")
    if int(obs.maxshrink * obs.grid) < 1:
        raise ValueError(f"maxshrink·grid = {obs.maxshrink * obs.grid} gives no candidate; it must be >= 1")
    if isinstance(obs.patience, bool) or not isinstance(obs.patience, int) or obs.patience < 1:
        raise ValueError(f"patience must be a positive integer, got {obs.patience!r}")
    if isinstance(obs.norm, bool) or not isinstance(obs.norm, (int, float)) or obs.norm <= 0:
        raise ValueError(f"norm must be a positive number, got {obs.norm!r}")
    if isinstance(obs.expand, bool) or not isinstance(obs.expand, (int, float)) or obs.expand < 1:
        raise ValueError(f"expand must be a number >= 1, got {obs.expand!r}")
    working = obs.max_working_bytes
    if isinstance(working, bool) or not isinstance(working, int) or working <= 0:
        raise ValueError(f"max_working_bytes must be a positive integer, got {working!r}")


_GRID_KNOBS = {
    "maxshrink": 0.2,
    "grid": 100,
    "patience": 5,
    "norm": 2.4,
    "expand": 1.0,
    "max_working_bytes": DEFAULT_WORKING_BYTES,
}


class _GridBase(Observer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        _check_grid_knobs(self)

    def _reset_statistics(self) -> None:
        self.min_val = self.max_val = None

    def _error_weight(self, flat: Flat) -> torch.Tensor | None:
        return None

    def _observe(self, flat: Flat) -> None:
        low, high = mse_grid_search(
            flat,
            self.spec,
            self.maxshrink,
            self.grid,
            self.patience,
            self.norm,
            self.expand,
            self.max_working_bytes,
            weight=self._error_weight(flat),
        )
        self.min_val, self.max_val = self._combine(low, high)

    def _combine(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return low, high

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val


@register
class MSEGridObserver(_GridBase):
    """Shrink-grid search of the range with the least ``Σ|fake_quant(x) - x|^norm``, per qparam group.

    Rule: start at ``expand·(min, max)`` of the last batch; try ``p = 1 - i/grid`` for
    ``i < int(maxshrink·grid)`` (both ends times ``p``); each group keeps its best (first on ties);
    stop after ``patience`` consecutive candidates that improved no group.
    Knobs: ``maxshrink`` 0.2, ``grid`` 100, ``patience`` 5, ``norm`` 2.4, ``expand`` 1.0,
    ``max_working_bytes`` 256 MiB (caps the live candidate buffers; results do not depend on it).
    Reference: llm-compressor ``memoryless_mse`` (same candidates and stop rule, so the scales
    agree); differs in evaluating chunks of candidates as one tensor op instead of a Python loop.
    Works for every granularity and every format ``calculate_qparams`` knows, block formats too.
    Memoryless: each ``observe`` replaces the range (use ``mse_grid_moving_average`` for batches).
    """

    name = "mse_grid"
    description = "Per-group shrink grid minimising |err|^2.4 (LC memoryless_mse), chunked tensor search"
    knobs = dict(_GRID_KNOBS)


@register
class MovingAverageMSEGridObserver(_GridBase):
    """``mse_grid`` on every batch, combined by an exponential moving average.

    Rule: the first batch's searched range is kept, later ones give ``m = (1 - c)·m + c·new`` with
    ``c = averaging_constant`` (default 0.01). Other knobs as ``mse_grid``.
    Reference: llm-compressor ``mse`` (MovingAverageMSEObserver).
    """

    name = "mse_grid_moving_average"
    description = "mse_grid per batch with an EMA of the ranges, averaging_constant 0.01 (LC mse)"
    knobs = {**_GRID_KNOBS, "averaging_constant": 0.01}

    def validate_knobs(self) -> None:
        super().validate_knobs()
        c = self.averaging_constant
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
            raise ValueError(f"averaging_constant must be in (0, 1], got {c!r}")

    def _combine(self, low, high):
        if self.min_val is None:
            return low, high
        c = float(self.averaging_constant)
        return self.min_val + c * (low - self.min_val), self.max_val + c * (high - self.max_val)


def importance_from_inputs(inputs: torch.Tensor) -> torch.Tensor:
    """Mean squared activation of each input column, (in,) fp32: the ``importance`` of ``imatrix_mse``.

    ``inputs`` are a layer's captured inputs ``(..., in)``; leading dims are tokens.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0 or inputs.numel() == 0:
        raise ValueError("importance_from_inputs needs a non-empty tensor of layer inputs (..., in)")
    return inputs.detach().reshape(-1, inputs.shape[-1]).float().square().mean(dim=0)


@register
class IMatrixMSEObserver(_GridBase):
    """``mse_grid`` for weights with each input column's error weighted by its importance.

    Rule: as ``mse_grid``, error ``Σ importance[col]·|fake_quant(w) - w|^norm`` per group, where
    ``importance`` (knob, shape ``(in,)``, e.g. ``importance_from_inputs(captured_inputs)``) is the
    mean squared input activation of each column. Without ``importance`` it warns and runs plain
    ``mse_grid``. Knobs: those of ``mse_grid`` plus ``importance`` (None).
    Reference: llm-compressor ``imatrix_mse``.
    """

    name = "imatrix_mse"
    description = "mse_grid with errors weighted by mean squared input activation per column (LC imatrix_mse)"
    kinds = ("weight",)
    knobs = {**_GRID_KNOBS, "importance": None}

    def validate_knobs(self) -> None:
        super().validate_knobs()
        imp = self.importance
        if imp is None:
            return
        if not isinstance(imp, torch.Tensor) or imp.ndim != 1 or not imp.dtype.is_floating_point:
            raise ValueError("importance must be a 1-D float tensor of shape (in,)")
        if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
            raise ValueError("importance must be finite and >= 0")

    def _error_weight(self, flat: Flat) -> torch.Tensor | None:
        if self.importance is None:
            warnings.warn("imatrix_mse got no importance; running plain mse_grid", stacklevel=4)
            return None
        weight_2d = self._weight_shape_2d
        columns = weight_2d[1]
        importance = self.importance.to(device=flat.data.device, dtype=torch.float32)
        if importance.numel() != columns:
            raise ValueError(
                f"importance has {importance.numel()} entries but the weight has {columns} input columns"
            )
        full = importance.reshape(1, -1).expand(weight_2d)
        return flatten(full, self.spec, "weight", g_idx=self._g_idx).data

    def observe(self, x: torch.Tensor, g_idx: torch.Tensor | None = None) -> None:
        if isinstance(x, torch.Tensor) and x.ndim >= 1:
            self._weight_shape_2d = tuple(as_2d(x, "weight").shape)
        super().observe(x, g_idx=g_idx)
