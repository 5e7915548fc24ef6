"""GPTQ's errors on inputs it never saw. GPTQ minimises ``‖WX − ŴX‖²`` on the calibration tokens;
with few tokens it fits them (on a small model the calibration error can fall thousands of times
below round-to-nearest's), so the same error on held-out inputs is what carries over to a model's
use, and the figure an observer's ranking under GPTQ should trust.

The held-out inputs are the lab's held-out paragraphs (``sample_models.effect.held_out_texts``, no
sentence shared with the calibration texts), as many windows of the same length as the calibration
set, run through the model as it is (never quantized: a held-out figure is a property of the layer,
not of what propagation did before it). One pass for every layer, its Hessian streamed like the
calibration statistics; no token is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import observers as ob
from lab.analyse.run_config import RunConfig
from lab.calibrate.activations import input_statistics
from lab.calibrate.stream import MeanStatistic
from lab.scale.distributed import Ranks
from sample_models.effect import held_out_texts

KEPT_BYTES = 16 << 20
"""The capture keeps a sample of tokens whatever it is asked; this pass reads none, so a small one."""


def held_out_hessians(model: Any, layers: Sequence[str], config: RunConfig, ranks: Ranks) -> dict[str, torch.Tensor]:
    """``2/n Σ xxᵀ`` of each layer's inputs over the held-out windows (a layer no held-out token
    reached is left out)."""
    if not layers:
        return {}
    statistic = lambda: MeanStatistic(ob.hessian_of_rows)  # noqa: E731
    found = input_statistics(model, layers, config, ranks, statistic, texts=held_out_texts(), max_bytes=KEPT_BYTES)
    across = ranks.reduce if ranks.world_size > 1 else None
    device = model.weight(layers[0]).device
    values = {layer: statistic.value(across, device) for layer, statistic in found.items()}
    return {layer: value for layer, value in values.items() if value is not None}
