"""Shrink-grid MSE search per qparam group (llm-compressor's ``memoryless_mse`` / ``mse``).

The search runs on the flattened view ``(num_observations, *qparam_shape, group)`` for every
granularity, and goes through ``calculate_qparams`` and the element rounding of
``observers.quantize``, so any format whose range -> qparams rule is registered there (block
formats included: for MX, shrinking the range chooses among power-of-two exponents) is searched
the same way.

Errors are measured in steps: an element's error is ``|code - x/s|`` (``x/s`` is the division
``fake_quantize`` does, so the codes are identical) and each group's sum is multiplied by
``s^norm`` (``torch.pow``: a fp32 ``exp(norm·log s)`` is ~1e-6 off for small steps, a systematic
error per candidate that flips near-tie groups).

Speed (CPU, 4096x4096 int4 g128, 2 AVX-512 cores: ~110 ms, ~35x llm-compressor's loop, ~6x one
clone of the weight; the eager path ~330 ms): int formats on fp32 CPU data go through the native
kernel of ``observers.mse_kernel``, which reads each piece of the data once per chunk of
candidates and evaluates them all while it sits in L1, with vectorized log2/exp2; float elements
(FP8, FP6, FP4, MXFP, NVFP4) go through its sibling ``observers.float_grid_kernel`` (the same
codes as ``round_to_float_grid_``). CUDA tensors and ``kernels.disabled()`` take the eager path,
with ``|e|^norm`` as ``exp(norm·log|e|)`` because ``torch.pow`` with a fractional exponent is a
scalar libm call per element. On CPU it walks the data in cache-sized blocks, each through all
candidates of a chunk, and replays the early stop after each chunk candidate by candidate
(``_replay``); off the CPU (``_vectorized``), where each op is a kernel launch and each ``bool``
a host sync, a chunk is one pass over the whole data (within ``max_working_bytes``) and the replay
is a few tensor ops (``_replay_vectorized``). Either way the chunk sizes (``_chunk_size``) change
the work, never the result. Either path's sums differ
from the sequential loop's by a few ulps, which can only flip a group whose best two candidates
tie to ~1e-6 relative: on the benchmark weight 1 group in 131072 differs from llm-compressor
(both follow its rule; the tests' cases agree exactly, and native and eager agree on >= 99.9 %).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from observers import float_grid_kernel, mse_kernel
from observers.base import Observer, register
from observers.blocks import E4M3_MAX, NVFP4_MAX_TENSOR_AMAX, _amax, e4m3_block_scales
from observers.formats import round_to_float_grid_
from observers.granularity import Flat, all_finite, as_2d, as_groups, flatten
from observers.knobs import Knob
from observers.lc_search import each_apart, free_scale_spec, lc_grid_search, replay_chunk
from observers.minmax import AVERAGING_CONSTANT
from observers.qparams import range_rule
from observers.quantize import element_codes
from observers.shared import EXACT_GRID, Op, Reduce, part_min_max, shared_min_max
from observers.spec import QuantSpec
from observers.vocab import ObserverKind

DEFAULT_WORKING_BYTES = 1 << 28
_BLOCK_ELEMENTS = 1 << 18

MAX_WORKING_BYTES = Knob(
    DEFAULT_WORKING_BYTES,
    int,
    low=1,
    doc="Bytes of candidate errors computed at once: a memory/speed trade-off, results do not depend on it",
)
"""The memory knob, shared with the histogram ``mse`` observer."""


def fake_quant_batched(
    data: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Fake-quantize ``data`` with qparams that broadcast against it (e.g. a leading candidate dim).

    The same element rounding as ``observers.quantize.fake_quantize``; fp32 result.
    """
    codes = element_codes(data, scale, zero_point, spec)
    if spec.format.kind == "int":
        return codes.sub_(zero_point).mul_(scale)
    return codes.mul_(scale)


def shrink_factors(maxshrink: float, grid: float) -> list[float]:
    """LC's candidates ``p = 1 - i/grid`` for ``i < int(maxshrink·grid)``, in search order."""
    return [1 - i / grid for i in range(int(maxshrink * grid))]


def _candidate_steps(
    base_min: torch.Tensor, base_max: torch.Tensor, factors: list[float], spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step and integer code bounds of each candidate, each (C, Q) for Q = number of groups, every
    candidate in one pass.

    The range rules are elementwise per group (the fp32 scale, MX's E8M0 and BFP's power-of-two
    exponents), so one call over a leading candidate axis gives each candidate's steps, except
    NVFP4's, whose global scale comes from each candidate's tensor amax (``_nvfp4_candidate_steps``).
    The bounds are ``qmin - zero_point`` and ``qmax - zero_point``: codes measured from the zero
    point, so ``clamp(round(x/s) + zp, qmin, qmax) - zp == clamp(round(x/s), low, high)`` exactly.
    """
    count = len(factors)
    shape = (count, *base_min.shape)
    if spec.format.scale_kind == "e4m3":
        steps = _nvfp4_candidate_steps(base_min, base_max, factors, spec)
        zero_points = torch.zeros_like(steps)
    else:
        p = torch.tensor(factors, dtype=torch.float32, device=base_min.device).reshape(count, *[1] * base_min.ndim)
        qp = range_rule(base_min * p, base_max * p, spec)
        steps = qp.effective_scale.expand(shape).reshape(count, -1)
        zero_points = qp.zero_point.expand(shape).reshape(count, -1).float()
    qmin, qmax = spec.int_range if spec.format.kind == "int" else (0, 0)
    return steps.float(), qmin - zero_points, qmax - zero_points


def _nvfp4_candidate_steps(
    base_min: torch.Tensor, base_max: torch.Tensor, factors: list[float], spec: QuantSpec
) -> torch.Tensor:
    """NVFP4's ``(C, Q)`` element steps, every candidate in one pass: the rule of
    ``blocks.e4m3_qparams`` (a global scale per candidate from its tensor amax, E4M3 block scales)
    written out over a leading candidate axis with the very same fp32 operations, so the steps are
    bit for bit those of one ``calculate_qparams`` call per candidate (tests check it)."""
    count = len(factors)
    p = torch.tensor(factors, dtype=torch.float32, device=base_min.device).reshape(count, *[1] * base_min.ndim)
    fmt = spec.format
    amax = _amax(base_min * p, base_max * p).reshape(count, -1)
    tensor_amax = amax.amax(dim=1, keepdim=True).clamp(min=spec.eps, max=NVFP4_MAX_TENSOR_AMAX)
    global_scale = E4M3_MAX * fmt.max_value / tensor_amax
    return e4m3_block_scales(amax, global_scale, fmt.max_value) / global_scale


def _float_candidate_rule(
    base_min: torch.Tensor, base_max: torch.Tensor, factors: list[float], spec: QuantSpec, norm: float
) -> torch.Tensor | float_grid_kernel.StepRule:
    """What ``float_grid_kernel.shrink_search`` reads for a chunk: NVFP4's rule for the kernel to
    compute (the block amaxes ``p·amax`` exactly, as in ``_nvfp4_candidate_steps``; per candidate the
    global scale of ``e4m3_qparams`` and ``s^norm`` for each E4M3 code, the same ``torch.pow`` of the
    same step values the eager path multiplies by), else the ``(C, Q)`` steps."""
    if spec.format.scale_kind != "e4m3":
        return _candidate_steps(base_min, base_max, factors, spec)[0]
    fmt = spec.format
    count = len(factors)
    p = torch.tensor(factors, dtype=torch.float32, device=base_min.device)
    amax = _amax(base_min, base_max).reshape(-1)
    tensor_amax = (amax.amax() * p).reshape(count, 1).clamp(min=spec.eps, max=NVFP4_MAX_TENSOR_AMAX)
    global_scale = E4M3_MAX * fmt.max_value / tensor_amax
    codes = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().reshape(1, 128)
    power = (codes / global_scale).pow(norm)
    return float_grid_kernel.StepRule("e4m3", amax, p, fmt.max_value, global_scale=global_scale, power=power)


def _blocks(observations: int, groups: int, group: int, elements: int) -> Iterator[tuple[slice, slice, slice]]:
    """Slices (observations, groups, group elements) of about ``elements`` each covering (N, Q, K).

    Whole groups when a group fits (the common case: no partial sums), else runs of observations
    of one group, else runs of one observation's elements.
    """
    everything = slice(None)
    if observations * group == 0:  # an empty part of a split batch: nothing to add
        return
    if observations * group <= elements:
        per_block = elements // (observations * group)
        for start in range(0, groups, per_block):
            yield everything, slice(start, start + per_block), everything
        return
    for q in range(groups):
        if group <= elements:
            per_block = elements // group
            for start in range(0, observations, per_block):
                yield slice(start, start + per_block), slice(q, q + 1), everything
        else:
            for n in range(observations):
                for start in range(0, group, elements):
                    yield slice(n, n + 1), slice(q, q + 1), slice(start, start + elements)


def _uniform_or(bounds: torch.Tensor) -> torch.Tensor | float:
    """A single float when every entry is equal (symmetric formats): a scalar clamp is ~10x cheaper."""
    first = bounds.reshape(-1)[0]
    return float(first) if bool((bounds == first).all()) else bounds


def _power_(values: torch.Tensor, norm: float) -> torch.Tensor:
    """``values ** norm`` in place for values >= 0: exact for norm 1 and 2, else ``exp(norm·log v)``.

    ``torch.pow`` with a fractional exponent runs a scalar libm call per element on CPU (about 4x
    the cost of the three vectorized passes here); the two agree to a few fp32 ulps.
    """
    if norm == 1:
        return values
    if norm == 2:
        return values.square_()
    return values.log_().mul_(norm).exp_()


def _unit_errors(
    block: torch.Tensor,
    weight: torch.Tensor | None,
    step: torch.Tensor,
    low: torch.Tensor | float,
    high: torch.Tensor | float,
    spec: QuantSpec,
    norm: float,
) -> torch.Tensor:
    """``Σ weight·|code - x/s|^norm`` per group for each candidate of one block, (C, groups of the block).

    ``block`` is (1, n, q, k), ``step``/``low``/``high`` are (C, 1, q, 1). The error of an element
    is measured in steps: ``|fake_quant(x) - x| = s·|code - x/s|``, with ``code`` the element's
    code minus the zero point (ints) or its grid value in steps (floats); the caller multiplies
    each group's sum by ``s^norm``. ``x/s`` is the same division as ``fake_quantize``, so the
    codes are those of ``fake_quantize``.
    """
    scaled = block / step
    if spec.format.kind == "int":
        codes = torch.round(scaled).clamp_(low, high)
    else:
        fmt = spec.format
        codes = round_to_float_grid_(scaled.clone(), fmt.exp_bits, fmt.man_bits, fmt.max_value)
    err = _power_(codes.sub_(scaled).abs_(), norm)
    if weight is not None:
        err.mul_(weight)
    return err.sum(dim=(1, 3))


def _vectorized(data: torch.Tensor) -> bool:
    """Whether the eager search runs each chunk as a few whole-tensor passes (off the CPU) rather
    than cache-sized blocks and a per-candidate replay (CPU). On a GPU every torch op is a kernel
    launch and every ``bool`` a host sync, so a Python loop over blocks or candidates would cost
    thousands of each; on CPU the blocks keep the candidate buffers in cache and the per-candidate
    replay is cheaper than scans along the short candidate axis."""
    return data.device.type != "cpu"


def _block_elements(count: int, working_bytes: int, vectorized: bool) -> int:
    """Data elements per block of a chunk of ``count`` candidates: about ``_BLOCK_ELEMENTS`` of
    candidate values on CPU (cache-sized), else what ``working_bytes`` holds at 8 bytes per element
    and candidate (the scaled values and their codes), so the whole data is one block whenever
    ``_chunk_size`` fitted the chunk into the budget, and blocks only when one candidate cannot."""
    if vectorized:
        return max(1, working_bytes // (8 * count))
    return max(1, _BLOCK_ELEMENTS // count)


def _chunk_errors(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    base_min: torch.Tensor,
    base_max: torch.Tensor,
    factors: list[float],
    spec: QuantSpec,
    norm: float,
    working_bytes: int,
    vectorized: bool,
) -> torch.Tensor:
    """``Σ weight·|fake_quant(x) - x|^norm`` per group for each factor, (C, Q).

    ``data`` and ``weight`` are (N, Q, K). Int formats go through ``mse_kernel`` when it runs,
    float grids through ``float_grid_kernel``; otherwise the data is walked in blocks
    (``_block_elements``), each through every candidate of the chunk at once, so each element is
    read from memory once per chunk. ``vectorized`` (``_vectorized``) also keeps the code bounds as
    tensors: ``_uniform_or``'s scalar clamp pays off on CPU but costs a host sync.
    """
    count = len(factors)
    observations, groups, group = data.shape
    step, low, high = _candidate_steps(base_min, base_max, factors, spec)
    if spec.format.kind == "int":
        native = mse_kernel.candidate_errors(data, weight, step, low, high, norm)
    else:
        native = float_grid_kernel.candidate_errors(data, weight, step, spec.format, norm)
    if native is not None:
        return native.mul_(step.pow_(norm))
    shape = (count, 1, groups, 1)
    step, low, high = step.reshape(shape), low.reshape(shape), high.reshape(shape)
    if not vectorized:
        low, high = _uniform_or(low), _uniform_or(high)
    errors = torch.zeros(count, groups, dtype=torch.float32, device=data.device)
    for n, q, k in _blocks(observations, groups, group, _block_elements(count, working_bytes, vectorized)):
        block_weight = None if weight is None else weight[n, q, k].unsqueeze(0)
        block_low = low if isinstance(low, float) else low[:, :, q]
        block_high = high if isinstance(high, float) else high[:, :, q]
        errors[:, q].add_(
            _unit_errors(data[n, q, k].unsqueeze(0), block_weight, step[:, :, q], block_low, block_high, spec, norm)
        )
    return errors.mul_(step.reshape(count, groups).pow_(norm))


def _replay(
    errors: torch.Tensor,
    factors: list[float],
    best: torch.Tensor,
    best_factor: torch.Tensor,
    stale: int,
    patience: int,
) -> tuple[int, bool]:
    """The sequential loop over one chunk's candidate errors (C, Q), after ``best`` and ``best_factor`` (Q,).

    A candidate "improves" when any group's error is strictly below that group's best so far; each
    group keeps its first lowest error; the loop stops once ``patience`` consecutive candidates
    improved nothing. Updates ``best`` and ``best_factor`` in place; returns the stale count and
    whether it stopped. Five float passes over Q values per candidate (errors are never NaN here
    and ``best`` stays finite, so ``best - candidate > 0`` is exactly ``candidate < best``; ``lerp``
    with weights 0 and 1 selects exactly, torch computing ``end - (end - self)·(1 - w)`` for
    ``w >= 0.5``): several times cheaper on CPU than boolean masks or scans along the short C axis,
    but a host sync per candidate.
    """
    for candidate, factor in zip(errors, factors, strict=True):
        gain = best - candidate
        if bool(gain.max() > 0):
            best_factor.lerp_(torch.tensor(factor, dtype=best_factor.dtype, device=best.device), gain.gt_(0))
            torch.minimum(best, candidate, out=best)
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                return stale, True
    return stale, False


def _replay_vectorized(
    errors: torch.Tensor,
    factors: list[float],
    best: torch.Tensor,
    best_factor: torch.Tensor,
    stale: int | torch.Tensor,
    patience: int,
) -> tuple[int | torch.Tensor, bool]:
    """``_replay`` in whole-chunk tensor ops (``lc_search.replay_chunk``, one host read per chunk),
    for devices where a per-candidate sync is the cost, and for weights stacked apart: the same
    in-place updates and result, the stale count one per search when given so (``(S,)``)."""
    candidates = torch.tensor(factors, dtype=best_factor.dtype, device=best.device)
    counts = torch.as_tensor(stale, dtype=torch.int64, device=best.device).reshape(-1)
    kept, kept_factor, counts, stopped = replay_chunk(errors, candidates, best, best_factor, counts, patience)
    best.copy_(kept)
    best_factor.copy_(kept_factor)
    return (int(counts) if isinstance(stale, int) else counts), stopped


def _chunk_size(
    data: torch.Tensor, weight: torch.Tensor | None, spec: QuantSpec, count: int, patience: int, working_bytes: int
) -> int:
    """Candidates per chunk (between early-stop checks) for ``(N, Q, K)`` data: as many as fit
    ``working_bytes`` of candidate errors on the eager path, ``mse_kernel.chunk_size`` on the
    native ones (int and float grids; neither needs buffers)."""
    if spec.format.kind == "int" and mse_kernel.usable(data, weight):
        return mse_kernel.chunk_size(count, patience)
    if float_grid_kernel.usable(data, weight, spec.format):
        return mse_kernel.chunk_size(count, patience)
    return max(1, min(count, working_bytes // max(1, data.numel() * 8)))


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
    reduce: Reduce | None = None,
    apart: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ``(min, max)`` minimising ``Σ weight·|fake_quant(x) - x|^norm`` over LC's shrink grid.

    Identical to this sequential loop (llm-compressor ``_grid_search_mse``): start from
    ``expand·(min, max)``; for ``p = 1 - i/grid``, ``i < int(maxshrink·grid)``, scale both ends by
    ``p``; each group keeps the first candidate with its lowest error; stop after ``patience``
    consecutive candidates that improved no group. Here candidates run in chunks (``_chunk_size``:
    about ``max_working_bytes / (8·elements)`` on the eager path) and the early-stop rule is
    replayed over each chunk's errors, so the result equals the sequential loop's up to the few-ulp
    differences of the error sums described in the module docstring. ``weight`` (broadcastable to
    ``flat.data``) weighs each element's error; padding of ragged groups is excluded.
    With ``reduce`` the batch is split between ranks (``observers.shared``): the start range
    and the chunking are agreed and each candidate's errors are summed over the ranks before the
    early-stop rule and the pick, so every rank makes the same choice.
    ``apart``: the weight's rows are that many weights stacked, each searched as if alone (its own
    early stop: the replay's stale count one per weight; float grids, whose native kernel stops
    once for all it reads, search each weight's rows in turn, ``lc_search.each_apart``).
    """
    if apart > 1 and spec.format.kind == "float":
        knobs = (maxshrink, grid, patience, norm, expand, max_working_bytes)
        return each_apart(flat, apart, weight, lambda part, w: mse_grid_search(part, spec, *knobs, w, reduce))
    low, high = shared_min_max(*part_min_max(flat), reduce)
    base_min, base_max = low * expand, high * expand
    if flat.valid is not None:
        weight = flat.valid.float() if weight is None else weight * flat.valid
    data = as_groups(flat.data)
    if weight is not None:
        weight = as_groups(weight, flat.data.shape)
    factors = shrink_factors(maxshrink, grid)
    if reduce is None and spec.format.kind == "float" and spec.format.scale_kind in ("float", "e4m3"):
        picked = float_grid_kernel.shrink_search(
            data,
            weight,
            spec.format,
            factors,
            lambda chunk: _float_candidate_rule(base_min, base_max, chunk, spec, norm),
            norm,
            patience,
            direct=False,
        )
        if picked is not None:
            best_factor = picked.reshape(base_min.shape)
            return base_min * best_factor, base_max * best_factor
    chunk = _chunk_size(data, weight, spec, len(factors), patience, max_working_bytes)
    if reduce is not None:
        chunk = int(reduce(torch.tensor([chunk], device=data.device), Op.MIN))
    best = torch.full((data.shape[1],), torch.finfo(torch.float32).max, device=data.device)
    best_factor = torch.ones_like(best)
    vectorized = _vectorized(data)
    replay = _replay_vectorized if vectorized or apart > 1 else _replay
    stale = torch.zeros(apart, dtype=torch.int64, device=data.device) if replay is _replay_vectorized else 0
    for first in range(0, len(factors), chunk):
        chunk_factors = factors[first : first + chunk]
        errors = _chunk_errors(
            data, weight, base_min, base_max, chunk_factors, spec, norm, max_working_bytes, vectorized
        )
        if reduce is not None:
            errors = reduce(errors, Op.SUM)
        errors.nan_to_num_(nan=torch.inf)
        stale, stopped = replay(errors, chunk_factors, best, best_factor, stale, patience)
        if stopped:
            break
    best_factor = best_factor.reshape(base_min.shape)
    return base_min * best_factor, base_max * best_factor


_GRID_KNOBS = {
    "maxshrink": Knob(
        0.2,
        float,
        low=0,
        high=1,
        low_open=True,
        doc="Largest shrink tried: both range ends times p = 1 - i/grid for i < int(maxshrink·grid)",
    ),
    "grid": Knob(100.0, float, low=0, low_open=True, doc="Shrink grid resolution: p steps by 1/grid"),
    "patience": Knob(5, int, low=1, doc="Stop after this many consecutive candidates that improved no group"),
    "norm": Knob(2.4, float, low=0, low_open=True, doc="Exponent of the error Σ|fake_quant(x) - x|^norm"),
    "expand": Knob(1.0, float, low=1, doc="Start from expand·(min, max) before shrinking"),
    "max_working_bytes": MAX_WORKING_BYTES,
}


class _GridBase(Observer):
    shares_statistics = True
    merge_rule = EXACT_GRID

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        if int(self.maxshrink * self.grid) < 1:
            raise ValueError(f"maxshrink·grid = {self.maxshrink * self.grid} gives no candidate; it must be >= 1")

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
            reduce=self._across,
            apart=self._apart,
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
    ``max_working_bytes`` 256 MiB (on the eager path, how many candidates run between early-stop
    checks, about ``max_working_bytes / (8·elements)``; memory stays a few cache-sized blocks;
    results do not depend on it).
    Reference: llm-compressor ``memoryless_mse`` (same candidates and stop rule, so the scales
    agree); differs in evaluating all candidates of a chunk per read of the data (a native kernel
    for int formats, cache-sized blocks otherwise) instead of a Python loop over full-tensor passes,
    and in computing errors in steps with ``|e|^norm`` from ``log``/``exp`` (module docstring).
    Works for every granularity and every format ``calculate_qparams`` knows, block formats too.
    Memoryless: each ``observe`` replaces the range (use ``mse_grid_moving_average`` for batches).
    """

    name = "mse_grid"
    description = "Per-group shrink grid minimising |err|^2.4 (LC memoryless_mse), every candidate per read"
    knobs = dict(_GRID_KNOBS)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._last: Flat | None = None

    def _reset_statistics(self) -> None:
        super()._reset_statistics()
        self._last = None

    def _observe(self, flat: Flat) -> None:
        """Only the last batch counts, so its search waits for ``qparams`` (a calibration stream's
        earlier batches cost nothing); a batch split between ranks is searched at once, since the
        ranks reduce its candidates' errors in step."""
        if self._across is None:
            self._last = flat
            return
        self._last = None
        super()._observe(flat)

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is not None:
            last, self._last = self._last, None
            super()._observe(last)
        return self.min_val, self.max_val


@register
class MovingAverageMSEGridObserver(_GridBase):
    """``mse_grid`` on every batch, combined by an exponential moving average.

    Rule: the first batch's searched range is kept, later ones give ``m = (1 - c)·m + c·new`` with
    ``c = averaging_constant`` (default 0.01). Other knobs as ``mse_grid``.
    Reference: llm-compressor ``mse`` (MovingAverageMSEObserver).
    """

    name = "mse_grid_moving_average"
    description = "mse_grid per batch with an EMA of the ranges, averaging_constant 0.01 (LC mse)"
    knobs = {**_GRID_KNOBS, "averaging_constant": AVERAGING_CONSTANT}
    once_as = "mse_grid"
    combining_knobs = ("averaging_constant",)

    def _combine(self, low, high):
        if self.min_val is None:
            return low, high
        c = float(self.averaging_constant)
        return self.min_val + c * (low - self.min_val), self.max_val + c * (high - self.max_val)


@register
class IMatrixMSEObserver(_GridBase):
    """``mse_grid`` for weights with each input column's error weighted by its importance.

    Rule (llm-compressor 0.14 ``imatrix_mse``): start at ``expand·(min, max)``; try
    ``p = 1 - i/grid`` for ``i = 0 .. max(1, int(maxshrink·grid))`` (one candidate more than
    ``mse_grid``'s loop); error ``Σ imp[col]·|fake_quant(w) - w|^norm`` per group with
    ``imp = importance / mean(importance)``; each group keeps its best (first on ties); stop after
    ``patience`` consecutive candidates that improved no group (``patience`` 0: never).
    ``importance`` is the mean squared input activation per input column: the knob when given
    (e.g. ``observers.column_importance(captured_inputs)``, what the lab passes), else what
    ``observe_inputs(x)`` collected (sum of squares and token count in fp32, as llm-compressor's
    forward hook does); without either, or when it is all zero, it warns and runs unweighted.
    Weights stacked and observed apart (``observe(x, apart=n)``) may each have their own: an
    ``(n, in)`` knob, row ``i`` weighting weight ``i`` as it would alone.
    NVFP4 candidates are scored with free fp32 scales as llm-compressor does
    (``observers.lc_search``); the chosen range then goes through the NVFP4 rule.
    Knobs: ``maxshrink`` 0.95, ``grid`` 20, ``patience`` 5, ``norm`` 3.0 (llm-compressor 0.14's
    defaults), ``expand`` 1.0, ``max_working_bytes``, ``importance`` (None).
    Reference: llm-compressor 0.14 ``imatrix_mse`` (IMatrixMSEObserver). Unlike it, ``tensor`` and
    ``block`` strategies are weighted too (llm-compressor falls back to unweighted there).
    """

    name = "imatrix_mse"
    description = "Shrink grid weighted by mean squared input per column, 0.95/20/norm 3 (LC 0.14 imatrix_mse)"
    kinds = (ObserverKind.WEIGHT,)
    knobs = {
        **_GRID_KNOBS,
        "maxshrink": Knob(
            0.95, float, low=0, high=1, doc="Largest shrink: p = 1 - i/grid for i = 0 .. max(1, int(maxshrink·grid))"
        ),
        "grid": Knob(20.0, float, low=0, low_open=True, doc="Shrink grid resolution: p steps by 1/grid"),
        "patience": Knob(
            5, int, low=0, doc="Stop after this many consecutive candidates that improved no group; 0 never stops"
        ),
        "norm": Knob(3.0, float, low=0, low_open=True, doc="Exponent of the error Σ imp·|fake_quant(x) - x|^norm"),
        "importance": Knob(
            None,
            torch.Tensor,
            optional=True,
            editable=False,
            expects="a float tensor of shape (in,), or (n, in) for n weights observed apart",
            doc="Error weight per input column, e.g. observers.column_importance(inputs); None uses observe_inputs",
        ),
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._input_square_sum: torch.Tensor | None = None
        self._input_count = 0

    def validate_knobs(self) -> None:
        """The tensor's rank, dtype and values (its length is checked against the weight in ``observe``)."""
        imp = self.importance
        if imp is None:
            return
        if imp.ndim not in (1, 2) or not imp.dtype.is_floating_point:
            raise ValueError(
                "importance must be a float tensor of shape (in,), or (n, in) for n weights observed apart, "
                f"got shape {tuple(imp.shape)} {imp.dtype}"
            )
        if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
            raise ValueError("importance must be finite and >= 0")

    def observe_inputs(self, x: torch.Tensor) -> None:
        """Collect importance from one batch of the layer's inputs ``(..., in)``: ``Σ x²`` per
        column and the token count, in fp32, the statistic llm-compressor's forward hook keeps
        (so several batches give the mean over all their tokens)."""
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.numel() == 0 or not x.dtype.is_floating_point:
            raise ValueError("observe_inputs needs a non-empty floating-point tensor shaped (..., in_features)")
        if not all_finite(x):
            raise ValueError(f"observe_inputs got {int((~torch.isfinite(x)).sum())} non-finite value(s)")
        values = x.detach().float()
        square_sum = values.pow(2).sum(dim=list(range(values.ndim - 1)))
        if self._input_square_sum is not None and self._input_square_sum.shape != square_sum.shape:
            raise ValueError(
                f"observe_inputs got {square_sum.numel()} columns after {self._input_square_sum.numel()} before"
            )
        self._input_square_sum = square_sum if self._input_square_sum is None else self._input_square_sum + square_sum
        self._input_count += values.numel() // values.shape[-1]

    def _importance(self) -> torch.Tensor | None:
        if self.importance is not None:
            return self.importance
        if self._input_square_sum is None:
            return None
        return self._input_square_sum / float(self._input_count)

    def _error_weight(self, flat: Flat) -> torch.Tensor | None:
        importance = self._importance()
        if importance is not None and importance.ndim == 2:
            return self._error_weight_apart(importance, flat)
        if importance is None or not bool((importance > 0).any()):
            warnings.warn(f"{self.name} got no importance (or only zeros); running unweighted", stacklevel=4)
            return None
        weight_2d = self._weight_shape_2d
        columns = weight_2d[1]
        importance = importance.to(device=flat.data.device, dtype=torch.float32)
        if importance.numel() != columns:
            raise ValueError(f"importance has {importance.numel()} entries but the weight has {columns} input columns")
        importance = importance / (importance.mean() + torch.finfo(torch.float32).tiny)
        full = importance.reshape(1, -1).expand(weight_2d)
        return flatten(full, self.spec, "weight", g_idx=self._g_idx).data

    def _error_weight_apart(self, importance: torch.Tensor, flat: Flat) -> torch.Tensor:
        """The error weight of ``n`` stacked weights, row ``i`` of ``importance`` ``(n, in)`` over
        weight ``i``'s rows, each normalized by its own mean as alone; a weight whose row has no
        positive value is weighted by ones (unweighted, the same sums), with the warning alone gives."""
        rows, columns = self._weight_shape_2d
        if tuple(importance.shape) != (self._apart, columns):
            raise ValueError(
                f"importance of shape {tuple(importance.shape)} needs one row per weight observed apart "
                f"({self._apart}) and one column per input column ({columns})"
            )
        importance = importance.to(device=flat.data.device, dtype=torch.float32)
        unweighted = ~(importance > 0).any(dim=1, keepdim=True)
        if bool(unweighted.any()):
            warnings.warn(
                f"{self.name} got no importance (or only zeros) for some weights; those run unweighted", stacklevel=4
            )
            importance = torch.where(unweighted, torch.ones_like(importance), importance)
        importance = importance / (importance.mean(dim=1, keepdim=True) + torch.finfo(torch.float32).tiny)
        full = importance.repeat_interleave(rows // self._apart, dim=0)
        return flatten(full, self.spec, "weight", g_idx=self._g_idx).data

    def _observe(self, flat: Flat) -> None:
        """llm-compressor's imatrix loop: ``max(1, int(maxshrink·grid)) + 1`` candidates, errors
        measured directly (``observers.lc_search``)."""
        count = max(1, int(self.maxshrink * self.grid)) + 1
        self.min_val, self.max_val = lc_grid_search(
            flat,
            free_scale_spec(self.spec),
            [1 - i / self.grid for i in range(count)],
            self.norm,
            self.patience,
            self.expand,
            self.max_working_bytes,
            weight=self._error_weight(flat),
            reduce=self._across,
            apart=self._apart,
        )

    def observe(
        self, x: torch.Tensor, g_idx: torch.Tensor | None = None, *, across: Reduce | None = None, apart: int = 1
    ) -> None:
        if isinstance(x, torch.Tensor) and x.ndim >= 1:
            self._weight_shape_2d = tuple(as_2d(x, "weight").shape)
        super().observe(x, g_idx=g_idx, across=across, apart=apart)
