"""An AWQ run read back as a table (``lab.awq.run``): per mapping and weight observer, the parent's
relative output error under each variant on calibration and held-out tokens, the balance layers'
own errors and clipped shares, and each observer's place among the observers under each variant,
so a person sees where the ranking turns over."""

from __future__ import annotations

import pandas as pd

from lab.awq.run import AWQRun
from lab.awq.search import Variant

COLUMNS = [
    "mapping",
    "observer",
    "variant",
    "mapping_error",
    "rank",
    "held_out_error",
    "held_out_rank",
    "gptq_error",
    "gptq_rank",
    "gptq_held_out_error",
    "gptq_held_out_rank",
    "layer_error",
    "held_out_layer_error",
    "clipped",
    "ratio",
    "duo",
    "error",
]


def awq_frame(run: AWQRun) -> pd.DataFrame:
    """One row per (mapping, observer, variant); ``layer_error`` (``held_out_layer_error`` on held-out
    tokens) and ``clipped`` are the means over the mapping's balance layers; ``rank`` (and each
    ``*_rank`` of its figure) is the observer's place among the observers under the same variant on
    the same mapping (1 = least error). The GPTQ columns (AWQ then GPTQ) only for a run with GPTQ."""
    rows = [
        {
            "mapping": result.mapping.name,
            "observer": row.observer,
            "variant": str(row.variant),
            "mapping_error": row.mapping_error,
            "held_out_error": row.held_out_error,
            "gptq_error": row.gptq_error,
            "gptq_held_out_error": row.gptq_held_out_error,
            "layer_error": _mean(row.layer_errors),
            "held_out_layer_error": _mean(row.held_out_layer_errors),
            "clipped": _mean(row.clipped),
            "ratio": row.ratio,
            "duo": row.duo,
            "error": row.error,
        }
        for result in run.results
        for row in result.rows
    ]
    frame = pd.DataFrame(rows, columns=[c for c in COLUMNS if not c.endswith("rank")])
    by = frame.groupby(["mapping", "variant"], sort=False)
    frame["rank"] = by["mapping_error"].rank(method="min").astype("Int64")
    frame["held_out_rank"] = by["held_out_error"].rank(method="min").astype("Int64")
    frame["gptq_rank"] = by["gptq_error"].rank(method="min").astype("Int64")
    frame["gptq_held_out_rank"] = by["gptq_held_out_error"].rank(method="min").astype("Int64")
    shown = COLUMNS if frame["gptq_error"].notna().any() else [c for c in COLUMNS if not c.startswith("gptq")]
    return frame[shown]


def _strength(ratio: float, duo: bool) -> str:
    """The winning candidate in words: its strength, and whether the weights took part."""
    if ratio == 0 and not duo:
        return "s=1"
    return f"r={ratio:.2f}" + ("" if duo else " (activations only)")


def _mean(values: dict[str, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def best_observers(frame: pd.DataFrame, column: str = "mapping_error") -> pd.DataFrame:
    """Per mapping, the best observer under each variant (by ``column``): mappings × variants."""
    usable = frame.dropna(subset=[column])
    best = usable.loc[usable.groupby(["mapping", "variant"], sort=False)[column].idxmin()]
    table = best.pivot(index="mapping", columns="variant", values="observer")
    return table.reindex(index=list(dict.fromkeys(frame["mapping"])), columns=[str(v) for v in Variant])


def awq_lines(run: AWQRun) -> list[str]:
    """The table as the CLI prints it: a head line, a line per (mapping, observer) with every
    variant's error and rank, and per mapping the best observer under each variant."""
    frame = awq_frame(run)
    settings = run.awq
    ratios = settings.clip_ratios()
    lines = [
        f"# AWQ (n_grid {settings.n_grid}, duo scaling {settings.duo_scaling}, clip ratios {ratios[0]}..{ratios[-1]} "
        f"by {settings.clip_step}; {run.tokens} calibration tokens, {run.held_out_tokens} held-out): the parent's "
        "relative output error per mapping and observer, its rank among the observers (held-out in brackets)\n"
    ]
    lines += [f"# left out: {line}\n" for line in run.left_out]
    for (mapping, observer), rows in frame.groupby(["mapping", "observer"], sort=False):
        cells = []
        for row in rows.itertuples():
            if isinstance(row.error, str):
                cells.append(f"{row.variant}: not available ({row.error})")
                continue
            strength = "" if pd.isna(row.ratio) else f" {_strength(row.ratio, row.duo)}"
            held = "" if pd.isna(row.held_out_error) else f" [{row.held_out_error:.4g} #{row.held_out_rank}]"
            if not pd.isna(getattr(row, "gptq_error", None)):
                held += f" gptq {row.gptq_error:.4g} #{row.gptq_rank}"
                if not pd.isna(row.gptq_held_out_error):
                    held += f" [{row.gptq_held_out_error:.4g} #{row.gptq_held_out_rank}]"
            layer = f" layer {row.layer_error:.4g}"
            layer += "" if pd.isna(row.held_out_layer_error) else f" [{row.held_out_layer_error:.4g}]"
            figures = f"{row.mapping_error:.4g} #{row.rank}{held}{strength}{layer}"
            cells.append(f"{row.variant} {figures} clip {row.clipped:.2%}")
        lines.append(f"{mapping}\t{observer}\t" + "\t".join(cells) + "\n")
    best = best_observers(frame)
    for mapping, picks in best.iterrows():
        named = ", ".join(f"{variant}: {observer}" for variant, observer in picks.items() if isinstance(observer, str))
        turns = " (the ranking turns over)" if picks.dropna().nunique() > 1 else ""
        lines.append(f"best\t{mapping}\t{named}{turns}\n")
    return lines


def effect_lines(effect: pd.DataFrame, metric: str, higher_is_better: bool, deployed_only: bool = False) -> list[str]:
    """The model-level table as the CLI prints it: per observer every measured variant's metrics,
    and per variant the best observer by ``metric``; ``deployed_only``: only the deployed variant
    was asked for, and the header says how to ask for every one."""
    if effect.empty:
        return []
    metrics = [c for c in effect.columns if c not in ("observer", "variant")]
    which = "; the deployed variant's, --awq-model-level all for every one" if deployed_only else ""
    lines = [
        f"# model-level, held-out text, every balance layer quantized by the variant (the other layers float{which})\n"
    ]
    for observer, rows in effect.groupby("observer", sort=False):
        cells = [f"{r.variant} " + " ".join(f"{m}={getattr(r, m):.4g}" for m in metrics) for r in rows.itertuples()]
        lines.append(f"model\t{observer}\t" + "\t".join(cells) + "\n")
    for variant, best in best_model_level(effect, metric, higher_is_better).items():
        lines.append(f"best model-level\t{variant}\t{best['observer']} ({metric}={best[metric]:.4g})\n")
    return lines


def best_model_level(effect: pd.DataFrame, metric: str, higher_is_better: bool) -> dict[str, pd.Series]:
    """Per variant, the model-level row (observer and metrics) nearest the float model by ``metric``."""
    return {
        variant: rows.loc[rows[metric].idxmax() if higher_is_better else rows[metric].idxmin()]
        for variant, rows in effect.groupby("variant", sort=False)
    }
