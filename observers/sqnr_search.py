"""AIMET's SQNR encoding analyzer: the integer grid of least estimated noise, clipping weighted up.

AIMET (``aimet_torch.v2.quantization.encoding_analyzer.SqnrEncodingAnalyzer``) keeps a 2048-bin
histogram per encoding and scores candidate grids ``(delta, offset)`` on it, each bin standing
for its count of values at its centre ``c``:

    noise = Σ count · (dq(c) - c)² · (gamma if c falls outside the grid else 1)
    dq(c) = (clamp(round(c/delta - offset), 0, steps) + offset) · delta,  steps = qmax - qmin

Candidates, symmetric: ``delta = (2·amax/steps)·k/(n-1)`` for ``k = 1..n`` (``n`` 101, so up to
1% beyond the data), ``offset = floor(-steps/2)``. Asymmetric: ``delta = ((max - min)/steps)·k/(n-1)``
for ``k = 1..17`` crossed with 20 offsets spread over ``[-steps, 0]`` plus the observed one, each
pair clipped to the observed range and re-derived. ``gamma`` 3 makes clipping noise count three
times, which keeps the grid from cutting tails that the mean squared error alone would cut.
AIMET is not installable here; this follows its published source, and the tests check the rule
on hand-computed histograms.
"""

from __future__ import annotations

import torch

from observers.base import register
from observers.hist_search import in_row_chunks
from observers.hist_state import RowHistogram
from observers.histogram import BINS, HistogramBase
from observers.knobs import Knob
from observers.mse_grid import MAX_WORKING_BYTES
from observers.pick import first_least
from observers.qparams import QParams, exact_divisor

MINIMUM_SCALE = float(torch.finfo(torch.float32).eps)
"""AIMET's smallest delta (fp32 machine epsilon)."""


def sqnr_candidates(
    data_min: torch.Tensor,
    data_max: torch.Tensor,
    steps: int,
    symmetric: bool,
    delta_candidates: int,
    offset_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AIMET's candidate grids per row: ``(delta, offset)``, each ``(R, D, O)`` fp32.

    The range is widened to contain zero and at least ``steps·eps`` wide; symmetric grids share
    the one offset ``floor(-steps/2)``; asymmetric ones are clipped to the observed range (snapped
    to the largest grid) and their delta and offset re-derived from the clipped ends.
    """
    low = torch.clamp(data_min.float(), max=0.0)
    high = torch.clamp(data_max.float(), min=0.0)
    high = torch.maximum(high, low + MINIMUM_SCALE * steps)
    search = torch.arange(1, delta_candidates + 1, dtype=torch.float32, device=low.device)
    last_candidate = exact_divisor(delta_candidates - 1.0, high)
    if symmetric:
        max_delta = 2 * torch.maximum(high, -low) / exact_divisor(float(steps), high)
        delta = (max_delta[:, None] * search[None, :] / last_candidate).clamp(min=MINIMUM_SCALE)
        offset = torch.full_like(delta, float((-steps) // 2))
        return delta.unsqueeze(2), offset.unsqueeze(2)
    max_delta = (high - low) / exact_divisor(float(steps), high)
    observed_offset = torch.round(low / max_delta)
    observed_min = max_delta * observed_offset
    observed_max = observed_min + max_delta * steps
    delta = max_delta[:, None] * search[None, :] / last_candidate
    count = min(steps + 2, offset_candidates)
    offset_step = steps / (count - 2)
    spread = torch.round(torch.arange(-steps, offset_step, offset_step, dtype=torch.float32, device=low.device))
    offsets = torch.cat([spread[None, :].expand(low.shape[0], -1), observed_offset[:, None]], dim=1)
    test_min = torch.maximum(observed_min[:, None, None], delta[:, :, None] * offsets[:, None, :])
    test_max = torch.minimum(observed_max[:, None, None], test_min + delta[:, :, None] * steps)
    delta = ((test_max - test_min) / steps).clamp(min=MINIMUM_SCALE)
    return delta, torch.round(test_min / delta)


def sqnr_noise(
    centers: torch.Tensor, counts: torch.Tensor, delta: torch.Tensor, offset: torch.Tensor, steps: int, gamma: float
) -> torch.Tensor:
    """AIMET's estimated noise of each candidate, ``(R, D, O)``, from bin ``centers``/``counts`` ``(R, B)``."""
    c = centers[:, None, None, :]
    d = delta[..., None]
    o = offset[..., None]
    codes = c.div(d).sub_(o).round_()
    clipped = (codes < 0) | (codes > steps)
    error = codes.clamp_(0, steps).add_(o).mul_(d).sub_(c).square_().mul_(counts[:, None, None, :])
    if gamma != 1.0:
        error = torch.where(clipped, error * gamma, error)
    return error.sum(dim=-1)


_PREPARE_BYTES_PER_BIN = 40
"""Bytes per row and bin of the SQNR search's preparation: the centres (fp64, then fp32), the
counts (fp32), the filled flags and their sort (its indices int64)."""
_NOISE_BYTES_PER_CELL = 20
"""Bytes per row, grid and kept bin of ``sqnr_noise``: the codes, the error and its clip-weighted
copy (fp32) and the clipped flags."""


@register
class SQNRObserver(HistogramBase):
    """AIMET's SQNR analyzer: on a running histogram, the integer grid of least clip-weighted noise.

    Rule: a running ``bins``-bin histogram per qparam group (2048); candidate grids as AIMET
    (symmetric: ``symmetric_delta_candidates`` 101 deltas up to 1.01x the data's ``2·amax/steps``,
    offset ``floor(-steps/2)``; asymmetric: ``asymmetric_delta_candidates`` 17 deltas times
    ``offset_candidates`` 21 offsets, clipped to the data); noise ``Σ count·(dq(c) - c)²`` over bin
    centres, times ``gamma`` (3) where ``c`` falls outside the grid; the least noise wins (first
    on ties). ``steps = qmax - qmin``. QParams keep AIMET's grid exactly: ``scale = delta``,
    ``zero_point = qmin - offset``, range ``[offset·delta, (offset + steps)·delta]`` (so the
    spec's ``scale_rule`` does not apply). Integer formats; tensor and channel strategies.
    The grids are scored on chunks of rows within ``hist_search.SEARCH_CHUNK_BYTES`` or a smaller
    ``max_working_bytes``.
    Reference: AIMET ``SqnrEncodingAnalyzer`` (aimet_torch v2, published source; not installable
    here, checked on hand-computed cases). The histogram grows by whole bins when later batches
    widen the range (``observers.hist_state``), where AIMET splits old bins proportionally.
    """

    name = "sqnr"
    description = "Integer grid of least histogram noise, clipping noise x3 (AIMET v2 SqnrEncodingAnalyzer)"
    knobs = {
        "bins": BINS,
        "symmetric_delta_candidates": Knob(101, int, low=2, doc="Deltas tried for symmetric specs"),
        "asymmetric_delta_candidates": Knob(17, int, low=2, doc="Deltas tried for asymmetric specs"),
        "offset_candidates": Knob(21, int, low=3, doc="Offsets tried for asymmetric specs (plus the observed one)"),
        "gamma": Knob(3.0, float, low=0, doc="Weight of clipping noise against rounding noise (1: plain MSE)"),
        "max_working_bytes": MAX_WORKING_BYTES,
    }

    def validate_knobs(self) -> None:
        if self.spec.format.kind != "int":
            raise ValueError(f"observer {self.name!r} needs an integer dtype, not {self.spec.dtype!r}")

    def encodings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen ``(delta, offset)`` per row (fp32, ``(R,)``)."""
        hist = self.hist
        # Only filled bins add noise: each row's are moved to the front and the columns empty in
        # every row dropped (a weight row of 384 values fills at most 384 of 2048 bins). One
        # width for all rows: a noise sum over more columns, zeros or not, may round differently.
        # (Counted in chunks too: summing the flags of all rows at once copies them to int64.)
        filled = in_row_chunks(hist, 9 * hist.bins, lambda part: ((part.counts > 0).sum(dim=1),))[0]
        width = max(1, int(filled.max()))
        symmetric = self.spec.symmetric
        grids = (
            self.symmetric_delta_candidates if symmetric else self.asymmetric_delta_candidates * self.offset_candidates
        )
        row_bytes = _PREPARE_BYTES_PER_BIN * hist.bins + _NOISE_BYTES_PER_CELL * grids * width
        return in_row_chunks(hist, row_bytes, lambda part: self._best_grids(part, width), self.max_working_bytes)

    def _best_grids(self, hist: RowHistogram, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(delta, offset)`` of least noise for each row of ``hist`` (a chunk of rows), scored on
        each row's first ``width`` bins once its filled bins are moved to the front."""
        qmin, qmax = self.spec.int_range
        steps = qmax - qmin
        symmetric = self.spec.symmetric
        count = self.symmetric_delta_candidates if symmetric else self.asymmetric_delta_candidates
        delta, offset = sqnr_candidates(
            hist.signed_min, hist.signed_max, steps, symmetric, count, self.offset_candidates
        )
        centers = torch.where(hist.width[:, None] > 0, hist.centers(), hist.lo[:, None]).float()
        counts = hist.counts.float()
        order = torch.sort((counts > 0).to(torch.uint8), dim=1, descending=True, stable=True).indices
        centers = centers.gather(1, order[:, :width])
        counts = counts.gather(1, order[:, :width])
        offset = offset.expand_as(delta)
        noise = sqnr_noise(centers, counts, delta, offset, steps, self.gamma).flatten(1)
        pick = first_least(noise, 1, keepdim=True)
        return delta.flatten(1).gather(1, pick).squeeze(1), offset.flatten(1).gather(1, pick).squeeze(1)

    def _qparams(self) -> QParams:
        delta, offset = self.encodings()
        qmin, qmax = self.spec.int_range
        shape = self._qparam_shape
        scale = delta.reshape(shape)
        offset = offset.reshape(shape)
        zero_point = (qmin - offset).clamp(qmin, qmax).to(torch.int32)
        low = offset * scale
        return QParams(scale, zero_point, low, low + (qmax - qmin) * scale)
