"""Where a format clips: the tensor-wide envelope of an observer's representable range, the range
table the Ranges page shows and the sentence saying what its lines mean per group. One answer that
the range table and the range plots (``lab.results.plots.ranges``) both draw."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

import observers as ob
from lab.vocab import TensorKind
from observers.suite import SuiteResult


def envelope(result: SuiteResult, spec: ob.QuantSpec) -> tuple[float, float]:
    """The tensor-wide ``(lo, hi)`` where an observer's format clips: for channel, group, token
    or block granularity the smallest low end and largest high end of ``ob.representable_range``
    over all its qparam groups.

    Not the chosen ``min_val``/``max_val``: what a reader of a range plot or table needs is where
    values start to saturate, and that is the grid's ends (``-128·s`` under the ``half_range``
    rule, ``6·2^e`` for an MX block), which ``clip_ratio`` also counts against."""
    lo, hi = ob.representable_range(result.qparams, spec)
    return float(lo.min()), float(hi.max())


def range_table(
    results: Sequence[SuiteResult], spec: ob.QuantSpec, specs: Mapping[str, ob.QuantSpec] | None = None
) -> pd.DataFrame:
    """Per observer: the tensor-wide range its format keeps unclipped (``envelope``), the
    share of values clipped and the SQNR; ``specs`` as in ``plots.range_histogram``."""
    rows = []
    for r in results:
        if r.qparams is None:
            continue
        lo, hi = envelope(r, (specs or {}).get(r.name, spec))
        clip = r.metrics.get("clip_ratio")
        rows.append(
            {
                "observer": r.name,
                "clips below": lo,
                "clips above": hi,
                "clipped %": None if clip is None else 100 * clip,
                "SQNR dB": r.metrics.get("sqnr_db"),
            }
        )
    return pd.DataFrame(rows)


def granularity_note(spec: ob.QuantSpec, tensor: str = "weight") -> str | None:
    """What the histogram lines mean when there is more than one range per tensor (``tensor``
    ``k``/``v``: per-channel ranges of attention states are per head)."""
    if spec.strategy == "tensor" and not spec.format.is_block:
        return None
    unit = "block" if spec.format.is_block else spec.strategy
    if tensor in (TensorKind.K, TensorKind.V) and unit == "channel":
        unit = "head"
    return (
        f"Granularity is {unit}: each observer chose one range per {unit}. The lines show the tensor-wide "
        "envelope of what each keeps unclipped (smallest low end, largest high end over all of them); see the "
        "Scales page for the ranges per group."
    )
