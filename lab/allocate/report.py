"""The allocation's self-contained HTML report (``allocate --report``): the frontier, the chosen
allocation's layers × schemes view, every measured point with its prediction (scoring part), its
in-sample figure (scoring part) and its measured one (measuring part), and where the two part.
plotly.js is embedded once, inline, so the file opens offline like the run's report."""

from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path

from lab.allocate import plots
from lab.allocate.frontier import Frontier, Options, Point
from lab.scheme.cost import LayerSizes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; font-size: 0.9rem; }
th { background: #f3f3f3; }
"""


def render(frontier: Frontier, chosen: Point, options: Options, sizes: LayerSizes) -> str:
    """The report's HTML."""
    figures = [plots.frontier_figure(frontier), plots.allocation_figure(chosen, options, frontier.metric)]
    drawn = [f.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False) for i, f in enumerate(figures)]
    table = plots.points_frame(frontier).to_html(index=False, float_format=lambda v: f"{v:.5g}", border=0)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in frontier.notes) or "<li>none</li>"
    spearman = "n/a" if frontier.spearman is None else f"{frontier.spearman:.3f}"
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Observer Lab allocation</title>"
        f"<style>{_STYLE}</style></head><body><h1>Budgeted allocation</h1>"
        f"<p>{html.escape(chosen.name)}: {chosen.bits_per_weight:.4f} bits per weight over {len(sizes.shapes)} "
        f"layers, a {chosen.checkpoint_bytes:,}-byte checkpoint. Made {created}.</p>"
        f"<h2>Frontier</h2><p>Held-out text: {html.escape(frontier.held_out)}. Predicted: the sum of the layers' "
        "scores; in sample: every layer quantized at once, on the scoring part; measured: the same on the "
        f"measuring part (out of sample).</p>{drawn[0]}"
        f"<p>Predicted (scoring part) against measured (measuring part): Spearman {spearman}.</p>"
        f"<h3>Where prediction and measurement part</h3><ul>{notes}</ul>{table}"
        f"<h2>The allocation</h2>{drawn[1]}</body></html>"
    )


def write_report(path: str | Path, frontier: Frontier, chosen: Point, options: Options, sizes: LayerSizes) -> Path:
    """Write ``render``'s report to ``path``; returns the path."""
    out = Path(path)
    out.write_text(render(frontier, chosen, options, sizes), encoding="utf-8")
    return out
