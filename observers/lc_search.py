"""llm-compressor's shrink-grid search as its newer observers run it, shared by the observers that copy it.

Two llm-compressor conventions that ``mse_grid`` does not follow are reproduced here:

- **NVFP4 is searched with free scales.** llm-compressor's grid searches drop the FP8 block-scale
  dtype of a ``tensor_group`` (NVFP4) scheme while they compare candidate ranges: each candidate
  is scored with a free fp32 scale ``amax / 6`` and no global scale, and only the chosen range
  goes through the NVFP4 rule (global scale, E4M3 block scales). ``free_scale_spec`` gives that
  search spec.
- **Errors are measured directly**, ``Σ w·|fake_quant(x) - x|^norm`` in fp32 per candidate, not in
  steps times ``s^norm`` as ``mse_grid_search`` does for speed. With FP4 elements two candidates
  whose scales differ by a factor of two often dequantize a block to the very same values; their
  errors are then equal and llm-compressor keeps the first. Measured in steps the two sums differ
  by rounding and either can win, so the NVFP4 searches here use the direct form.

``lc_grid_search`` evaluates the candidates in chunks (a few tensor ops over all groups per
chunk) and replays llm-compressor's sequential early stop over each chunk's errors. Int formats
on fp32 CPU data take the native kernel of ``observers.mse_kernel`` in its ``direct`` mode
(the same codes, dequantized values and exact powers for norms 1, 2 and 3; imatrix_mse on a
4096x4096 int4 g128 weight: ~0.1 s instead of ~2.3 s). Float element grids (FP4, FP6, FP8, NVFP4
searched as FP4 with free scales) on fp32 CPU data in one process take
``observers.float_grid_kernel.shrink_search`` in its direct mode, which runs the same loop and
early stop on the kernel's per-group picks without writing any candidate table
(``_native_float_search``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from observers import float_grid_kernel, mse_kernel
from observers.granularity import Flat, as_groups
from observers.pick import first_least
from observers.qparams import QParams, range_rule
from observers.quantize import element_codes
from observers.shared import Op, Reduce, part_min_max, shared_min_max
from observers.spec import QuantSpec


def free_scale_spec(spec: QuantSpec) -> QuantSpec:
    """The spec llm-compressor scores candidate ranges with: NVFP4 becomes FP4 E2M1 elements with
    free fp32 scales over the same blocks; every other spec is returned unchanged."""
    if spec.format.scale_kind == "e4m3":
        return spec.replace(dtype="fp4_e2m1", strategy="group", group_size=spec.group_size)
    return spec


def _candidate_errors(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    low: torch.Tensor,
    high: torch.Tensor,
    factors: torch.Tensor,
    spec: QuantSpec,
    norm: float,
) -> torch.Tensor:
    """``Σ weight·|fake_quant(x) - x|^norm`` over each group for every factor, ``(C, *qparam_shape)``."""
    shape = (-1, *([1] * low.ndim))
    qp = range_rule(low.unsqueeze(0) * factors.reshape(shape), high.unsqueeze(0) * factors.reshape(shape), spec)
    if spec.format.kind == "int":
        native = _native_errors(data, weight, qp, spec, norm)
        if native is not None:
            return native
    scale = qp.effective_scale.unsqueeze(1).unsqueeze(-1)
    zero_point = qp.zero_point.float().unsqueeze(1).unsqueeze(-1)
    codes = element_codes(data.unsqueeze(0), scale, zero_point, spec)
    dequantized = codes.sub_(zero_point).mul_(scale) if spec.format.kind == "int" else codes.mul_(scale)
    error = dequantized.sub_(data).abs_().pow_(norm)
    if weight is not None:
        error.mul_(weight)
    return error.sum(dim=(1, error.ndim - 1))


def _native_errors(
    data: torch.Tensor, weight: torch.Tensor | None, qp: QParams, spec: QuantSpec, norm: float
) -> torch.Tensor | None:
    """``_candidate_errors``' sums from the native kernel (int formats, errors measured directly:
    ``|(code - zp)·s - x|``, the same codes and dequantized values), or None when it cannot run.
    ``weight`` is full-size (``lc_grid_search`` lays it out once)."""
    count, groups = qp.scale.shape[0], data.shape[1:-1]
    step = qp.effective_scale.expand(count, *groups).reshape(count, -1)
    zero_point = qp.zero_point.float().expand(count, *groups).reshape(count, -1)
    qmin, qmax = spec.int_range
    rows = as_groups(data)
    errors = mse_kernel.candidate_errors(
        rows,
        None if weight is None else as_groups(weight),
        step,
        qmin - zero_point,
        qmax - zero_point,
        norm,
        direct=True,
    )
    return None if errors is None else errors.reshape(count, *groups)


def _replay_patience(
    errors: torch.Tensor, best: torch.Tensor, stale: torch.Tensor, patience: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential early stop over one chunk's errors ``(C, Q)`` after ``best`` ``(Q,)``, for
    the ``S`` searches side by side that ``stale`` ``(S,)`` counts (each over its own ``Q/S``
    consecutive groups; ``S`` 1: one search over all). Per search: the candidates the loop would
    evaluate, the stale count after them, whether it has stopped (a count that had reached
    ``patience`` before the chunk: stopped earlier, nothing more evaluated). A candidate improves a
    search when any of its groups' error is strictly below that group's best so far; ``patience``
    0 never stops. Whole-chunk tensor ops, no host read."""
    count, searches = errors.shape[0], stale.numel()
    previous = torch.cat([best.unsqueeze(0), errors[:-1]]).cummin(dim=0).values
    improved = (errors < previous).reshape(count, searches, -1).any(dim=2)
    index = torch.arange(count, device=errors.device).unsqueeze(1)
    last = torch.where(improved, index, -1).cummax(dim=0).values
    run = torch.where(last >= 0, index - last, stale + index + 1)
    if not patience:
        return torch.full_like(stale, count), run[-1], torch.zeros_like(stale, dtype=torch.bool)
    before = stale >= patience
    stop = torch.where(run >= patience, index, count).amin(dim=0)
    after = run.gather(0, stop.clamp(max=count - 1).unsqueeze(0)).squeeze(0)
    used = torch.where(before, 0, torch.where(stop < count, stop + 1, count))
    return used, torch.where(before, stale, after), before | (stop < count)


def replay_chunk(
    errors: torch.Tensor,
    factors: torch.Tensor,
    best: torch.Tensor,
    best_factor: torch.Tensor,
    stale: torch.Tensor,
    patience: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """llm-compressor's sequential loop over one chunk's errors ``(C, Q)`` of the candidate
    ``factors`` ``(C,)``, after each group's ``best`` error and ``best_factor`` ``(Q,)``, for the
    searches ``stale`` ``(S,)`` counts (``_replay_patience``): returns the new best errors and
    factors, the stale counts and whether every search has stopped. Each group keeps its first
    lowest error among the candidates its search evaluated (the argmin over ``[best, those
    candidates]``, the others read as +inf: its best unless a candidate is strictly lower, the
    first of tied candidates). Whole-chunk tensor ops, one host read."""
    used, stale, stopped = _replay_patience(errors, best, stale, patience)
    count, searches = errors.shape[0], stale.numel()
    evaluated = (torch.arange(count, device=errors.device).unsqueeze(1) < used).unsqueeze(2)
    read = torch.where(evaluated, errors.reshape(count, searches, -1), torch.inf).reshape(errors.shape)
    stacked = torch.cat([best.unsqueeze(0), read])
    pick = first_least(stacked, 0)
    chosen = torch.cat([torch.ones(1, dtype=factors.dtype, device=factors.device), factors])[pick]
    best_factor = torch.where(pick > 0, chosen, best_factor)
    return stacked.gather(0, pick.unsqueeze(0)).squeeze(0), best_factor, stale, bool(stopped.all())


def _native_float_search(
    flat: Flat,
    spec: QuantSpec,
    low: torch.Tensor,
    high: torch.Tensor,
    factors: list[float],
    norm: float,
    patience: int,
    weight: torch.Tensor | None,
) -> torch.Tensor | None:
    """Each group's kept factor from ``float_grid_kernel.shrink_search`` (float element grids), or
    None when the kernel does not take the data.

    The same candidates and steps: free fp32 scales as a rule the kernel evaluates (``max(p·amax /
    max, eps)`` in the fp32 operations of ``calculate_qparams``, since ``max(-p·low, p·high) =
    p·max(-low, high)`` exactly for ``p > 0``), other scale rules (MX's powers of two) as each
    chunk's ``(C, Q)`` steps from the very ``range_rule`` call of ``_candidate_errors``.
    Errors ``Σ weight·|grid(x/s)·s - x|^norm`` with the eager codes and dequantized values,
    llm-compressor's early stop, each group's first lowest error. ``weight`` already carries the
    padding mask of ragged groups.
    """
    fmt = spec.format
    if fmt.kind != "float" or flat.data.device.type != "cpu":
        return None
    rows = as_groups(flat.data)
    if weight is not None:
        weight = as_groups(weight, flat.data.shape)
    if not float_grid_kernel.pickable(rows, weight, fmt):
        return None
    amax = torch.maximum(torch.neg(low), high).reshape(-1)

    def steps(chunk: list[float]) -> torch.Tensor | float_grid_kernel.StepRule:
        p = torch.tensor(chunk, dtype=torch.float32)
        if fmt.scale_kind == "float":
            return float_grid_kernel.StepRule("free", amax, p, fmt.max_value, spec.eps)
        shape = (-1, *([1] * low.ndim))
        qp = range_rule(low.unsqueeze(0) * p.reshape(shape), high.unsqueeze(0) * p.reshape(shape), spec)
        return qp.effective_scale.expand(len(chunk), *low.shape).reshape(len(chunk), -1)

    return float_grid_kernel.shrink_search(rows, weight, fmt, factors, steps, norm, patience, direct=True)


def each_apart(
    flat: Flat,
    apart: int,
    weight: torch.Tensor | None,
    search: Callable[[Flat, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``search(part, part_weight)`` of each of the ``apart`` weights stacked in a weight's ``flat``
    (``(1, rows, …)``, cut into equal runs of rows, its error ``weight`` with it), as if alone; the
    ranges stacked back."""
    rows = flat.data.shape[1]
    if apart < 1 or rows % apart:
        raise ValueError(f"{rows} rows do not split into {apart} stacked weights of equal rows")
    size = rows // apart

    def cut(values: torch.Tensor | None, i: int) -> torch.Tensor | None:
        if values is None or values.ndim < 2 or values.shape[1] != rows:
            return values
        return values[:, i * size : (i + 1) * size]

    shape = (size, *flat.qparam_shape[1:])
    found = [
        search(Flat(cut(flat.data, i), cut(flat.valid, i), shape, flat.restore), cut(weight, i)) for i in range(apart)
    ]
    return torch.cat([low for low, _ in found]), torch.cat([high for _, high in found])


def lc_grid_search(
    flat: Flat,
    spec: QuantSpec,
    factors: list[float],
    norm: float,
    patience: int,
    expand: float,
    max_working_bytes: int,
    weight: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    apart: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ``(min, max)``: llm-compressor's loop over ``p`` in ``factors`` from
    ``expand·(min, max)``, each group keeping its first lowest error, stopped after ``patience``
    candidates that improved no group (0: never). ``weight`` (broadcastable to ``flat.data``)
    weighs each element's error; padding of ragged groups counts zero. With ``reduce`` the batch is
    split between ranks and the range and every candidate's errors are agreed before the pick.
    ``apart``: the weight's rows are that many weights stacked, each searched as if alone (its own
    early stop, ``each_apart``).
    """
    if apart > 1 and spec.format.kind == "float":  # the native kernel stops once for all it reads
        return each_apart(
            flat,
            apart,
            weight,
            lambda part, w: lc_grid_search(part, spec, factors, norm, patience, expand, max_working_bytes, w, reduce),
        )
    low, high = shared_min_max(*part_min_max(flat), reduce)
    low, high = low * expand, high * expand
    if flat.valid is not None:
        weight = flat.valid.float() if weight is None else weight * flat.valid
    if reduce is None:
        native = _native_float_search(flat, spec, low, high, factors, norm, patience, weight)
        if native is not None:
            native = native.reshape(low.shape)
            return low * native, high * native
    data = flat.data.float()
    candidates = torch.tensor(factors, dtype=torch.float32, device=low.device)
    if spec.format.kind == "int" and mse_kernel.usable(as_groups(data), None):
        chunk = mse_kernel.chunk_size(len(factors), patience)
        weight = None if weight is None else weight.float().expand(data.shape).contiguous()
    else:
        chunk = max(1, min(len(factors), max_working_bytes // max(1, data.numel() * 8)))
    if reduce is not None:  # every rank must run the same chunks: the errors are summed per chunk
        chunk = int(reduce(torch.tensor([chunk], device=low.device), Op.MIN))
    best = torch.full(low.shape, torch.finfo(torch.float32).max, device=low.device).reshape(-1)
    best_factor = torch.ones_like(best)
    stale = torch.zeros(apart, dtype=torch.int64, device=low.device)
    for first in range(0, len(factors), chunk):
        part = candidates[first : first + chunk]
        errors = _candidate_errors(data, weight, low, high, part, spec, norm).reshape(len(part), -1)
        if reduce is not None:
            errors = reduce(errors, Op.SUM)
        errors = torch.nan_to_num(errors, nan=torch.inf)
        best, best_factor, stale, stopped = replay_chunk(errors, part, best, best_factor, stale, patience)
        if stopped:
            break
    best_factor = best_factor.reshape(low.shape)
    return low * best_factor, high * best_factor
