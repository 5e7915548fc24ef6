"""Two kept runs side by side: the same layer's ranges, scales and errors per observer, across two
formats, two calibration sets or two models. Pure frames of the two runs' results; the Runs page
draws them (``lab.results.plots.metric_bars`` takes ``bars``)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.history.index import RunRecord
from lab.results.ranges import envelope

FIGURES = ("clips below", "clips above", "scale median", "scale max", "global scale", *ob.METRIC_KEYS)
"""What the comparison shows of each observer on each side: where its format clips (the range),
its scales, and every error metric."""


def figures(entry: TensorAnalysis) -> pd.DataFrame:
    """Per observer that gave qparams on ``entry``: ``FIGURES`` (``global scale`` empty without one)."""
    rows = []
    for result in entry.results:
        qp = result.qparams
        if qp is None:
            continue
        lo, hi = envelope(result, entry.spec)
        scale = qp.scale.detach().float().flatten()
        globals_ = None if qp.global_scale is None else float(qp.global_scale.float().flatten()[0])
        row = {"observer": result.name, "clips below": lo, "clips above": hi}
        row |= {"scale median": float(scale.median()), "scale max": float(scale.max()), "global scale": globals_}
        rows.append(row | {metric: result.metrics.get(metric) for metric in ob.METRIC_KEYS})
    return pd.DataFrame(rows, columns=["observer", *FIGURES])


def side_by_side(first: TensorAnalysis, second: TensorAnalysis, labels: Sequence[str] = ("A", "B")) -> pd.DataFrame:
    """One row per observer of either run (the first's order, then the second's), each figure
    twice: ``<figure> · A`` and ``<figure> · B`` (empty where that run has no such observer; a
    figure neither run has, such as a global scale outside NVFP4, is left out)."""
    a, b = figures(first), figures(second)
    frame = a.merge(b, on="observer", how="outer", suffixes=tuple(f" · {label}" for label in labels), sort=False)
    order = list(dict.fromkeys([*a["observer"], *b["observer"]]))
    frame = frame.set_index("observer").loc[order].reset_index()
    pairs = [[f"{name} · {label}" for label in labels] for name in FIGURES]
    frame = frame.astype({column: float for pair in pairs for column in pair})  # a missing figure is NaN
    shown = [column for pair in pairs if frame[pair].notna().any(axis=None) for column in pair]
    return frame[["observer", *shown]]


def bars(first: TensorAnalysis, second: TensorAnalysis, labels: Sequence[str] = ("A", "B")) -> pd.DataFrame:
    """The two runs' figures as ``metric_bars`` draws a table: ``layer`` is the run's label,
    ``tensor`` its layer and tensor, one row per observer."""
    parts = [
        figures(entry).assign(layer=label, tensor=f"{entry.layer} {entry.tensor}")
        for entry, label in zip((first, second), labels, strict=True)
    ]
    return pd.concat(parts, ignore_index=True)


def common_tensors(first: Analysis, second: Analysis) -> list[tuple[str, str]]:
    """The ``(layer, tensor)`` pairs both runs analysed, in the first's order."""
    theirs = set(second.keys())
    return [key for key in first.keys() if key in theirs]


def differences(first: RunRecord, second: RunRecord) -> list[str]:
    """What differs between two runs, in words (``formats``, ``calibration set``, ...)."""
    named = {
        "model": lambda r: r.model,
        "formats": lambda r: r.formats,
        "calibration set": lambda r: r.calibration,
        "observers": lambda r: sorted(r.observers),
        "GPTQ": lambda r: r.gptq,
    }
    return [name for name, of in named.items() if of(first) != of(second)]
