"""One layer's weight observers under GPTQ beside round-to-nearest (issue 33): grouped bars of each
observer's layer-output error both ways, and the sentence that says whether the ranking turns over.

Both read rows of ``lab.gptq.table.gptq_frame`` (layer, observer, rtn_error, gptq_error, the ranks,
the clipped shares, fallback, error); a row with an ``error`` has no figures and is left out.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from lab.results.plots.style import DATA_COLOR, legend_on_top

RTN_COLOR = DATA_COLOR
GPTQ_COLOR = "#1f77b4"
SIDES = {"rtn": ("round-to-nearest", RTN_COLOR), "gptq": ("GPTQ", GPTQ_COLOR)}
LOG_SPREAD = 20.0
"""Errors spanning more than this factor are drawn on a log axis, so the small ones stay readable."""


def usable_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows with both errors, ordered by round-to-nearest error (best first, ties by name)."""
    rows = frame[pd.to_numeric(frame["rtn_error"], errors="coerce").notna()]
    rows = rows[pd.to_numeric(rows["gptq_error"], errors="coerce").notna()]
    return rows.sort_values(["rtn_error", "observer"], kind="stable")


def _one_layer(frame: pd.DataFrame) -> str:
    layers = list(dict.fromkeys(frame["layer"]))
    if len(layers) != 1:
        raise ValueError(f"GPTQ bars draw one layer at a time, got {len(layers)}: pick one layer's rows")
    return layers[0]


def gptq_bars(frame: pd.DataFrame) -> go.Figure:
    """Grouped bars of one layer: per observer (x, in order of round-to-nearest error, best left),
    its round-to-nearest error (left axis) and its GPTQ error (right axis), each bar labelled with the
    observer's rank on its side (#1 = least error), so a turnover shows as GPTQ's labels out of order.

    Each side has its own axis, coloured as its bars: GPTQ's errors are often an order of magnitude
    below round-to-nearest's, and on one axis their differences, which decide the ranking, would be
    flat. An axis whose errors span more than ``LOG_SPREAD`` is logarithmic. The hover adds the
    clipped share (GPTQ: of the error-updated weights) and a round-to-nearest fallback."""
    layer = _one_layer(frame)
    rows = usable_rows(frame)
    fig = go.Figure()
    axes = {}
    for axis, (side, (name, color)) in zip(("y", "y2"), SIDES.items(), strict=True):
        errors = [float(v) for v in rows[f"{side}_error"]]
        clipped = pd.to_numeric(rows[f"{side}_clipped"], errors="coerce").fillna(0.0)
        fallback = ["<br>GPTQ fell back to round-to-nearest" if side == "gptq" and f else "" for f in rows["fallback"]]
        fig.add_trace(
            go.Bar(
                x=list(rows["observer"]),
                y=errors,
                name=name,
                yaxis=axis,
                offsetgroup=side,
                marker_color=color,
                text=[f"#{int(r)}" for r in rows[f"{side}_rank"]],
                textposition="outside",
                customdata=list(zip(clipped, fallback, strict=True)),
                hovertemplate=f"%{{x}}<br>{name}: %{{y:.4g}} (%{{text}})<br>clipped %{{customdata[0]:.3%}}"
                "%{customdata[1]}<extra></extra>",
            )
        )
        log = bool(errors) and min(errors) > 0 and max(errors) / min(errors) > LOG_SPREAD
        axes[axis] = {
            "title": {"text": f"{name} error", "font": {"color": color}},
            "tickfont": {"color": color},
            "tickformat": ".3~g",
            "type": "log" if log else "linear",
            "rangemode": "tozero",
            "showgrid": axis == "y",
        }
    fig.update_layout(
        barmode="group",
        title=f"{layer}: relative layer-output error, round-to-nearest vs GPTQ (each on its own axis)",
        xaxis={"title": "observer (best by round-to-nearest first)", "automargin": True},
        yaxis=axes["y"],
        yaxis2={**axes["y2"], "overlaying": "y", "side": "right"},
        height=440,
    )
    return legend_on_top(fig, title="quantized by", entries=len(SIDES))


def _best(rows: pd.DataFrame, side: str) -> pd.DataFrame:
    return rows[rows[f"{side}_rank"] == 1].sort_values("observer", kind="stable")


def _named(best: pd.DataFrame) -> str:
    names = list(best["observer"])
    return names[0] if len(names) == 1 else f"{names[0]} (tied with {', '.join(names[1:])})"


def gptq_turnover(frame: pd.DataFrame) -> str:
    """In words, per layer of ``frame``: whether the best observer by round-to-nearest error is
    also the best under GPTQ, and if not, which is and where each lands on the other side (observers
    tied for best are named together)."""
    sentences = []
    for layer, rows in frame.groupby("layer", sort=False):
        rows = usable_rows(rows)
        if rows.empty:
            sentences.append(f"{layer}: no observer has both errors.")
            continue
        by_rtn, by_gptq = _best(rows, "rtn"), _best(rows, "gptq")
        moved = int((rows["rtn_rank"] != rows["gptq_rank"]).sum())
        if layer not in turned_over(rows):
            kept = by_rtn[by_rtn["gptq_rank"] == 1]
            text = f"{layer}: {_named(kept)}, the best by round-to-nearest error, is also the best under GPTQ"
            text += f" ({moved} of {len(rows)} observers change place below it)." if moved else "; no place changes."
        else:
            text = (
                f"{layer}: the ranking turns over. The best by round-to-nearest error, {_named(by_rtn)}, is "
                f"#{int(by_rtn['gptq_rank'].min())} under GPTQ; the best under GPTQ is {_named(by_gptq)}, "
                f"#{int(by_gptq['rtn_rank'].min())} by round-to-nearest ({moved} of {len(rows)} observers "
                "change place)."
            )
        sentences.append(text)
    return " ".join(sentences)


def turned_over(frame: pd.DataFrame) -> list[str]:
    """The layers of ``frame`` where no observer best by round-to-nearest error is best under GPTQ."""
    rows = usable_rows(frame)
    best = rows[rows["rtn_rank"] == 1]
    kept = set(best.loc[best["gptq_rank"] == 1, "layer"])
    return [layer for layer in dict.fromkeys(best["layer"]) if layer not in kept]


def gptq_turnover_summary(frame: pd.DataFrame) -> str:
    """In words, across every layer of ``frame``: in how many the ranking turns over at the top."""
    layers = list(dict.fromkeys(usable_rows(frame)["layer"]))
    turned = turned_over(frame)
    if not turned:
        return f"Across the {len(layers)} layers, the best by round-to-nearest error is the best under GPTQ in each."
    return (
        f"Across the {len(layers)} layers, the best by round-to-nearest error is not the best under GPTQ in "
        f"{len(turned)}: {', '.join(turned)}."
    )
