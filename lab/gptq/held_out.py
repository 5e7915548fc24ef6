"""GPTQ's errors on inputs it never saw. GPTQ minimises ``‖WX − ŴX‖²`` on the calibration tokens;
with few tokens it fits them (on a small model the calibration error can fall thousands of times
below round-to-nearest's), so the same error on held-out inputs is what carries over to a model's
use, and the figure an observer's ranking under GPTQ should trust.

The held-out inputs are the lab's held-out paragraphs (``sample_models.effect.held_out_texts``, no
sentence shared with the calibration texts), as many windows of the same length as the calibration
set, run through the model as it is (never quantized: a held-out figure is a property of the layer,
not of what propagation did before it). One pass for every layer, its Hessian streamed like the
calibration statistics; no token is kept.

The pass comes before the calibration pass, and a layer's held-out Hessian is read only once its
GPTQ rows are made, so the Hessians wait on disk (``lab.gptq.hessians.SpilledHessians``, a
temporary folder the run removes), not in memory: every layer's at once would be ``(in, in)``
floats each for the whole run (a 4096-wide decoder block's seven layers, 870 MB), beside the
Hessian and factor GPTQ works with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import observers as ob
from lab.analyse.run_config import RunConfig
from lab.calibrate.activations import input_statistics
from lab.calibrate.stream import MeanStatistic
from lab.gptq.hessians import SpilledHessians
from lab.scale.distributed import Ranks
from sample_models.effect import held_out_texts
from sample_models.sequential import return_freed_memory


def held_out_hessians(model: Any, layers: Sequence[str], config: RunConfig, ranks: Ranks) -> SpilledHessians:
    """``2/n Σ xxᵀ`` of each layer's inputs over the held-out windows, each written out as soon as
    it is made (a layer no held-out token reached is left out)."""
    kept = SpilledHessians("gptq-held-out-")
    if not layers:
        return kept
    statistic = lambda: MeanStatistic(ob.hessian_of_rows)  # noqa: E731
    found = input_statistics(model, layers, config, ranks, statistic, texts=held_out_texts())
    across = ranks.reduce if ranks.world_size > 1 else None
    device = model.weight(layers[0]).device
    sharing: dict[int, list[str]] = {}
    for layer, mean in found.items():
        sharing.setdefault(id(mean), []).append(layer)
    for names in sharing.values():
        value = found[names[0]].value(across, device)
        for name in names:
            del found[name]  # the statistic, and the mean it remembers, go once the mean is on disk
        if value is not None:
            kept.put(names, value)
    return_freed_memory()  # the pass's fp64 sums, before the calibration pass makes its own
    return kept
