"""One batch split between processes: each observes its part, a reduction makes them agree.

When several processes (torchrun ranks) each hold a share of the calibration tokens, an observer
on every rank calls ``observe(part, across=reduce)`` in lockstep. ``reduce(tensor, op)`` combines
a tensor with the same call's tensor on every other rank and returns the result on every rank
(``torch.distributed.all_reduce`` for ``MIN``/``MAX``/``SUM``, an all-gather for ``CAT``); this
module knows nothing of process groups, so the library stays torch-only and a test can pass a
reduction over a list instead.

Each family says how its statistics merge (``Observer.merge_rule``): min/max of the parts'
minima and maxima, one histogram over an agreed range whose counts are summed, the MSE search
with the candidates' errors summed. Those reproduce one process observing the union of the parts
as ONE batch (which is how the lab observes: all calibration tokens of a layer in one call), up
to float rounding of sums where the rule says so. An observer without a rule of its own falls back
to the token-weighted mean of the ranges each rank chose: an approximation, named as such.

Per-token qparams need no merging: each rank keeps its own tokens' qparams and ``gather_tokens``
puts them in rank order, which is token order when ranks hold consecutive batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

import torch

from observers.granularity import Flat, reduce_min_max
from observers.qparams import QParams


class Op(StrEnum):
    """How a tensor combines across ranks."""

    MIN = "min"
    MAX = "max"
    SUM = "sum"
    CAT = "cat"
    """Concatenation along dim 0 in rank order (sizes may differ)."""


Reduce = Callable[[torch.Tensor, Op], torch.Tensor]
"""``reduce(tensor, op)``: the tensor combined over every rank, the same on every rank."""


NEUTRAL = {Op.MIN: torch.inf, Op.MAX: -torch.inf, Op.SUM: 0.0}
"""What a rank with no tokens contributes, so it takes part in every collective."""


class OtherRankFailed(ValueError):
    """This rank's part was fine but another rank's was refused (its own error names why)."""


def agree(error: Exception | None, reduce: Reduce, device: torch.device | str, tokens: int = 0) -> int:
    """Every rank learns whether any rank failed, before any collective that a failed rank would
    skip (so nothing hangs): raises this rank's ``error``, or ``OtherRankFailed`` when only others
    failed. Returns the tokens summed over ranks."""
    status = reduce(torch.tensor([float(error is not None), float(tokens)], dtype=torch.float64, device=device), Op.SUM)
    if error is not None:
        raise error
    if float(status[0]) > 0:
        raise OtherRankFailed("another rank's part of the batch was refused (that rank's error says why)")
    return int(status[1])


def local_reduce(parts: Sequence[torch.Tensor], op: Op) -> torch.Tensor:
    """What ``reduce`` returns for ``parts`` (one per rank): the definition the collectives follow,
    and a way to check a merge without processes."""
    if op == Op.CAT:
        return torch.cat(list(parts), dim=0)
    stacked = torch.stack(list(parts))
    if op == Op.MIN:
        return stacked.amin(dim=0)
    if op == Op.MAX:
        return stacked.amax(dim=0)
    return stacked.sum(dim=0)


def part_min_max(flat: Flat) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(min, max)`` of one part (``reduce_min_max``); an empty part gives the neutral
    ``(+inf, -inf)``, so a rank without tokens still takes part in the reduction."""
    if flat.data.numel():
        return reduce_min_max(flat)
    low = torch.full(flat.qparam_shape, torch.inf, device=flat.data.device)
    return low, -low


def shared_min_max(low: torch.Tensor, high: torch.Tensor, reduce: Reduce | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(min, max)`` over every rank's part (``reduce`` None: this process alone)."""
    if reduce is None:
        return low, high
    return reduce(low, Op.MIN), reduce(high, Op.MAX)


def gather_tokens(qp: QParams, reduce: Reduce) -> QParams:
    """Per-token qparams of every rank, concatenated in rank order (dim 0 is the token)."""
    cat = lambda t: reduce(t.contiguous(), Op.CAT)  # noqa: E731
    return QParams(
        cat(qp.scale),
        cat(qp.zero_point),
        cat(qp.min_val),
        cat(qp.max_val),
        qp.global_scale,
        dict(qp.extras),
        qp.kind,
    )


EXACT_MIN_MAX = "exact: min of the ranks' minima, max of their maxima (all-reduce MIN/MAX)"
EXACT_HISTOGRAM = "exact: one range agreed per batch (MIN/MAX), the ranks' bin counts summed (SUM)"
EXACT_GRID = "exact up to float rounding: start range agreed (MIN/MAX), each candidate's error summed (SUM)"
MEAN_OF_RANGES = "approximate: the token-weighted mean of the ranges each rank chose on its own part"
NOT_MERGED = "not merged: refused when ranks split the batches (split the layers instead)"
WEIGHTS_ONLY = "not split: observes weights only, which every rank reads whole"
