"""Per-layer sensitivity: quantize one tensor at a time with each observer, everything else float,
and measure what it does to the model's output on held-out text.

The float hidden states at every block boundary are cached by the ``Evaluator``'s runner, so a run
that quantizes one tensor of block k starts from block k (``reuse_prefix``); observers whose
fake-quantized tensor is the same (same spec and the same qparams, e.g. every min-max variant on a
weight, which is observed once) share one run (``dedupe``). Both can be turned off to time the
naive path: a full forward pass per (layer, observer).

The result is a layers x observers table of model-level metrics beside the local metric, the
most sensitive layers ranked, the observer per layer that hurts the model least, and
``choices(metric)``: "choose by" a model-level metric through ``lab.results.choose``, the one
ranking rule. ``compare`` evaluates such a choice end to end against "all min-max" and "all
best-local".
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.effect.evaluate import (
    ALL_MINMAX,
    ChoiceSet,
    Evaluation,
    Evaluator,
    all_observer,
    best_local,
    check_applies,
    from_analysis,
)
from lab.export.json_values import json_safe
from lab.results import Choices, Effect, check_metric, choose, higher_is_better
from lab.vocab import DEFAULT_METRIC, MODEL_METRICS, model_metric
from sample_models.effect import TensorQuant

Key = tuple[str, str]
ProgressFn = Callable[[int, int, str], None]
BY_MODEL = "best by model"
SENSITIVITY_FORMAT = "observer-lab-sensitivity"


def quant_digest(entry: TensorAnalysis, quant: TensorQuant) -> str:
    """Identifies the fake-quantized tensor: the same spec and qparams (and GPTQ weight) give the same run."""
    digest = hashlib.sha256(repr((entry.layer, entry.tensor, entry.spec.to_dict())).encode())
    if quant.weight is not None:
        digest.update(quant.weight.detach().float().cpu().contiguous().numpy().tobytes())
    if quant.qparams is not None:
        qp = quant.qparams
        for part in (qp.scale, qp.zero_point, qp.global_scale, qp.extras.get("g_idx")):
            if part is not None:
                digest.update(part.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Sensitivity:
    """A sensitivity sweep's table and what it says.

    ``frame``: one row per (layer, tensor, observer): the local metric (``local_<metric>``), every
    model-level metric of the model's kind, the block the run started at. ``metric``: the
    model-level metric that ranks (``kl`` for decoders, ``cosine`` for encoders by default).
    """

    frame: pd.DataFrame
    metric: str
    local_metric: str
    kind: str
    runs: int
    unique_runs: int
    seconds: float
    baseline: dict[str, float]

    @property
    def effect(self) -> Effect:
        """``{(layer, tensor): {observer: {metric: value}}}`` for ``lab.results.rank``."""
        found: dict[Key, dict[str, dict[str, float]]] = {}
        names = [m for m in MODEL_METRICS if m in self.frame.columns]
        for row in self.frame.itertuples(index=False):
            values = {m: getattr(row, m) for m in names}
            found.setdefault((row.layer, row.tensor), {})[row.observer] = values
        return found

    def choices(self, analysis: Analysis, metric: str | None = None) -> Choices:
        """The observer per tensor that hurts the model least by ``metric`` (a model-level name)."""
        name = metric or self.metric
        chosen = choose(analysis, model_metric(name), self.effect)
        return chosen

    def ranking(self) -> pd.DataFrame:
        """Tensors, most sensitive first: the model-level damage with the observer that hurts least
        (what quantizing this tensor costs at best) and with the one that hurts most."""
        m, high = self.metric, higher_is_better(model_metric(self.metric))
        rows = []
        for (layer, tensor), group in self.frame.groupby(["layer", "tensor"], sort=False):
            ordered = group.sort_values(m, ascending=not high, kind="stable")
            best, worst = ordered.iloc[0], ordered.iloc[-1]
            rows.append(
                {
                    "layer": layer,
                    "tensor": tensor,
                    "least harmful": best["observer"],
                    f"{m} at best": best[m],
                    "most harmful": worst["observer"],
                    f"{m} at worst": worst[m],
                }
            )
        table = pd.DataFrame(rows).sort_values(f"{m} at best", ascending=high, kind="stable").reset_index(drop=True)
        table.insert(0, "rank", range(1, len(table) + 1))
        return table

    def best_per_layer(self, analysis: Analysis) -> pd.DataFrame:
        """Per tensor: the observer that hurts the model least, the best by the local metric, and
        whether they agree (does the best observer per tensor give the best model output?)."""
        by_model = self.choices(analysis)
        by_local = choose(analysis, self.local_metric)
        values = self.frame.set_index(["layer", "tensor", "observer"])[self.metric]
        rows = []
        for key, observer in by_model.items():
            local = by_local.get(key)
            rows.append(
                {
                    "layer": key[0],
                    "tensor": key[1],
                    "best by model": observer,
                    self.metric: values.get((*key, observer)),
                    f"best by {self.local_metric}": local,
                    f"{self.metric} of that": None if local is None else values.get((*key, local)),
                    "same": observer == local or values.get((*key, observer)) == values.get((*key, local)),
                }
            )
        return pd.DataFrame(rows)

    def to_dict(self, analysis: Analysis) -> dict[str, Any]:
        return json_safe(
            {
                "metric": self.metric,
                "local_metric": self.local_metric,
                "runs": self.runs,
                "unique_runs": self.unique_runs,
                "seconds": self.seconds,
                "float": self.baseline,
                "table": self.frame.to_dict("records"),
                "ranking": self.ranking().to_dict("records"),
                "best_per_layer": self.best_per_layer(analysis).to_dict("records"),
            }
        )


def sensitivity(
    evaluator: Evaluator,
    analysis: Analysis,
    *,
    tensors: Sequence[str] = ("weight",),
    observers: Sequence[str] | None = None,
    metric: str | None = None,
    local_metric: str = DEFAULT_METRIC,
    reuse_prefix: bool = True,
    dedupe: bool = True,
    progress: ProgressFn | None = None,
) -> Sensitivity:
    """Quantize each analysed tensor of the kinds ``tensors`` alone with each observer that gave
    qparams on it (or ``observers``), and measure the model-level metrics. ``metric`` ranks
    (default: the first metric of the model's kind)."""
    metric = metric or evaluator.default_metric
    if metric not in evaluator.metric_names:
        raise ValueError(
            f"{metric!r} is not a metric of a {evaluator.kind}; choose from {', '.join(evaluator.metric_names)}"
        )
    check_metric(local_metric)
    entries = [e for e in analysis.entries if e.tensor in tensors]
    if not entries:
        raise ValueError(f"the analysis has no {' or '.join(tensors)} tensor to measure sensitivity on")
    jobs = [
        (e, r)
        for e in entries
        for r in e.results
        if r.qparams is not None and (observers is None or r.name in observers)
    ]
    if not jobs:
        raise ValueError("no observer gave qparams on these tensors: nothing to measure")
    start_time = time.perf_counter()
    done: dict[str, tuple[dict[str, float], int]] = {}
    checked: set[Key] = set()
    rows = []
    for step, (entry, result) in enumerate(jobs):
        if progress is not None:
            progress(step, len(jobs), f"{entry.layer} · {entry.tensor} · {result.name}")
        one = from_analysis(analysis, {(entry.layer, entry.tensor): result.name}, result.name)
        if (entry.layer, entry.tensor) not in checked:
            check_applies(one, evaluator.model)
            checked.add((entry.layer, entry.tensor))
        quant = one.tensors[(entry.layer, entry.tensor)]
        key = quant_digest(entry, quant) if dedupe else f"{step}"
        if key not in done:
            run = evaluator.runner.run(one.tensors, None if reuse_prefix else 0, sqnr=False)
            done[key] = (evaluator.metrics(run), run.start)
        values, start = done[key]
        rows.append(
            {
                "layer": entry.layer,
                "tensor": entry.tensor,
                "observer": result.name,
                f"local_{local_metric}": result.metrics.get(local_metric),
                **{m: values[m] for m in evaluator.metric_names},
                "first_block": start,
            }
        )
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return Sensitivity(
        pd.DataFrame(rows),
        metric,
        local_metric,
        evaluator.kind,
        len(jobs),
        len(done),
        time.perf_counter() - start_time,
        evaluator.float_metrics(),
    )


def compare(
    evaluator: Evaluator, analysis: Analysis, table: Sensitivity, metric: str | None = None
) -> list[Evaluation]:
    """End-to-end evaluations of the set chosen by a model-level ``metric`` against "all min-max"
    and "all best-local" on the same tensors, after the float model (the baseline)."""
    from lab.effect.evaluate import float_set

    chosen = table.choices(analysis, metric)
    keys = list(chosen)
    sets: list[ChoiceSet] = [float_set()]
    if "minmax" in analysis.config.observer_names:
        sets.append(all_observer(analysis, "minmax", ALL_MINMAX, keys))
    sets.append(best_local(analysis, table.local_metric, keys))
    sets.append(from_analysis(analysis, chosen, f"{BY_MODEL} ({metric or table.metric})"))
    return [evaluator.evaluate(s) for s in sets]
