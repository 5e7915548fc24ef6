"""Benchmark: the per-layer sensitivity sweep (issue 17) on MiniLM's real weights, against the naive
path in the same run.

The sweep quantizes each of MiniLM's 36 encoder Linear weights alone with every weight observer
that gives int4 g128 qparams, everything else float, and measures the change of the sentence
embeddings of the built-in held-out sentences. Ours caches the float hidden states at every block
boundary, so a weight of block k re-runs blocks k..5 only, and runs once per distinct fake-quantized
weight (observers with the same qparams share a run); the naive path (the reference column) runs
the whole model once per (layer, observer). Target: ours under 60 s on CPU.
Each path runs once (a sweep is a minute of work), layer by layer with the two paths interleaved,
after the observers and the float model ran; the agreement column compares the two tables.
``--quick``: the first 6 weights.

    python -m bench --only effect [--quick]
"""

from __future__ import annotations

import time
from dataclasses import replace

import pandas as pd

import observers as ob
from bench.common import SETTINGS, case, synchronize
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.effect.evaluate import Evaluator
from lab.effect.sensitivity import sensitivity
from sample_models import open_model

SPEC = ob.QuantSpec("int4", strategy="group", group_size=128)
TARGET_S = 60.0


def _timed(fn, device: str):
    synchronize(device)
    start = time.perf_counter()
    value = fn()
    synchronize(device)
    return time.perf_counter() - start, value


def _interleaved(evaluator: Evaluator, analysis, device: str) -> tuple[float, float, list, list]:
    """Both sweeps, one layer at a time, ours and the naive path alternating which goes first, so
    that load from other processes on a shared machine hits them alike."""
    ours_s = naive_s = 0.0
    ours, naive = [], []
    for i, entry in enumerate(analysis.entries):
        one = replace(analysis, entries=[entry])
        runs = [
            ("ours", lambda one=one: sensitivity(evaluator, one)),
            ("naive", lambda one=one: sensitivity(evaluator, one, reuse_prefix=False, dedupe=False)),
        ]
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            seconds, table = _timed(fn, device)
            if name == "ours":
                ours_s += seconds
                ours.append(table)
            else:
                naive_s += seconds
                naive.append(table)
    return ours_s, naive_s, ours, naive


def cases(device: str = "cpu") -> list[dict]:
    model = open_model("minilm", device=device)
    names = [i.name for i in model.layers("encoder.layer.*") if i.type == "Linear"]
    names = names[:6] if SETTINGS.quick else names
    analysis = analyse(model, names, RunConfig(specs={"weight": SPEC}))
    float_s, evaluator = _timed(lambda: Evaluator(model), device)
    ours_s, naive_s, ours, naive = _interleaved(evaluator, analysis, device)
    ours_frame = pd.concat([t.frame for t in ours], ignore_index=True)
    naive_frame = pd.concat([t.frame for t in naive], ignore_index=True)
    observers = sorted(set(ours_frame["observer"]))
    difference = float((ours_frame["cosine"] - naive_frame["cosine"]).abs().max())
    met = "met" if ours_s < TARGET_S else "not met"
    runs, distinct = sum(t.runs for t in ours), sum(t.unique_runs for t in ours)
    return [
        case(
            f"sensitivity sweep, MiniLM {len(names)} Linear weights x {len(observers)} observers, int4 g128, "
            f"{len(evaluator.runner.batches)} batches / {evaluator.runner.tokens} held-out tokens",
            ours_s,
            reference_s=naive_s,
            reference="naive: full forward per (layer, observer), same run",
            agreement=f"{runs} runs, {distinct} distinct; target < {TARGET_S:.0f} s: {met}; max |cosine diff| vs "
            f"naive {difference:.1e}; float pass {float_s:.2f} s",
        )
    ]
