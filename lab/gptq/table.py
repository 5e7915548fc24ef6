"""An analysis's GPTQ rows read back (``lab.gptq.layer``): a table per (layer, observer) of the
layer-output error and clipped share under round-to-nearest and under GPTQ, with each observer's
place in its layer under each, so a person sees where the ranking turns over."""

from __future__ import annotations

import pandas as pd

from lab.analyse.analysis import Analysis

COLUMNS = [
    "layer",
    "observer",
    "rtn_error",
    "gptq_error",
    "rtn_rank",
    "gptq_rank",
    "rtn_clipped",
    "gptq_clipped",
    "rtn_held_out",
    "gptq_held_out",
    "held_out_rank",
    "fallback",
    "error",
]


def gptq_frame(analysis: Analysis) -> pd.DataFrame:
    """One row per weight observer and layer; ``*_rank`` is the observer's place in its layer by
    that error (1 = least; lower error is better, as for every error metric of the lab),
    ``held_out_rank`` by GPTQ's error on held-out inputs (``lab.gptq.held_out``)."""
    rows = [
        {
            "layer": entry.layer,
            "observer": row.observer,
            "rtn_error": row.rtn_error,
            "gptq_error": row.gptq_error,
            "rtn_clipped": row.rtn_clipped,
            "gptq_clipped": row.gptq_clipped,
            "rtn_held_out": row.rtn_held_out,
            "gptq_held_out": row.gptq_held_out,
            "fallback": row.fallback,
            "error": row.error,
        }
        for entry in analysis.entries
        if entry.tensor == "weight"
        for row in entry.gptq
    ]
    frame = pd.DataFrame(rows, columns=[c for c in COLUMNS if not c.endswith("_rank")])
    for side in ("rtn", "gptq"):
        frame[f"{side}_rank"] = frame.groupby("layer")[f"{side}_error"].rank(method="min").astype("Int64")
    frame["held_out_rank"] = frame.groupby("layer")["gptq_held_out"].rank(method="min").astype("Int64")
    return frame[COLUMNS]


def gptq_lines(analysis: Analysis) -> list[str]:
    """The table as the CLI prints it (nothing when the run had no GPTQ)."""
    frame = gptq_frame(analysis)
    if frame.empty:
        return []
    settings = analysis.config.gptq
    head = f"# GPTQ ({settings.scales} scales, actorder {settings.actorder}, block {settings.block_size}, "
    head += f"dampening {settings.dampening}): relative layer-output error and clipped share, RTN vs GPTQ; "
    head += "held-out: the errors on held-out inputs\n"
    lines = [head]
    for row in frame.sort_values(["layer", "gptq_rank"], kind="stable").itertuples():
        if row.error is not None and pd.notna(row.error):
            lines.append(f"{row.layer}\t{row.observer}\tGPTQ: not available ({row.error})\n")
            continue
        lines.append(
            f"{row.layer}\t{row.observer}\trtn {row.rtn_error:.4g} (#{row.rtn_rank})\tgptq {row.gptq_error:.4g} "
            f"(#{row.gptq_rank})\tclipped {row.rtn_clipped or 0:.3%} -> {row.gptq_clipped:.3%}"
            + _held_out_text(row)
            + ("\tround-to-nearest fallback" if row.fallback else "")
            + "\n"
        )
    return lines


def _held_out_text(row) -> str:
    if row.gptq_held_out is None or pd.isna(row.gptq_held_out):
        return ""
    return f"\theld-out rtn {row.rtn_held_out:.4g} gptq {row.gptq_held_out:.4g} (#{row.held_out_rank})"
