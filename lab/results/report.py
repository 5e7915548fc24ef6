"""A single self-contained HTML report of one analysis and its chosen observers.

The file must open offline (on a cluster node, attached to a ticket), so plotly.js is embedded
inline exactly once, with the first figure, and every later figure reuses it; nothing is loaded
from a CDN. Figures come from ``lab.results.plots``, the same functions the app draws, so the report and
the app show the same pictures.
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

import observers as ob
from lab.analyse.analysis import Analysis
from lab.provenance import provenance_lines
from lab.results import check_metric, plots, rank, spec_text
from lab.vocab import DEFAULT_METRIC

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; font-size: 0.9rem; }
th { background: #f3f3f3; }
.note { color: #666; font-size: 0.9rem; }
"""


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _choices_table(analysis: Analysis, choices: Mapping[tuple[str, str], str], metric: str) -> str:
    """HTML table: layer, tensor, spec, chosen observer with its metric, runner-up with its metric."""
    rows = []
    for entry in analysis.entries:
        chosen = choices.get((entry.layer, entry.tensor))
        if chosen is None:
            continue
        runner_up = next((r for r in rank(entry, metric) if r.name != chosen), None)
        cells = [
            entry.layer,
            entry.tensor,
            spec_text(entry.spec),
            chosen,
            _fmt(entry.result(chosen).metrics.get(metric)),
            "" if runner_up is None else runner_up.name,
            "" if runner_up is None else _fmt(runner_up.metrics.get(metric)),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    head = ["layer", "tensor", "spec", "chosen", metric, "runner-up", metric]
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def report_figures(analysis: Analysis, metric: str) -> list[go.Figure]:
    """The report's figures, in order: overview heatmap (layers × observers of ``metric``), metric
    bars, and one range histogram per analysed tensor (where each observer's format clips, over
    the data). Separate from ``write_report`` so their layout (margins for long layer names,
    height per row) can be checked on the figure objects."""
    frame = analysis.frame()
    figures = [plots.metric_heatmap(frame, metric), plots.metric_bars(frame, metric)]
    for entry in analysis.entries:
        title = f"{plots.tensor_label(entry.layer, entry.tensor)}: values and where each observer clips"
        figures.append(plots.range_histogram(entry.values, entry.results, entry.spec, title=title))
    return figures


def _frame_table(frame) -> str:
    """A small DataFrame as an HTML table (numbers to 4 significant digits)."""
    head = "<tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns) + "</tr>"
    rows = [
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v) if isinstance(v, float) else str(v))}</td>" for v in row) + "</tr>"
        for row in frame.itertuples(index=False)
    ]
    return f"<table>{head}{''.join(rows)}</table>"


def effect_section(effect: tuple[Any, Any]) -> tuple[list[str], list[go.Figure]]:
    """The model-level section of a report from ``(lab.effect.sensitivity.Sensitivity, [Evaluation, ...])``:
    HTML parts (the choice sets' metrics, the most sensitive tensors) and its figures (the
    sensitivity heatmap, the block SQNR curves, the metric per choice set)."""
    import pandas as pd

    from lab.effect.evaluate import summary_rows
    from lab.results.plots import effect as effect_plots

    table, evaluations = effect
    names = [e.name for e in evaluations]
    float_value = table.baseline.get(table.metric)
    figures = [
        effect_plots.choice_set_bars(names, [e.metrics[table.metric] for e in evaluations], table.metric),
        effect_plots.block_sqnr_figure(names, [e.block_sqnr_db for e in evaluations]),
        effect_plots.sensitivity_heatmap(table.frame, table.metric, float_value),
    ]
    parts = [
        f"<p class='note'>Held-out text, not the calibration text; {table.runs} one-tensor runs "
        f"({table.unique_runs} distinct) in {table.seconds:.1f} s; ranked by {html.escape(table.metric)}.</p>",
        _frame_table(pd.DataFrame(summary_rows(evaluations))),
        "<h3>Most sensitive tensors</h3>",
        _frame_table(table.ranking().head(10)),
    ]
    return parts, figures


def render(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    metric: str = DEFAULT_METRIC,
    effect: tuple[Any, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> str:
    """The report as one HTML document: the choices table and ``report_figures``, and with
    ``effect`` (a sensitivity table and end-to-end evaluations) the model-level section; under
    the title, who asked for it (``provenance``, ``lab.provenance``)."""
    check_metric(metric)
    figures = report_figures(analysis, metric)
    effect_parts, effect_figures = effect_section(effect) if effect is not None else ([], [])
    figures = figures[:2] + effect_figures + figures[2:]
    blocks = [
        fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False) for i, fig in enumerate(figures)
    ]
    source = analysis.facts.name
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in analysis.warnings)
    body = [
        f"<h1>Observer Lab report: {html.escape(str(source))}</h1>",
        f"<p class='note'>observers {html.escape(ob.__version__)} · {created} · chosen by {html.escape(metric)} · "
        f"{len(analysis.entries)} tensor(s) · {analysis.seconds:.2f} s</p>",
        *(f"<p class='note'>{html.escape(line[:1].upper() + line[1:])}.</p>" for line in provenance_lines(provenance)),
        f"<ul class='note'>{warnings}</ul>" if warnings else "",
        "<h2>Choices</h2>",
        _choices_table(analysis, choices, metric),
        "<h2>Overview</h2>",
        *blocks[:2],
        *(["<h2>Model-level effect</h2>", *effect_parts, *blocks[2 : 2 + len(effect_figures)]] if effect else []),
        "<h2>Ranges per tensor</h2>",
        *blocks[2 + len(effect_figures) :],
    ]
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>Observer Lab report</title>"
        f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    path: str | Path,
    metric: str = DEFAULT_METRIC,
    effect: tuple[Any, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``render``'s report to ``path``; returns the path."""
    out = Path(path)
    out.write_text(render(analysis, choices, metric, effect, provenance), encoding="utf-8")
    return out
