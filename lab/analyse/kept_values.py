"""What a kept run (``lab.history``) holds of an activation's values in place of the sample the run
analysed: a bounded number of bytes per tensor, whatever the number of calibration tokens.

The sample an analysis keeps (``TensorAnalysis.data``: up to ``SAMPLE_BYTES`` of tokens) is what
its error metrics were computed on; a kept run holds those metrics, and of the values only what the
pages draw from them:
- ``ValueHistogram``: the histogram of every value of the sample on ``HISTOGRAM_BINS`` bins over
  its exact range, which the range histograms re-bin (``counts_over``), fold (``absolute``) and
  zoom into (``quantile``) as they bin the values themselves;
- ``extremes_of``: each channel's min and max over every token, which the per-channel figures
  reduce as they reduce the whole sample;
- ``kept_rows``: a seeded subset of whole tokens, at most ``KEPT_VALUES`` values, the tensor the
  figures re-derived from values draw (the error histogram, run-time scales, per-token abs-max,
  layer-output error).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from sample_models.calibration import SUBSAMPLE_SEED

KEPT_VALUES = 1 << 18
"""Values of the tokens a kept run keeps of each activation (1 MiB as fp32): whole tokens, at least
one, so 682 tokens of a 384-wide input, 64 of a 4096-wide one, 23 of an 11008-wide MLP
down-projection's. Enough tokens for the per-token figures and values for the error histogram
(262 of them beyond its 99.9th percentile), while a 7B model's every distinct input (128) takes
about 128 MiB where its samples took 2.4 GB."""
HISTOGRAM_BINS = 4096
"""Bins of a kept run's value histogram (32 KiB a tensor): a range histogram's 200 bins over the
data's range are 20 of them each, and its tail zoom (the outer 0.1 % of values) still spans
hundreds where a tail is a fifth of the range."""
_CHUNK_VALUES = 1 << 20
"""Values binned at once: float32 counts are exact to 2^24, and the sample is never copied whole."""


@dataclass(frozen=True)
class ValueHistogram:
    """Counts of values on equal bins over ``[lo, hi]`` (float64, exact integers as made by ``of``);
    between bin edges the values are taken as spread evenly, the rule of every re-binning here."""

    lo: float
    hi: float
    counts: torch.Tensor

    @classmethod
    def of(cls, data: torch.Tensor, bins: int = HISTOGRAM_BINS) -> ValueHistogram:
        """The histogram of every finite value of ``data`` (binned a chunk of tokens at a time, so
        nothing of the size of ``data`` is allocated)."""
        ends = [_finite_range(part) for part in _chunks(data)]
        lo = min((low for low, _ in ends if low is not None), default=0.0)
        hi = max((high for _, high in ends if high is not None), default=0.0)
        if hi <= lo:
            hi = lo + max(abs(lo), 1.0) * 1e-6
        counts = torch.zeros(bins, dtype=torch.float64)
        for part in _chunks(data):
            counts += torch.histc(part, bins=bins, min=lo, max=hi).to(device="cpu", dtype=torch.float64)
        return cls(lo, hi, counts)

    @property
    def edges(self) -> np.ndarray:
        """The bins' edges, ``lo`` to ``hi``."""
        return np.linspace(self.lo, self.hi, len(self.counts) + 1)

    def _cumulative(self) -> np.ndarray:
        """How many values lie at or below each bin edge."""
        return np.concatenate([[0.0], np.cumsum(self.counts.numpy())])

    def cdf(self, at: np.ndarray) -> np.ndarray:
        """How many values lie at or below each of ``at``."""
        return np.interp(at, self.edges, self._cumulative())

    def counts_over(self, bins: int, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """``(bin_edges, counts)`` on ``bins`` equal bins over ``[lo, hi]``, as
        ``lab.results.plots.value_histogram`` gives of the values themselves."""
        edges = np.linspace(lo, hi, bins + 1)
        return edges, np.diff(self.cdf(edges))

    def quantile(self, q: float) -> float:
        """The value below which a share ``q`` of the values lies."""
        cumulative = self._cumulative()
        target = q * cumulative[-1]
        i = int(np.clip(np.searchsorted(cumulative, target, side="left"), 1, len(cumulative) - 1))
        inside = cumulative[i] - cumulative[i - 1]
        share = 0.0 if inside <= 0 else (target - cumulative[i - 1]) / inside
        return float(self.edges[i - 1] + share * (self.edges[i] - self.edges[i - 1]))

    def absolute(self) -> ValueHistogram:
        """The histogram of ``|x|`` over ``[0, max |x|]`` (``[min |x|, max |x|]`` on one side of 0):
        ``|x| <= t`` counts the values in ``[-t, t]``."""
        top = max(abs(self.lo), abs(self.hi))
        bottom = 0.0 if self.lo < 0 < self.hi else min(abs(self.lo), abs(self.hi))
        edges = np.linspace(bottom, top, len(self.counts) + 1)
        return ValueHistogram(bottom, top, torch.from_numpy(np.diff(self.cdf(edges) - self.cdf(-edges))))


@dataclass(frozen=True)
class KeptValues:
    """What a kept run holds of an activation's analysed sample besides ``kept_rows``: its
    ``histogram`` and each channel's extremes (``extremes_of``)."""

    histogram: ValueHistogram
    extremes: torch.Tensor


def token_dim(data: torch.Tensor) -> int:
    """The dimension of tokens: rows of an activation ``(tokens, features)``, sequence positions of
    attention states ``(batch, heads, seq, head_dim)``."""
    return 2 if data.ndim == 4 else 0


def extremes_of(data: torch.Tensor) -> torch.Tensor:
    """Each channel's min over every token, then its max, as two tokens of ``data``'s layout
    (``(2, features)``; attention states ``(2, heads, 1, head_dim)``): a per-channel figure reduces
    them as it reduces ``data`` and finds every channel's range, of every token."""
    dims = (0, 2) if data.ndim == 4 else (0,)
    return torch.cat([data.amin(dim=dims, keepdim=True), data.amax(dim=dims, keepdim=True)]).to(torch.float32)


def kept_rows(data: torch.Tensor) -> torch.Tensor:
    """A seeded subset of ``data``'s tokens in their order, at most ``KEPT_VALUES`` values and at
    least one token (``data`` itself when it holds no more)."""
    dim = token_dim(data)
    tokens = data.shape[dim]
    keep = max(1, KEPT_VALUES // max(1, data.numel() // max(1, tokens)))
    if tokens <= keep:
        return data
    generator = torch.Generator().manual_seed(SUBSAMPLE_SEED)
    chosen = torch.randperm(tokens, generator=generator)[:keep].sort().values
    return data.index_select(dim, chosen.to(data.device))


def _chunks(data: torch.Tensor) -> Iterator[torch.Tensor]:
    """``data`` as float32 chunks of whole tokens of at most ``_CHUNK_VALUES`` values (one token
    when a token holds more)."""
    dim = token_dim(data)
    tokens = data.shape[dim]
    step = max(1, _CHUNK_VALUES // max(1, data.numel() // max(1, tokens)))
    for start in range(0, tokens, step):
        yield data.narrow(dim, start, min(step, tokens - start)).to(torch.float32)


def _finite_range(part: torch.Tensor) -> tuple[float | None, float | None]:
    """The least and largest finite value of ``part`` (None, None when it holds none)."""
    finite = part.isfinite()
    if not bool(finite.all()):
        part = part.masked_select(finite)
    if part.numel() == 0:
        return None, None
    low, high = torch.aminmax(part)
    return float(low), float(high)


def summarise(data: torch.Tensor) -> KeptValues:
    """What a kept run holds of ``data`` (an activation's sample with at least one token) beside its
    kept rows."""
    return KeptValues(ValueHistogram.of(data), extremes_of(data))
