"""The figures as served beside each layer's own, for tensors a server runs fused with others
(``lab.runtime``): the error table's per-layer columns, one tensor's served-against-own frame (the
Error page's "As served" section) and the one line the CLI prints for a chosen tensor. Nothing
here ranks: ranking by either figure is ``lab.results.rank``'s."""

from __future__ import annotations

from typing import Any

import pandas as pd

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.vocab import PER_LAYER_PREFIX


def fused_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """Per observer of every tensor a server runs fused with others: its metrics with the layer's
    own scales (``per-layer:<metric>``), the fused unit and what it shares (``fused as``), and the
    member whose own range sets the group's shared scale (``scale set by``)."""
    rows = []
    for e in analysis.entries:
        if e.served is None:
            continue
        fused_as = f"{e.served.unit} (one {e.served.collapse})"
        for result in e.per_layer:
            rows.append(
                {"layer": e.layer, "tensor": e.tensor, "observer": result.name}
                | {PER_LAYER_PREFIX + m: result.metrics.get(m) for m in ob.METRIC_KEYS}
                | {"fused as": fused_as, "scale set by": e.served.set_by.get(result.name)}
            )
    return rows


def served_frame(entry: TensorAnalysis, metric: str) -> pd.DataFrame:
    """One fused tensor's observers: ``metric`` as served and with its own scales, what sharing
    costs it (served minus own), and the member whose range sets the shared scale. Empty for a
    tensor served alone."""
    if entry.served is None:
        return pd.DataFrame()
    local = metric.removeprefix(PER_LAYER_PREFIX)
    local = local if local in ob.HIGHER_IS_BETTER else "sqnr_db"
    rows = []
    for served, own in zip(entry.results, entry.per_layer, strict=True):
        if served.qparams is None or own.qparams is None:
            continue
        a, b = served.metrics.get(local), own.metrics.get(local)
        rows.append(
            {
                "observer": served.name,
                f"{local} as served": a,
                f"{local} per layer": b,
                "served − per layer": None if a is None or b is None else a - b,
                "scale set by": entry.served.set_by.get(served.name),
            }
        )
    return pd.DataFrame(rows)


def served_sentence(entry: TensorAnalysis) -> str | None:
    """What a fusing server does with ``entry``, in one sentence (None when it serves it alone)."""
    if entry.served is None:
        return None
    names = ", ".join(member.rpartition(".")[2] for member in entry.served.members)
    return (
        f"A fusing server (vLLM, SGLang) runs {names} as one layer ({entry.served.unit}) with one "
        f"{entry.served.collapse}: the member whose own range reaches farthest sets it, the others' "
        "values are read against it. The figures that rank are those served; each layer's own are beside them."
    )


def served_text(fused: dict[str, Any] | None, metric: str) -> str:
    """The CLI's note on a chosen tensor from its lab file ``fused`` record: the fused unit, what it
    shares, the member whose range sets it, and ``metric`` with the layer's own scales ("" when the
    tensor is served alone)."""
    if fused is None:
        return ""
    local = metric.removeprefix(PER_LAYER_PREFIX)
    setter = (fused["set_by"] or "").rpartition(".")[2] or "none"
    text = f"\tserved as {fused['unit']}, one {fused['shares']} set by {setter}"
    own = fused["per_layer_metrics"].get(local)
    return text + (f"; per layer {local}={float(own):.6g}" if own is not None else "")


def record_value(record: dict[str, Any], metric: str) -> Any:
    """``metric`` of a lab file entry's choice: as served, or with the layer's own scales for a
    ``per-layer:`` metric (its ``fused`` record; a tensor served alone has no other figure)."""
    if metric.startswith(PER_LAYER_PREFIX):
        local = metric.removeprefix(PER_LAYER_PREFIX)
        fused = record.get("fused")
        return (fused["per_layer_metrics"] if fused else record["chosen"]["metrics"]).get(local)
    return record["chosen"]["metrics"].get(metric)
