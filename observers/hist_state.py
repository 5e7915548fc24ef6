"""Running per-row histograms: the shared statistic of the histogram-based observers.

A ``RowHistogram`` holds one histogram per qparam group ("row"): one row for ``tensor``
granularity, one per channel for ``channel``. Each row has its own range ``[lo, lo + bins·width)``.
When a batch falls outside a row's range the range grows and the old counts are re-binned: the
new range starts an integer number of old bins below the old start and its bin width is an
integer multiple ``k`` of the old one, so every old bin lies inside exactly one new bin and the
counts move without being split, dropped or shifted (the same alignment torch.ao's
``HistogramObserver`` uses). All rows are binned in one call, no Python loop over rows or bins:
on fp32 CPU data by the native kernel (``observers.hist_kernel``: one read, ``|x|`` taken on the
fly), else by ``bincount`` over ``row·bins + bin``; both give the same counts.

A row whose values were all equal so far has ``width == 0`` and keeps its count at ``lo``; the
next batch that differs gives it a real range (an all-zero first batch is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from observers.base import NonFiniteStatistics
from observers.granularity import Flat, all_finite, min_max
from observers.hist_kernel import native_counts
from observers.shared import Op, Reduce, shared_min_max

_BIN_CHUNK = 1 << 16
"""Values binned per pass: the int32 index buffer stays in L2."""


@dataclass
class RowHistogram:
    """Histograms of ``R`` rows: ``counts`` (R, bins) fp64, ``lo``/``width`` (R,) fp64.

    ``data_min``/``data_max`` (R,) fp32 bound the histogrammed values exactly (for a ``|x|``
    histogram ``data_min`` is 0); ``signed_min``/``signed_max`` are the raw values' extremes.
    """

    counts: torch.Tensor
    lo: torch.Tensor
    width: torch.Tensor
    data_min: torch.Tensor
    data_max: torch.Tensor
    signed_min: torch.Tensor
    signed_max: torch.Tensor

    @property
    def bins(self) -> int:
        return self.counts.shape[1]

    def edges(self) -> torch.Tensor:
        """Bin edges per row, (R, bins + 1) fp64."""
        steps = torch.arange(self.bins + 1, dtype=torch.float64, device=self.counts.device)
        return self.lo.unsqueeze(1) + steps * self.width.unsqueeze(1)

    def centers(self) -> torch.Tensor:
        """Bin centres per row, (R, bins) fp64."""
        steps = torch.arange(self.bins, dtype=torch.float64, device=self.counts.device) + 0.5
        return self.lo.unsqueeze(1) + steps * self.width.unsqueeze(1)

    def rows(self, part: slice) -> RowHistogram:
        """The histograms of the rows ``part`` (views, no copy): a chunk of a search."""
        return RowHistogram(
            self.counts[part],
            self.lo[part],
            self.width[part],
            self.data_min[part],
            self.data_max[part],
            self.signed_min[part],
            self.signed_max[part],
        )


def rows_of(flat: Flat) -> torch.Tensor:
    """The values of each qparam group as rows, (R, n), for strategies without padding."""
    data = flat.data
    rows = 1
    for size in flat.qparam_shape:
        rows *= size
    return data.movedim(0, -2).reshape(rows, data.numel() // rows)


def _bin_transform(lo: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 ``(scale, shift)`` (R,) with bin position ``v·scale + shift``; a flat row
    (``width == 0``) maps everything to 0."""
    inverse = torch.where(width > 0, 1.0 / torch.where(width > 0, width, 1.0), 0.0)
    return inverse.float(), (-lo * inverse).float()


def _eager_counts(
    values: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, bins: int, absolute: bool
) -> torch.Tensor:
    """Counts (R, bins) int64 with torch ops, over cache-sized chunks of columns so the ``|x|``
    and index buffers never leave the cache. The reference the native kernel matches."""
    rows = values.shape[0]
    offsets = torch.arange(rows, device=values.device, dtype=torch.int32).mul_(bins).unsqueeze(1)
    total = torch.zeros(rows * bins, dtype=torch.int64, device=values.device)
    step = max(1, _BIN_CHUNK // rows)
    for first in range(0, values.shape[1], step):
        part = values[:, first : first + step]
        part = part.abs() if absolute else part
        index = torch.addcmul(shift.unsqueeze(1), part, scale.unsqueeze(1)).clamp_(0, bins - 1).to(torch.int32)
        total.add_(torch.bincount(index.add_(offsets).reshape(-1), minlength=rows * bins))
    return total.view(rows, bins)


def _bin_into(
    counts: torch.Tensor,
    values: torch.Tensor,
    lo: torch.Tensor,
    width: torch.Tensor,
    reduce: Reduce | None = None,
    absolute: bool = False,
) -> None:
    """Add ``values`` (R, n) (``|values|`` when ``absolute``) to ``counts`` (R, bins) in place;
    values beyond the ends go to the end bins. With ``reduce`` the counts of every rank's values
    are added (all ranks bin into the same bins).

    Why not ``torch.histc``: on CPU it re-checks every element against the bin edges (15 ms for
    4M values on one thread, measured). The bin of ``v`` is ``(int32) clamp(fma(v, scale, shift),
    0, bins - 1)``: the native kernel (``observers.hist_kernel``) computes it in one read of fp32
    CPU data (2.4 ms); elsewhere ``_eager_counts`` does (10.5 ms), with the same counts. The fp32
    bin position may put a value that lies within rounding of an edge into the neighbouring bin;
    the running histogram's guarantees (each value in its bin or a neighbour) allow that.
    """
    bins = counts.shape[1]
    scale, shift = _bin_transform(lo, width)
    total = native_counts(values, scale, shift, bins, absolute)
    if total is None:
        total = _eager_counts(values, scale, shift, bins, absolute)
    if reduce is not None:
        total = reduce(total, Op.SUM)
    counts.add_(total)


def _grow(hist: RowHistogram, new_min: torch.Tensor, new_max: torch.Tensor) -> RowHistogram:
    """Widen every row's range to cover ``[new_min, new_max]`` (fp64) and re-bin its counts."""
    bins = hist.bins
    lo, width = hist.lo, hist.width
    flat_row = width == 0
    hi = lo + bins * width
    grows = (new_min < lo) | (new_max > hi)
    low = torch.minimum(lo, new_min)
    high = torch.maximum(hi, new_max)
    safe_width = torch.where(flat_row, 1.0, width)
    shift = torch.ceil((lo - low) / safe_width)
    aligned_lo = lo - shift * safe_width
    factor = torch.ceil((high - aligned_lo) / (bins * safe_width)).clamp_(min=1)
    new_lo = torch.where(flat_row, low, aligned_lo)
    new_width = torch.where(flat_row, (high - low) / bins, factor * safe_width)
    new_lo = torch.where(grows, new_lo, lo)
    new_width = torch.where(grows, new_width, width)
    # Old bin centres (a flat row: its one point) land in the new bin that contains the whole old bin.
    centers = torch.where(flat_row.unsqueeze(1), lo.unsqueeze(1), hist.centers())
    safe_new = torch.where(new_width > 0, new_width, 1.0).unsqueeze(1)
    target = ((centers - new_lo.unsqueeze(1)) / safe_new).floor_().clamp_(0, bins - 1).long()
    rows = hist.counts.shape[0]
    offsets = torch.arange(rows, device=target.device).mul_(bins).unsqueeze(1)
    counts = torch.zeros_like(hist.counts).view(-1)
    counts.index_add_(0, (target + offsets).reshape(-1), hist.counts.reshape(-1))
    counts = torch.where(grows.unsqueeze(1), counts.view(rows, bins), hist.counts)
    return RowHistogram(counts, new_lo, new_width, hist.data_min, hist.data_max, hist.signed_min, hist.signed_max)


def update_histogram(
    hist: RowHistogram | None, rows: torch.Tensor, bins: int, absolute: bool = False, reduce: Reduce | None = None
) -> RowHistogram:
    """Add a batch ``rows`` (R, n) to ``hist`` (None starts one); ``absolute`` histograms ``|x|`` from 0.

    With ``reduce`` the batch is split between ranks (``observers.shared``; ``rows`` may be
    empty): the ranks agree on the batch's range, so every rank grows the same histogram the same
    way, and the counts are summed; the result is the histogram of the whole batch, on every rank."""
    rows = rows.float()
    if rows.numel():
        signed_min, signed_max = min_max(rows.unsqueeze(0))
        if not (all_finite(signed_min) and all_finite(signed_max)):
            raise NonFiniteStatistics("the batch has NaN/Inf values")
    else:
        signed_min = torch.full(rows.shape[:1], torch.inf, device=rows.device)
        signed_max = -signed_min
    signed_min, signed_max = shared_min_max(signed_min, signed_max, reduce)
    if absolute:
        batch_min = torch.zeros_like(signed_min)
        batch_max = torch.maximum(-signed_min, signed_max)
    else:
        batch_min, batch_max = signed_min, signed_max
    if hist is None:
        lo = batch_min.double()
        hist = RowHistogram(
            torch.zeros(rows.shape[0], bins, dtype=torch.float64, device=rows.device),
            lo,
            (batch_max.double() - lo) / bins,
            batch_min,
            batch_max,
            signed_min,
            signed_max,
        )
    else:
        hist = _grow(hist, batch_min.double(), batch_max.double())
        hist.data_min = torch.minimum(hist.data_min, batch_min)
        hist.data_max = torch.maximum(hist.data_max, batch_max)
        hist.signed_min = torch.minimum(hist.signed_min, signed_min)
        hist.signed_max = torch.maximum(hist.signed_max, signed_max)
    _bin_into(hist.counts, rows, hist.lo, hist.width, reduce, absolute)
    return hist
