"""The table of observers under GPTQ on MiniLM in docs/guides/gptq.md (issue 33): its 12 FFN Linears, int4
symmetric in groups of 128, 64 x 128 calibration tokens, every weight observer the lab runs by
default on that scheme; per observer, averaged over the 12 layers: the relative layer-output
error of round-to-nearest and of GPTQ on the calibration inputs and on held-out inputs, the share
of weights that clip, and the sentence-embedding cosine on held-out text with all 12 layers
quantized by that observer, under ``fixed`` scales (llm-compressor 0.14) and ``refit`` (the GPTQ
paper, GPTQModel). llm-compressor's other defaults: activation order static, block 128, dampening
0.01.

``python -m bench.gptq_table`` prints the markdown table (a few minutes on 2 cores).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pandas as pd

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.effect.evaluate import Evaluator, all_observer
from lab.gptq.table import gptq_frame
from sample_models import open_model

LAYERS = [f"encoder.layer.{n}.{part}.dense" for n in range(6) for part in ("intermediate", "output")]
SPEC = ob.QuantSpec("int4", strategy="group", group_size=128)
SCALES = ("fixed", "refit")


def table() -> pd.DataFrame:
    """One row per observer: the figures above, for both scale semantics."""
    model = open_model("minilm")
    evaluator = Evaluator(model)
    rows: dict[str, dict[str, float]] = {}
    for scales in SCALES:
        config = RunConfig(specs={"weight": SPEC}, samples=64, seq_len=128, gptq=ob.GPTQSpec(scales=scales))
        analysis = analyse(model, LAYERS, config)
        frame = gptq_frame(analysis)
        means = frame.groupby("observer")[["rtn_error", "gptq_error", "rtn_held_out", "gptq_held_out", "gptq_clipped"]]
        rounded = replace(analysis, config=replace(config, gptq=None))
        for observer, mean in means.mean().iterrows():
            row = rows.setdefault(observer, {})
            if scales == "fixed":
                row["RTN error"], row["RTN held-out"] = mean["rtn_error"], mean["rtn_held_out"]
                row["RTN clipped"] = frame[frame["observer"] == observer]["rtn_clipped"].mean()
                row["RTN cosine"] = _cosine(evaluator, rounded, observer)
            row[f"GPTQ {scales} error"] = mean["gptq_error"]
            row[f"GPTQ {scales} held-out"] = mean["gptq_held_out"]
            row[f"GPTQ {scales} clipped"] = mean["gptq_clipped"]
            row[f"GPTQ {scales} cosine"] = _cosine(evaluator, analysis, observer)
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("observer").reset_index()


def _cosine(evaluator: Evaluator, analysis, observer: str) -> float:
    return evaluator.evaluate(all_observer(analysis, observer, observer)).metrics["cosine"]


def markdown(frame: pd.DataFrame) -> str:
    """The table as docs/guides/gptq.md shows it: errors to 3 significant digits, shares in %, cosines to 5 places."""
    shown = frame.copy()
    for column in shown.columns[1:]:
        if column.endswith("clipped"):
            shown[column] = shown[column].map(lambda v: f"{v:.2%}")
        elif column.endswith("cosine"):
            shown[column] = shown[column].map(lambda v: f"{v:.5f}")
        else:
            shown[column] = shown[column].map(lambda v: f"{v:.3g}")
    head = "| " + " | ".join(shown.columns) + " |\n|" + "---|" * len(shown.columns) + "\n"
    return head + "".join("| " + " | ".join(map(str, row)) + " |\n" for row in shown.itertuples(index=False))


if __name__ == "__main__":
    start = time.perf_counter()
    print(markdown(table()))
    print(f"({time.perf_counter() - start:.0f} s)")
