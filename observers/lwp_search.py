"""AMD Quark's layer-wise percentile: try a few percentiles per tensor, keep the one of least error.

Quark ONNX's ``LayerWisePercentile`` calibration clips each tensor at several candidate
percentiles (99.99, 99.999, 99.99999) of its histogram instead of one fixed percentile, scores
every candidate range by the mean absolute (or squared) error it would leave on the histogram
(bin centres weighted by counts, quantized with the plain affine grid of that range), and keeps
the best. One percentile rarely suits both a weight with no outliers (clip nothing) and an
activation with a few huge ones (clip them); the search picks per tensor.
"""

from __future__ import annotations

import torch

from observers.base import register
from observers.hist_search import in_row_chunks
from observers.hist_state import RowHistogram
from observers.histogram import BINS, HistogramBase
from observers.knobs import Knob
from observers.pick import first_least

DEFAULT_CANDIDATES = "99.99,99.999,99.99999"


def parse_percentiles(text: str) -> list[float]:
    """``"99.99,99.999"`` -> ``[99.99, 99.999]``; a ``ValueError`` naming the bad entry otherwise."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(
                f"percentile_candidates must be numbers separated by commas, got {part.strip()!r}"
            ) from None
        if not 0 < value <= 100:
            raise ValueError(f"percentile_candidates must lie in (0, 100], got {value}")
        values.append(value)
    return values


def percentile_ranges(
    hist: RowHistogram, percentiles: list[float], symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark's percentile ranges, ``(R, P)`` each: the lower edge of the first bin whose
    cumulative share reaches the target (``|x|`` histogram: ``±edge``; signed: the two tails
    ``(100 - p)/200`` each), clamped to the data's own min and max."""
    counts = hist.counts
    cdf = torch.cumsum(counts / counts.sum(dim=1, keepdim=True).clamp(min=1), dim=1)
    edges = hist.edges()
    last = counts.shape[1] - 1
    p = torch.tensor(percentiles, dtype=torch.float64, device=counts.device) / 100
    if symmetric:
        right = torch.searchsorted(cdf, p.expand(cdf.shape[0], -1).contiguous()).clamp(max=last)
        high = edges.gather(1, right)
        low = -high
    else:
        cut = (1 - p) / 2
        right = torch.searchsorted(cdf, (1 - cut).expand(cdf.shape[0], -1).contiguous()).clamp(max=last)
        left = torch.searchsorted(cdf, cut.expand(cdf.shape[0], -1).contiguous()).clamp(max=last)
        high, low = edges.gather(1, right), edges.gather(1, left)
    low = torch.maximum(low, hist.signed_min.double()[:, None])
    high = torch.minimum(high, hist.signed_max.double()[:, None])
    return low.float(), high.float()


def range_error_row_bytes(bins: int, candidates: int) -> int:
    """Working bytes per row of ``percentile_ranges`` and ``range_errors``: about five fp64
    tensors of every candidate's bin centres (their codes, errors and weighted errors)."""
    return 40 * candidates * bins


def range_errors(
    hist: RowHistogram, low: torch.Tensor, high: torch.Tensor, qmin: int, qmax: int, metric: str
) -> torch.Tensor:
    """Mean absolute (``mae``) or squared (``mse``) error of each candidate range ``(R, P)`` on the
    histogram: bin centres quantized with the asymmetric grid of ``[min(low, 0), max(high, 0)]``."""
    low = low.clamp(max=0).double()
    high = high.clamp(min=0).double()
    scale = ((high - low) / (qmax - qmin)).clamp(min=torch.finfo(torch.float32).eps)
    zero = torch.round(qmin - low / scale)
    centers = torch.where(hist.width[:, None] > 0, hist.centers(), hist.lo[:, None])[:, None, :]
    s, z = scale[..., None], zero[..., None]
    codes = torch.round(centers / s + z).clamp_(qmin, qmax)
    diff = centers - (codes - z) * s
    error = diff.abs() if metric == "mae" else diff.square()
    counts = hist.counts[:, None, :]
    return (error * counts).sum(dim=-1) / counts.sum(dim=-1).clamp(min=1)


@register
class LayerWisePercentileObserver(HistogramBase):
    """Quark's layer-wise percentile: each tensor (or channel) takes the best of several percentiles.

    Rule: a running ``bins``-bin histogram (2048; of ``|x|`` for symmetric specs, signed otherwise);
    for each of ``percentile_candidates`` (99.99, 99.999, 99.99999) the percentile range (the
    lower edge of the bin where the cumulative share reaches ``p``; asymmetric: ``(100-p)/200``
    cut from each tail), clamped to the data's min/max; each range is scored by ``metric``
    (``mae``, or ``mse``) of the bin centres quantized on its asymmetric integer grid
    (``scale = (max - min)/(qmax - qmin)``, zero point rounded), weighted by counts; the least
    error wins (first on ties). The chosen range then goes through the spec's range rule.
    Integer formats; tensor (Quark's unit, one layer tensor) and channel strategies.
    Reference: AMD Quark 0.13 ONNX ``LayerWisePercentileCalibrater`` (histogram path, the default).
    Its ``|x|`` histogram spans ``[min|x|, max|x|]``; ours starts at 0 and grows by whole bins
    over batches, so edges can differ by a fraction of a bin. Scored on chunks of rows within
    ``hist_search.SEARCH_CHUNK_BYTES``.
    """

    name = "layerwise_percentile"
    description = "Best of percentiles 99.99/99.999/99.99999 by histogram MAE (Quark 0.13 LayerWisePercentile)"
    knobs = {
        "percentile_candidates": Knob(
            DEFAULT_CANDIDATES, str, doc="Percentiles tried, comma-separated, each in (0, 100]"
        ),
        "metric": Knob("mae", str, choices=("mae", "mse"), doc="Error that picks the percentile"),
        "bins": BINS,
    }

    def validate_knobs(self) -> None:
        if self.spec.format.kind != "int":
            raise ValueError(f"observer {self.name!r} needs an integer dtype, not {self.spec.dtype!r}")
        self._percentiles = parse_percentiles(self.percentile_candidates)

    @property
    def absolute(self) -> bool:
        return self.spec.symmetric

    def chosen_percentile(self) -> torch.Tensor:
        """The winning percentile per qparam group (fp32)."""
        pick = self._picks()[0]
        return torch.tensor(self._percentiles)[pick.cpu()].reshape(self._qparam_shape)

    def _picks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the index of the winning percentile and its range ``(low, high)``."""
        row_bytes = range_error_row_bytes(self.hist.bins, len(self._percentiles))
        return in_row_chunks(self.hist, row_bytes, self._rows_pick)

    def _rows_pick(self, hist: RowHistogram) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        low, high = percentile_ranges(hist, self._percentiles, self.spec.symmetric)
        qmin, qmax = self.spec.int_range
        pick = first_least(range_errors(hist, low, high, qmin, qmax, self.metric), 1, keepdim=True)
        return pick.squeeze(1), low.gather(1, pick).squeeze(1), high.gather(1, pick).squeeze(1)

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        _, low, high = self._picks()
        return low.reshape(self._qparam_shape), high.reshape(self._qparam_shape)
