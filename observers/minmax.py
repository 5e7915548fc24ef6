"""The min-max family: running, memoryless and moving-average ranges.

All three reduce each batch to a per-group ``(min, max)`` with ``reduce_min_max`` (one read of
fp32 CPU data with the native kernel of ``observers.kernels``, else two eager passes) and differ
only in how batches combine.
"""

from __future__ import annotations

import torch

from observers.base import NonFiniteStatistics, Observer, register
from observers.granularity import Flat, all_finite
from observers.knobs import Knob
from observers.shared import EXACT_MIN_MAX, part_min_max, shared_min_max

AVERAGING_CONSTANT = Knob(
    0.01,
    float,
    low=0,
    high=1,
    low_open=True,
    doc="Weight c of each new batch in the moving average m = (1 - c)·m + c·new; 1 keeps only the last batch",
)
"""The EMA knob, shared with ``mse_grid_moving_average``."""


class _MinMaxBase(Observer):
    checks_finite_itself = True
    shares_statistics = True
    merge_rule = EXACT_MIN_MAX

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def _reset_statistics(self) -> None:
        self.min_val = self.max_val = None

    def _observe(self, flat: Flat) -> None:
        low, high = part_min_max(flat)
        if flat.data.numel() and not (all_finite(low) and all_finite(high)):
            raise NonFiniteStatistics
        low, high = shared_min_max(low, high, self._across)
        if self.min_val is None:
            self.min_val, self.max_val = low, high
        else:
            self.min_val, self.max_val = self._combine(low, high)

    def _combine(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val


@register
class MinMaxObserver(_MinMaxBase):
    """Running min of mins and max of maxes over every ``observe`` call.

    Reference: torch.ao ``MinMaxObserver``/``PerChannelMinMaxObserver``, llm-compressor
    ``static_minmax``, Quark ``PerTensorMinMaxObserver``. No knobs besides ``ignore_nonfinite``.
    With ``strategy="token"`` the qparams describe the tokens of the last batch.
    """

    name = "minmax"
    description = "Running min/max over all calibration batches (torch.ao MinMaxObserver, LC static_minmax)"
    once_as = "memoryless_minmax"

    def _combine(self, low, high):
        return torch.minimum(self.min_val, low), torch.maximum(self.max_val, high)


@register
class MemorylessMinMaxObserver(_MinMaxBase):
    """Min/max of the last ``observe`` call only.

    Reference: llm-compressor ``memoryless_minmax``, its default for weights, which are observed
    once. No knobs besides ``ignore_nonfinite``.
    """

    name = "memoryless_minmax"
    description = "Min/max of the last batch only (LC memoryless_minmax, the usual weight observer)"

    def _combine(self, low, high):
        return low, high


@register
class MovingAverageMinMaxObserver(_MinMaxBase):
    """Exponential moving average of per-batch min/max.

    The first call sets the range; later calls do ``m = (1 - c)·m + c·new`` with
    ``c = averaging_constant`` (default 0.01; 1.0 keeps only the last batch).
    Reference: torch.ao ``MovingAverageMinMaxObserver`` (and its per-channel twin), llm-compressor
    ``minmax``.
    """

    name = "moving_average_minmax"
    description = "EMA of per-batch min/max, averaging_constant 0.01 (torch.ao MovingAverageMinMax, LC minmax)"
    knobs = {"averaging_constant": AVERAGING_CONSTANT}
    once_as = "memoryless_minmax"
    combining_knobs = ("averaging_constant",)

    def _combine(self, low, high):
        c = float(self.averaging_constant)
        return self.min_val + c * (low - self.min_val), self.max_val + c * (high - self.max_val)
