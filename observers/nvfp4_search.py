"""llm-compressor 0.14's NVFP4 range-expansion observers, and the names people type for ours.

``nvfp4_expanded_mse`` and ``nvfp4_expanded_imatrix`` are llm-compressor's shrink-grid searches
with defaults tuned for NVFP4: the search starts above the observed range (``expand`` 1.8) and
shrinks down to about 0.8x of it on a finer grid (200) with no early stop (``patience`` 1000).
FP4's largest element 6 and E4M3 block scales make a slightly larger block scale than
``amax / 6`` often cheaper overall: it moves more elements onto exact grid points. As in
llm-compressor, candidates are scored with free fp32 scales and only the chosen range goes
through the NVFP4 rule (``observers.lc_search``).

Aliases: ``fouroversix`` is llm-compressor's other name for ``nvfp4_expanded_mse`` (it warns that
it is an alias; ours simply resolves), ``static_minmax`` its name for our running ``minmax``,
``memoryless_mse`` its name for ``mse_grid``. llm-compressor's ``minmax`` (a moving average, our
``moving_average_minmax``) and ``mse`` (our ``mse_grid_moving_average``) cannot be aliases: those
names are ours for other rules.
"""

from __future__ import annotations

from dataclasses import replace

from observers.base import register, register_alias
from observers.granularity import Flat
from observers.lc_search import free_scale_spec, lc_grid_search
from observers.mse_grid import IMatrixMSEObserver, MSEGridObserver, shrink_factors

EXPAND = 1.8
MAXSHRINK = 1 - 0.8 / EXPAND
"""Shrink limit that ends the search near 0.8x of the observed range (1.8 x (1 - maxshrink) = 0.8)."""


def _nvfp4_defaults(knobs: dict, patience_doc: str) -> dict:
    """``knobs`` with llm-compressor's NVFP4 defaults: expand 1.8, maxshrink 1 - 0.8/1.8, grid 200,
    patience 1000, norm 2.4 (declarations otherwise unchanged)."""
    return {
        **knobs,
        "expand": replace(knobs["expand"], default=EXPAND),
        "maxshrink": replace(knobs["maxshrink"], default=MAXSHRINK),
        "grid": replace(knobs["grid"], default=200.0),
        "patience": replace(knobs["patience"], default=1000, doc=patience_doc),
        "norm": replace(knobs["norm"], default=2.4),
    }


@register
class NVFP4ExpandedMSEObserver(MSEGridObserver):
    """``mse_grid`` with llm-compressor's NVFP4 defaults: search from 1.8x the range down to ~0.8x.

    Rule: as ``mse_grid`` (start at ``expand·(min, max)``, try ``p = 1 - i/grid`` for
    ``i < int(maxshrink·grid)``, error ``Σ|fake_quant(x) - x|^norm`` per group, first best kept,
    stop after ``patience`` candidates that improved no group), with ``expand`` 1.8,
    ``maxshrink`` 1 - 0.8/1.8, ``grid`` 200 (111 candidates), ``patience`` 1000, ``norm`` 2.4.
    NVFP4 candidates are scored with free fp32 scales (no E4M3 rounding, no global scale), as
    llm-compressor does; the chosen range then gives the global and E4M3 block scales.
    Reference: llm-compressor 0.14 ``nvfp4_expanded_mse`` (NVFP4ExpandedMSEObserver, CPU path);
    alias ``fouroversix``. Memoryless like ``mse_grid``.
    """

    name = "nvfp4_expanded_mse"
    tuned_for = ("nvfp4",)
    description = "mse_grid from 1.8x the range down to 0.8x, grid 200, patience 1000 (LC 0.14 nvfp4_expanded_mse)"
    knobs = _nvfp4_defaults(MSEGridObserver.knobs, "Stop after this many candidates that improved no group")

    def _observe(self, flat: Flat) -> None:
        """llm-compressor's loop, errors measured directly (``observers.lc_search``, which takes the
        native float-grid kernel on fp32 CPU data)."""
        self.min_val, self.max_val = lc_grid_search(
            flat,
            free_scale_spec(self.spec),
            shrink_factors(self.maxshrink, self.grid),
            self.norm,
            self.patience,
            self.expand,
            self.max_working_bytes,
            reduce=self._across,
            apart=self._apart,
        )


@register
class NVFP4ExpandedIMatrixObserver(IMatrixMSEObserver):
    """``imatrix_mse`` with llm-compressor's NVFP4 defaults: 1.8x down to ~0.8x of the range.

    Rule: as ``imatrix_mse`` (importance-weighted errors, ``max(1, int(maxshrink·grid)) + 1``
    candidates, ``patience`` 0 never stops), with ``expand`` 1.8, ``maxshrink`` 1 - 0.8/1.8,
    ``grid`` 200 (112 candidates), ``norm`` 2.4, ``patience`` 1000. Importance from the
    ``importance`` knob or ``observe_inputs``.
    Reference: llm-compressor 0.14 ``nvfp4_expanded_imatrix`` (NVFP4ExpandedIMatrixObserver).
    """

    name = "nvfp4_expanded_imatrix"
    tuned_for = ("nvfp4",)
    description = "imatrix_mse from 1.8x the range down to 0.8x, grid 200, norm 2.4 (LC 0.14 nvfp4_expanded_imatrix)"
    knobs = _nvfp4_defaults(IMatrixMSEObserver.knobs, "Stop after this many candidates that improved no group; 0 never")


register_alias("fouroversix", "nvfp4_expanded_mse")
register_alias("static_minmax", "minmax")
register_alias("memoryless_mse", "mse_grid")
