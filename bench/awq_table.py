"""The table of observers under AWQ on tiny-llama in docs/guides/awq.md (issue 41): its 12 smoothing mappings (per
block q/k/v, gate/up and up → down; grouped-query attention leaves v → o out), int4 symmetric in
groups of 16 (688 columns do not divide 128), the built-in calibration set (32 × 128 tokens, one
record a batch) and held-out text, every weight observer the lab runs by default on that scheme,
llm-compressor 0.14's AWQ defaults (n_grid 20, duo scaling) and ModelOpt's clip ratios. Per
observer and variant, averaged over the mappings: the parent's relative output error on the
calibration tokens and on held-out tokens, and the share of weights that clip; and per variant how
many mappings each observer is best on; and the model-level KL on held-out text with every
balance layer quantized by each observer under each variant.

``python -m bench.awq_table`` prints the markdown tables (a minute or two on 2 cores).
"""

from __future__ import annotations

import time

import pandas as pd

import observers as ob
from lab.awq.effect import model_effect
from lab.awq.run import run_awq
from lab.awq.search import Variant
from lab.awq.table import awq_frame, best_observers
from lab.effect.evaluate import Evaluator
from sample_models import open_model

SPEC = ob.QuantSpec("int4", strategy="group", group_size=16, symmetric=True)


def tables() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, float]:
    """The mean figures per observer × variant, the best-observer counts per variant, the
    model-level KL per observer × variant on held-out text, and the seconds the run took."""
    model = open_model("tiny-llama")
    observers = {name: {} for name in ob.applicable(SPEC, "weight")}
    start = time.perf_counter()
    run = run_awq(model, SPEC, observers, samples=32, seq_len=128, batch_size=1)
    seconds = time.perf_counter() - start
    frame = awq_frame(run)
    means = frame.groupby(["observer", "variant"], sort=False)[["mapping_error", "held_out_error", "clipped"]].mean()
    wide = means.unstack("variant")
    order = [str(v) for v in Variant]
    columns = {}
    for variant in order:
        columns[f"{variant} error"] = wide[("mapping_error", variant)].map(lambda v: f"{v:.3g}")
        columns[f"{variant} held-out"] = wide[("held_out_error", variant)].map(lambda v: f"{v:.3g}")
        columns[f"{variant} clipped"] = wide[("clipped", variant)].map(lambda v: f"{v:.2%}")
    best = best_observers(frame).apply(lambda picks: picks.value_counts()).fillna(0).astype(int)
    effect = model_effect(model, run, Evaluator(model))
    kl = effect.pivot(index="observer", columns="variant", values="kl").reindex(index=list(observers), columns=order)
    return pd.DataFrame(columns), best.reindex(columns=order), kl.map(lambda v: f"{v:.3g}"), seconds


def markdown(frame: pd.DataFrame, first: str) -> str:
    """A frame of ready cells as a markdown table, its index as the first column ``first``."""
    head = "| " + " | ".join([first, *map(str, frame.columns)]) + " |\n|" + "---|" * (len(frame.columns) + 1) + "\n"
    return head + "".join(
        "| " + " | ".join(map(str, [i, *row])) + " |\n" for i, row in zip(frame.index, frame.values, strict=True)
    )


def main() -> None:
    figures, best, kl, seconds = tables()
    print(markdown(figures, "observer"))
    print(markdown(best, "best on (mappings)"))
    print(markdown(kl, "model-level KL"))
    print(f"({seconds:.1f} s)")


if __name__ == "__main__":
    main()
