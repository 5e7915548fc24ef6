"""Native candidate errors of the searches over float element grids (``csrc/group_float_grid.c``).

Why: the eager float searches (``mse_grid`` on FP8/FP6/FP4/MX/NVFP4, ``nvfp4_expanded_mse``,
``nvfp4_expanded_imatrix`` and ``imatrix_mse`` on float grids, ``nvfp4_fp8_sweep``,
``modelopt_mse``) run a dozen torch passes per candidate, six of them the float grid rounding of
``formats.round_to_float_grid_``; the kernel reads each piece of the data once per call and
evaluates every candidate while it sits in L1, the rounding done bit for bit as the eager one
(``csrc/float_grid.h``: clamp, then round half to even to the binade's step by adding and
subtracting a constant whose ulp is that step) after the same correctly rounded ``x/s``, so the
codes are the eager codes.

How: ``candidate_errors`` takes ``(N, Q, K)`` data and the candidates' steps and returns per
candidate and group ``Σ weight·|grid(x/s) - x/s|^norm`` (in steps, what ``mse_grid`` sums) or,
with ``direct``, ``Σ weight·|grid(x/s)·s - x|^norm`` (what ``lc_search`` and ``modelopt_search``
sum). The steps are a ``(C, Q)`` table, one step per candidate shared by every group (the NVFP4
FP8 sweep's 126 E4M3 scales), or a ``StepRule`` the kernel evaluates itself: the free fp32 rule,
or NVFP4's, where each candidate block scale is cast to E4M3 inside the candidate loop exactly as
``blocks.e4m3_qparams`` casts it. ``candidate_picks`` returns, instead of the ``(C, Q)`` sums, each
group's least error and first candidate reaching it (``argmin``), and ``shrink_search`` runs
llm-compressor's sequential shrink loop with early stop on those picks, so a search never writes
or scans a candidate table. With a fractional norm between 1 and 3 and 32 or more candidates
(the NVFP4 shrink searches: 2.4 over 111), the pick over short groups bounds each candidate's sum from its
sums of ``|e|``, ``e²`` and ``|e|³`` and takes the power only for the few that may be least
(about 6 of 111 per group): the same picks, a third faster. ``|e|^norm`` is exact for norm 1 and 2
(3 with ``direct``), else a few ulps from the exact power, as in ``observers.mse_kernel``; the
fp32 sums run in another order. So
the sums differ from the eager ones by a few ulps, which can flip only a group whose two best
candidates tie to ~1e-6 (exact ties, two candidates giving the same dequantized values, stay exact
ties: each candidate's sum runs in the same order). It returns None whenever the eager path must
run: CUDA, non-fp32 or non-contiguous tensors, a format that is not a float grid, the kernel not
in use (``observers.kernels.status("group_float_grid")``) or inside ``kernels.disabled()``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from observers import kernels
from observers.formats import ElementFormat
from observers.mse_kernel import PIECE, WORK_PER_THREAD, readable

NAME = "group_float_grid"
_ARGUMENTS = [
    ctypes.c_void_p,  # x
    ctypes.c_void_p,  # weight or NULL
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # run
    ctypes.c_int64,  # piece
    ctypes.c_int64,  # groups
    ctypes.c_int64,  # count (candidates)
    ctypes.c_void_p,  # step
    ctypes.c_int64,  # step stride per candidate
    ctypes.c_int64,  # step stride per group
    ctypes.c_int,  # exp_bits
    ctypes.c_int,  # man_bits
    ctypes.c_double,  # max_value
    ctypes.c_double,  # norm
    ctypes.c_int,  # direct
    ctypes.c_void_p,  # factor or NULL (pick mode)
    ctypes.c_void_p,  # best value or NULL
    ctypes.c_void_p,  # best index (int64) or NULL: pick mode when given
    ctypes.c_int,  # step rule: 0 table, 1 free, 2 NVFP4
    ctypes.c_void_p,  # amax per group (rules 1, 2)
    ctypes.c_void_p,  # factor per candidate (rules 1, 2)
    ctypes.c_void_p,  # global scale per candidate (rule 2)
    ctypes.c_void_p,  # s^norm per candidate and E4M3 code, (C, 128), or NULL (rule 2)
    ctypes.c_double,  # divisor
    ctypes.c_double,  # eps
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # out
]


@dataclass(frozen=True)
class StepRule:
    """Steps the kernel computes itself instead of reading a ``(C, Q)`` table (which for 111
    candidates over 262144 NVFP4 blocks is 116 MB written by torch and read back).

    ``kind`` "free": ``s = max(amax[q]·factors[c] / divisor, eps)``, the free fp32 rule of
    ``qparams._free_scale`` on the range ``factors[c]·(min, max)`` (scaling by a positive factor
    commutes with ``max(-min, max)`` exactly, rounding being monotonic). ``kind`` "e4m3": NVFP4's
    rule of ``blocks.e4m3_qparams``, ``s = e4m3(clamp(amax[q]·factors[c] / divisor · global_scale[c],
    2^-9, 448)) / global_scale[c]``, the E4M3 cast of the block scale inside the candidate loop;
    ``power`` ``(C, 128)``, when given, is ``s^norm`` by E4M3 code (the pick's factor). The same
    fp32 operations in the same order as the torch rules, so the steps are bit for bit theirs
    (tests check it).
    """

    kind: str
    amax: torch.Tensor
    factors: torch.Tensor
    divisor: float
    eps: float = 0.0
    global_scale: torch.Tensor | None = None
    power: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.factors.numel()


_NO_TABLE = torch.zeros(1, 1)
"""The step table argument when a ``StepRule`` gives the steps (never read)."""


def covers(fmt: ElementFormat) -> bool:
    """Whether the kernel rounds onto ``fmt``'s element grid: a float grid with 2 to 5 exponent and
    at most 3 mantissa bits (E2M1, E2M3, E3M2, E4M3, E5M2; NVFP4's elements and MX's included)."""
    return fmt.kind == "float" and 2 <= fmt.exp_bits <= 5 and 0 <= fmt.man_bits <= 3 and fmt.max_value > 0


def usable(data: torch.Tensor, weight: torch.Tensor | None, fmt: ElementFormat) -> bool:
    """Whether ``candidate_errors`` runs the kernel on this ``(N, Q, K)`` data, weight and format."""
    return readable(data, weight) and covers(fmt) and kernels.in_use(NAME) is not None


def _rule(rule: StepRule, groups: int) -> StepRule:
    """``rule`` with contiguous fp32 tensors of the sizes the kernel reads."""
    if rule.kind not in ("free", "e4m3") or rule.amax.numel() != groups:
        raise ValueError(f"a {rule.kind!r} step rule over {rule.amax.numel()} groups cannot serve {groups} groups")
    if rule.kind == "e4m3" and (rule.global_scale is None or rule.global_scale.numel() != rule.count):
        raise ValueError("an e4m3 step rule needs one global scale per candidate")
    if rule.power is not None and tuple(rule.power.shape) != (rule.count, 128):
        raise ValueError("an e4m3 step rule's power table is (candidates, 128)")

    def ready(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().float().reshape(-1).contiguous()

    return StepRule(
        rule.kind,
        ready(rule.amax),
        ready(rule.factors),
        float(rule.divisor),
        float(rule.eps),
        ready(rule.global_scale),
        ready(rule.power),
    )


def _steps(step: torch.Tensor, count: int, groups: int) -> torch.Tensor:
    """``step`` as a fp32 ``(C, Q)`` view the kernel reads with two strides: ``(C,)`` becomes a
    stride-0 group axis; other layouts are copied unless already stride-0 or contiguous."""
    step = step.float()
    if step.ndim == 1:
        return step.contiguous().unsqueeze(1).expand(count, groups)
    step = step.reshape(count, groups) if step.shape != (count, groups) else step
    if (step.stride(1) == 0 and step.stride(0) >= 0) or step.stride() == (groups, 1):
        return step
    return step.contiguous()


def _call(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    step: torch.Tensor,
    fmt: ElementFormat,
    norm: float,
    direct: bool,
    isa: str | None,
    piece: int,
    out: torch.Tensor | None = None,
    picks: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None,
    rule: StepRule | None = None,
) -> None:
    observations, groups, run = data.shape
    count = step.shape[0] if rule is None else rule.count
    pieces = -(-run // piece)
    rows = observations * groups
    factor, best_value, best_index = picks if picks is not None else (None, None, None)
    threads = max(1, min(torch.get_num_threads(), rows * pieces, data.numel() * count // WORK_PER_THREAD))
    kernels.function(NAME, isa, _ARGUMENTS)(
        data.data_ptr(),
        None if weight is None else weight.data_ptr(),
        rows,
        run,
        piece,
        groups,
        count,
        step.data_ptr(),
        step.stride(0),
        step.stride(1) if step.ndim == 2 else 0,
        fmt.exp_bits,
        fmt.man_bits,
        fmt.max_value,
        norm,
        int(direct),
        None if factor is None else factor.data_ptr(),
        None if best_value is None else best_value.data_ptr(),
        None if best_index is None else best_index.data_ptr(),
        0 if rule is None else (1 if rule.kind == "free" else 2),
        None if rule is None else rule.amax.data_ptr(),
        None if rule is None else rule.factors.data_ptr(),
        None if rule is None or rule.global_scale is None else rule.global_scale.data_ptr(),
        None if rule is None or rule.power is None else rule.power.data_ptr(),
        1.0 if rule is None else rule.divisor,
        0.0 if rule is None else rule.eps,
        threads,
        None if out is None else out.data_ptr(),
    )


def candidate_errors(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    step: torch.Tensor | StepRule,
    fmt: ElementFormat,
    norm: float,
    direct: bool = False,
    isa: str | None = None,
) -> torch.Tensor | None:
    """``Σ weight·|grid(x/s) - x/s|^norm`` per candidate and group, ``(C, Q)``, or None.

    ``data`` and ``weight`` (or None) are ``(N, Q, K)``; ``step`` is ``(C, Q)`` (any view with
    those sizes; a stride-0 group axis is read as one step per candidate) or ``(C,)``, one step per
    candidate for every group, or a ``StepRule`` the kernel computes the steps from. With
    ``direct`` the error is in the data's units,
    ``|grid(x/s)·s - x|``. None when the eager path must run (``usable``). ``isa`` picks a kernel
    variant (tests compare them).
    """
    if not usable(data, weight, fmt):
        return None
    observations, groups, run = data.shape
    rule = _rule(step, groups) if isinstance(step, StepRule) else None
    count = step.count if rule is not None else step.shape[0]
    step = _NO_TABLE if rule is not None else _steps(step, count, groups)
    piece = min(run, PIECE)
    pieces = -(-run // piece)
    out = torch.empty(count, observations * groups * pieces, dtype=torch.float32)
    _call(data, weight, step, fmt, norm, direct, isa, piece, out=out, rule=rule)
    if observations == 1 and pieces == 1:
        return out
    return out.view(count, observations, groups, pieces).sum(dim=(1, 3))


def pickable(data: torch.Tensor, weight: torch.Tensor | None, fmt: ElementFormat) -> bool:
    """Whether ``candidate_picks`` runs: ``usable``, and each group is one kernel unit (one
    observation, groups of at most ``PIECE`` values), so a unit's sums are its group's."""
    return usable(data, weight, fmt) and data.shape[0] == 1 and data.shape[-1] <= PIECE


def candidate_picks(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    step: torch.Tensor | StepRule,
    fmt: ElementFormat,
    norm: float,
    direct: bool = False,
    factor: torch.Tensor | None = None,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per group the least candidate error and the first candidate reaching it, ``((Q,), (Q,) int64)``,
    or None (``pickable``): ``candidate_errors`` (times ``factor``, shaped as ``step``, when given),
    ``nan_to_num(nan=inf)``, then ``min``/``argmin`` over the candidates, without the ``(C, Q)``
    table. Why: over many candidates (126 FP8 block scales, 111 shrink factors) writing that table
    and scanning it along its short strided axis costs more than the errors themselves.
    """
    if not pickable(data, weight, fmt):
        return None
    _, groups, run = data.shape
    rule = _rule(step, groups) if isinstance(step, StepRule) else None
    if rule is not None:
        if factor is not None:
            raise ValueError("with a step rule the pick's factor is the rule's power table")
        step = _NO_TABLE
    else:
        step = _steps(step, step.shape[0], groups)
    if factor is not None:
        factor = factor.float().reshape(step.shape[0], groups)
        if factor.stride() != step.stride():
            factor, step = factor.contiguous(), step.contiguous()
    best_value = torch.empty(groups, dtype=torch.float32)
    best_index = torch.empty(groups, dtype=torch.int64)
    _call(data, weight, step, fmt, norm, direct, isa, run, picks=(factor, best_value, best_index), rule=rule)
    return best_value, best_index


def shrink_search(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    fmt: ElementFormat,
    factors: list[float],
    candidate_steps: Callable[[list[float]], torch.Tensor | StepRule],
    norm: float,
    patience: int,
    direct: bool,
) -> torch.Tensor | None:
    """Per group the factor llm-compressor's sequential shrink loop keeps, ``(Q,)``, or None (``pickable``).

    The loop: for each factor in order, a candidate improves when some group's error is strictly
    below that group's best so far; each group keeps its first lowest error (1.0 when none beats
    ``finfo.max``); it stops after ``patience`` consecutive candidates that improved nothing
    (``patience`` 0: never). ``candidate_steps(chunk)`` gives a chunk's ``(C, Q)`` steps or a
    ``StepRule`` (whose ``power`` then holds ``s^norm``); errors are direct, or in steps times
    ``s^norm`` (``mse_grid``'s form), NaN read as +inf.
    Why the chunks are at most ``patience - stale`` candidates: a stop can then only fall on a
    chunk's last candidate, so the kernel's per-group pick (``candidate_picks``) over the whole
    chunk is the loop's pick, and the last improving candidate (the latest first-minimum among
    the groups that improved) gives the stale count; no ``(C, Q)`` table is ever written.
    """
    if not pickable(data, weight, fmt):
        return None
    groups = data.shape[1]
    best = torch.full((groups,), torch.finfo(torch.float32).max)
    best_factor = torch.ones(groups)
    values = torch.tensor(factors, dtype=torch.float32)
    stale, first = 0, 0
    while first < len(factors):
        size = len(factors) - first if patience == 0 else min(len(factors) - first, patience - stale)
        step = candidate_steps(factors[first : first + size])
        factor = None if direct or isinstance(step, StepRule) else step.float().pow(norm)
        least, index = candidate_picks(data, weight, step, fmt, norm, direct, factor)
        improved = least < best
        if bool(improved.any()):
            last = int(torch.where(improved, index, -1).max())
            stale = size - 1 - last
            best_factor = torch.where(improved, values[first:][index], best_factor)
            best = torch.where(improved, least, best)
        else:
            stale += size
        first += size
        if patience and stale >= patience:
            break
    return best_factor
