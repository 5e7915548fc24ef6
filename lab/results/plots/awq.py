"""One AWQ mapping's weight observers under AWQ's four variants (issue 41): grouped bars of each
observer's mapping error, one group per variant, so where the ranking turns over between variants
shows as the bars changing order from one group to the next.

It reads rows of ``lab.awq.table.awq_frame`` (mapping, observer, variant, mapping_error, rank,
held_out_error, clipped, ratio, duo, error); a row with an ``error`` has no figures and is left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from lab.results.plots.style import legend_on_top, observer_color

LOG_SPREAD = 20.0
"""Errors spanning more than this factor are drawn on a log axis, so the small ones stay readable
(the clip search's errors are often several times below round-to-nearest's)."""


def _one_mapping(frame: pd.DataFrame) -> str:
    mappings = list(dict.fromkeys(frame["mapping"]))
    if len(mappings) != 1:
        raise ValueError(f"AWQ bars draw one mapping at a time, got {len(mappings)}: pick one mapping's rows")
    return mappings[0]


def _strength(ratio: float, duo: object) -> str:
    """The winning candidate for the hover: its strength, and whether the weights took part."""
    if pd.isna(ratio):
        return "not smoothed"
    return f"r = {ratio:.2f}" + ("" if duo else ", activations only")


def awq_bars(frame: pd.DataFrame, order: Sequence[str] | None = None) -> go.Figure:
    """Grouped bars of one mapping: per variant (x, in the rows' order), one bar per observer with
    its mapping error (the parent's relative output error on the calibration tokens), labelled with
    the observer's rank under that variant (#1 = least error). Observers keep their colour of every
    page (``observer_color`` over ``order``). The hover adds the held-out error, the clipped share
    and the winning strength. An axis whose errors span more than ``LOG_SPREAD`` is logarithmic."""
    mapping = _one_mapping(frame)
    rows = frame[pd.to_numeric(frame["mapping_error"], errors="coerce").notna()]
    variants = list(dict.fromkeys(frame["variant"]))
    fig = go.Figure()
    for observer, own in rows.groupby("observer", sort=False):
        fig.add_trace(
            go.Bar(
                x=list(own["variant"]),
                y=[float(v) for v in own["mapping_error"]],
                name=observer,
                marker_color=observer_color(observer, order),
                text=[f"#{int(r)}" for r in own["rank"]],
                textposition="outside",
                customdata=[
                    (float(held), float(clipped), _strength(ratio, duo))
                    for held, clipped, ratio, duo in zip(
                        pd.to_numeric(own["held_out_error"], errors="coerce"),
                        pd.to_numeric(own["clipped"], errors="coerce").fillna(0.0),
                        own["ratio"],
                        own["duo"],
                        strict=True,
                    )
                ],
                hovertemplate=f"{observer} · %{{x}}<br>mapping error %{{y:.4g}} (%{{text}})<br>held-out "
                "%{customdata[0]:.4g}<br>clipped %{customdata[1]:.3%}<br>%{customdata[2]}<extra></extra>",
            )
        )
    errors = [float(v) for v in rows["mapping_error"]]
    log = bool(errors) and min(errors) > 0 and max(errors) / min(errors) > LOG_SPREAD
    fig.update_layout(
        barmode="group",
        title=f"{mapping}: the parent's relative output error per observer under each AWQ variant",
        xaxis={"title": "variant", "categoryorder": "array", "categoryarray": variants},
        yaxis={"title": "mapping error", "tickformat": ".3~g", "type": "log" if log else "linear"},
        height=440,
    )
    return legend_on_top(fig, title="observer", entries=rows["observer"].nunique())
