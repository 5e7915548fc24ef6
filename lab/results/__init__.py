"""Reading an analysis: the one ranking rule, the tables the app and report show, warnings.

``rank`` orders one tensor's observers by a metric (direction from ``higher_is_better``,
observers without a value left out, ties in suite order); ``choose``, the highlighted best
cells, the export's runner-up and the report all go through it, so "best" means one thing
everywhere. ``higher_is_better`` is the one place a metric's direction is decided: plots and the
sensitivity ranking ask it too. Likewise ``envelope``, where a format clips, is the one answer
the range table and the range plots both draw. No streamlit here: pages and the report draw these
frames.

The package also holds what draws them: ``lab.results.plots`` (plotly figures),
``lab.results.report`` (the HTML report) and ``lab.results.dynamic`` (static against run-time
scales).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence

import pandas as pd
import torch

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.served import ServedChoice, as_chosen
from lab.results.served import fused_rows
from lab.vocab import (
    AWQ_METRIC_PREFIX,
    AWQ_METRICS,
    DEFAULT_METRIC,
    FEW_TOKENS,
    GPTQ_METRIC_PREFIX,
    GPTQ_METRICS,
    MODEL_METRIC_PREFIX,
    MODEL_METRICS,
    PER_LAYER_PREFIX,
    TensorKind,
)
from observers.suite import SuiteResult

Choices = dict[tuple[str, str], str]
Effect = Mapping[tuple[str, str], Mapping[str, Mapping[str, float]]]
"""Model-level metrics of quantizing one tensor with one observer (``lab.effect.sensitivity``):
``{(layer, tensor): {observer: {"kl": ..., ...}}}``."""


def check_metric(metric: str) -> str:
    """``metric`` itself (a local metric of ``ob.HIGHER_IS_BETTER``, as served or as ``per-layer:<name>``
    with each layer's own scales, a model-level one as ``model:<name>``, a GPTQ figure as
    ``gptq:<name>``), or a ``ValueError`` naming the metrics there are."""
    if metric.startswith(GPTQ_METRIC_PREFIX) and metric.removeprefix(GPTQ_METRIC_PREFIX) in GPTQ_METRICS:
        return metric
    if metric.startswith(AWQ_METRIC_PREFIX) and metric.removeprefix(AWQ_METRIC_PREFIX) in AWQ_METRICS:
        return metric
    if metric.startswith(PER_LAYER_PREFIX) and metric.removeprefix(PER_LAYER_PREFIX) in ob.HIGHER_IS_BETTER:
        return metric
    if metric not in ob.HIGHER_IS_BETTER and metric.removeprefix(MODEL_METRIC_PREFIX) not in MODEL_METRICS:
        known = [*ob.HIGHER_IS_BETTER, *(PER_LAYER_PREFIX + m for m in ob.HIGHER_IS_BETTER)]
        known += [MODEL_METRIC_PREFIX + m for m in MODEL_METRICS]
        known += [GPTQ_METRIC_PREFIX + m for m in GPTQ_METRICS] + [AWQ_METRIC_PREFIX + m for m in AWQ_METRICS]
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(known)}")
    if metric not in ob.HIGHER_IS_BETTER and not metric.startswith(MODEL_METRIC_PREFIX):
        raise ValueError(f"{metric!r} is a model-level metric: choose by {MODEL_METRIC_PREFIX}{metric}")
    return metric


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better: a local metric (``ob.HIGHER_IS_BETTER``) or a
    model-level one as ``model:<name>`` (``lab.vocab.MODEL_METRICS``). The one direction rule of the
    lab; an unknown metric is a ``ValueError`` naming the known ones (``check_metric``), never a guess."""
    if check_metric(metric).removeprefix(PER_LAYER_PREFIX) in ob.HIGHER_IS_BETTER:
        return ob.HIGHER_IS_BETTER[metric.removeprefix(PER_LAYER_PREFIX)]
    if metric.startswith(GPTQ_METRIC_PREFIX):
        return GPTQ_METRICS[metric.removeprefix(GPTQ_METRIC_PREFIX)]
    if metric.startswith(AWQ_METRIC_PREFIX):
        return AWQ_METRICS[metric.removeprefix(AWQ_METRIC_PREFIX)]
    return MODEL_METRICS[metric.removeprefix(MODEL_METRIC_PREFIX)]


def is_similarity(metric: str) -> bool:
    """Whether the model-level ``metric`` is a similarity to the float model (1: unchanged): the
    higher-is-better ones by ``lab.results.higher_is_better`` (top-1 agreement, cosine, Spearman);
    KL and perplexity are lower-is-better. An unknown metric is a ``ValueError``."""
    return higher_is_better(MODEL_METRIC_PREFIX + metric)


def damage(metric: str, value: float, float_value: float | None = None) -> float:
    """How far ``value`` is from the float model's, as a positive number (0: no change): one minus
    an agreement/cosine/correlation, the relative rise of perplexity, KL itself."""
    if is_similarity(metric):
        return max(1.0 - value, 0.0)
    if metric == "perplexity":
        return abs(value / float_value - 1.0) if float_value else abs(value)
    return max(value, 0.0)


def _values(entry: TensorAnalysis, metric: str, effect: Effect | None) -> dict[str, float]:
    """Each observer's value of ``metric`` on ``entry``: its own metrics for a local metric, the
    model-level effect of quantizing this tensor with it for a ``model:`` one (none without ``effect``)."""
    if metric in ob.HIGHER_IS_BETTER:
        found = {r.name: r.metrics.get(metric) for r in entry.results}
    elif metric.startswith(PER_LAYER_PREFIX):
        found = {r.name: r.metrics.get(metric.removeprefix(PER_LAYER_PREFIX)) for r in per_layer(entry)}
    elif metric.startswith(GPTQ_METRIC_PREFIX):
        found = {row.observer: getattr(row, metric.removeprefix(GPTQ_METRIC_PREFIX)) for row in entry.gptq}
    elif metric.startswith(AWQ_METRIC_PREFIX):
        found = {}  # an AWQ figure ranks a mapping's observers (``lab.awq.deploy``), not an analysis's
    else:
        name = metric.removeprefix(MODEL_METRIC_PREFIX)
        per_observer = (effect or {}).get((entry.layer, entry.tensor), {})
        found = {observer: values.get(name) for observer, values in per_observer.items()}
    return {k: float(v) for k, v in found.items() if v is not None and not math.isnan(float(v))}


def per_layer(entry: TensorAnalysis) -> list[SuiteResult]:
    """``entry``'s results with its own scales: ``per_layer`` for a tensor a server runs fused with
    others, else its results (a tensor served alone is served with its own scales)."""
    return entry.per_layer if entry.served is not None else entry.results


def metric_value(entry: TensorAnalysis, observer: str, metric: str, effect: Effect | None = None) -> float | None:
    """``observer``'s value of ``metric`` on ``entry`` (None when it has none: a GPTQ figure of an
    activation, say)."""
    return _values(entry, metric, effect).get(observer)


def rank(entry: TensorAnalysis, metric: str = DEFAULT_METRIC, effect: Effect | None = None) -> list[SuiteResult]:
    """The observers of ``entry`` that produced qparams and a value for ``metric``, best first
    (ties keep suite order). A model-level metric (``model:kl``) takes its values from ``effect``."""
    sign = 1.0 if higher_is_better(metric) else -1.0
    values = _values(entry, metric, effect)
    usable = [r for r in entry.results if r.qparams is not None and r.name in values]
    return sorted(usable, key=lambda r: -sign * values[r.name])


def choose(analysis: Analysis, metric: str = DEFAULT_METRIC, effect: Effect | None = None) -> Choices:
    """The best observer per ``(layer, tensor)`` by ``metric`` (local, model-level with ``effect``,
    or a GPTQ figure, by which tensors GPTQ does not touch go by ``DEFAULT_METRIC``; an AWQ figure
    ranks a mapping's observers where AWQ deploys (``lab.awq.deploy``), and an analysis's tensors by
    ``DEFAULT_METRIC``); tensors where no observer gave a value are left out."""
    chosen: Choices = {}
    for entry in analysis.entries:
        ranked = rank(entry, metric, effect)
        untouched = metric.startswith(GPTQ_METRIC_PREFIX) and not entry.gptq  # a tensor GPTQ does not touch
        if not ranked and (untouched or metric.startswith(AWQ_METRIC_PREFIX)):
            ranked = rank(entry, DEFAULT_METRIC)
        if ranked:
            chosen[(entry.layer, entry.tensor)] = ranked[0].name
    return chosen


def override(analysis: Analysis, choices: Choices, rules: Sequence[tuple[str, str]], *, part: bool = False) -> Choices:
    """``choices`` with every tensor of the layers a rule's glob matches taking that rule's observer
    (later rules win), the CLI's ``--choose GLOB=OBSERVER``. A glob that matches no analysed layer,
    or an observer that was not run or gave no qparams on a matched tensor: one ``ValueError``
    naming each. ``part``: ``analysis`` is one settled block of a run (what propagation quantizes),
    so a glob may match none of its layers."""
    chosen = dict(choices)
    problems = []
    for pattern, observer in rules:
        matched = [e for e in analysis.entries if fnmatch.fnmatchcase(e.layer, pattern)]
        if not matched and not part:
            problems.append(f"--choose {pattern}={observer}: no analysed layer matches {pattern!r}")
        for entry in matched:
            if observer in usable_observers(entry):
                chosen[(entry.layer, entry.tensor)] = observer
                continue
            ran = any(r.name == observer for r in entry.results)
            why = "gave no qparams there" if ran else "was not run"
            problems.append(f"--choose {pattern}={observer}: {entry.layer} {entry.tensor}: {observer} {why}")
    if problems:
        raise ValueError("cannot apply the choices:\n  - " + "\n  - ".join(problems))
    return chosen


def usable_observers(entry: TensorAnalysis) -> list[str]:
    """Observers that produced qparams on ``entry`` (the ones a person may choose)."""
    return [r.name for r in entry.results if r.qparams is not None]


def first_error(analysis: Analysis, layer: str | None = None) -> str | None:
    """``observer: why`` of the first observer that failed (on ``layer``, or anywhere), or None."""
    for entry in analysis.entries:
        for result in entry.results:
            if result.error and layer in (None, entry.layer):
                return f"{result.name}: {result.error}"
    return None


def observer_order(analysis: Analysis) -> list[str]:
    """Registry order first (so colours match everywhere), then any other observer of the run."""
    registry = list(ob.available())
    return registry + [n for n in analysis.config.observer_names if n not in registry]


def uncalibrated(analysis: Analysis) -> list[TensorAnalysis]:
    """Activation entries that saw no calibration tokens (e.g. MoE experts the router never
    picked): any qparams for them would be made up, which is how NaN or garbage scales reach
    checkpoints."""
    return [e for e in analysis.entries if e.tensor != TensorKind.WEIGHT and e.num_tokens == 0]


def token_warnings(analysis: Analysis, few: int = FEW_TOKENS) -> list[str]:
    """Messages for activation tensors that saw no or very few tokens (e.g. MoE experts the router
    never chose): their ranges say nothing about real inputs."""
    notes = []
    for e in analysis.entries:
        if e.tensor == TensorKind.WEIGHT:
            continue
        tokens = e.num_tokens
        if tokens == 0:
            notes.append(f"{e.layer} · {e.tensor}: no tokens observed (an expert the router never chose?)")
        elif tokens < few:
            notes.append(f"{e.layer} · {e.tensor}: only {tokens} tokens observed; its ranges are unreliable")
    return notes


def metric_options(analysis: Analysis | None) -> list[str]:
    """The metrics a choice, the overview and the bars can go by: the local ones (as served), each
    layer's own (``per-layer:<metric>``) when a server shares some scales of the run, and the GPTQ
    figures (``gptq:<figure>``) when the run put its weights through GPTQ."""
    has_gptq = analysis is not None and any(e.gptq for e in analysis.entries)
    fused = analysis is not None and any(e.served is not None for e in analysis.entries)
    options = list(ob.METRIC_KEYS) + ([PER_LAYER_PREFIX + m for m in ob.METRIC_KEYS] if fused else [])
    return options + ([GPTQ_METRIC_PREFIX + m for m in GPTQ_METRICS] if has_gptq else [])


def error_table(analysis: Analysis) -> pd.DataFrame:
    """Layer × observer rows with every metric as served, time and observed tokens (errors kept as
    text); beside them, for tensors a server runs fused with others, each metric with the layer's
    own scales (``per-layer:<metric>`` columns), the fused unit and the member whose range sets the
    shared scale (``scale set by``); and a GPTQ run's figures per weight observer (``gptq:<figure>``
    columns, empty for activations)."""
    frame = analysis.frame()
    gptq = [GPTQ_METRIC_PREFIX + m for m in GPTQ_METRICS]
    rows = [
        {"layer": e.layer, "tensor": e.tensor, "observer": row.observer}
        | {GPTQ_METRIC_PREFIX + m: getattr(row, m) for m in GPTQ_METRICS}
        for e in analysis.entries
        for row in e.gptq
    ]
    if rows and not frame.empty:
        frame = frame.merge(pd.DataFrame(rows), on=["layer", "tensor", "observer"], how="left")
    fused = fused_rows(analysis)
    if fused and not frame.empty:
        frame = frame.merge(pd.DataFrame(fused), on=["layer", "tensor", "observer"], how="left")
    own = [PER_LAYER_PREFIX + m for m in ob.METRIC_KEYS]
    wanted = ["layer", "tensor", "observer", *ob.METRIC_KEYS, *own, "fused as", "scale set by", *gptq]
    wanted += ["seconds", "num_observed_tokens", "error"]
    return frame[[c for c in wanted if c in frame.columns]]


def best_mask(frame: pd.DataFrame, metric: str) -> pd.Series:
    """True on the row(s) holding the best ``metric`` within each (layer, tensor) of a frame
    such as ``error_table``'s (ties are all marked)."""
    sign = 1.0 if higher_is_better(metric) else -1.0
    score = sign * pd.to_numeric(frame[metric], errors="coerce")
    best = score.groupby([frame["layer"], frame["tensor"]]).transform("max")
    return (score == best) & score.notna()


def _metric_of(entry: TensorAnalysis, observer: str | None, metric: str) -> float | None:
    if observer is None:
        return None
    return metric_value(entry, observer, metric)


def choices_frame(analysis: Analysis, choices: Mapping[tuple[str, str], str], metric: str) -> pd.DataFrame:
    """One row per tensor: the chosen observer, the best one by ``metric``, and both metric values.
    The chosen one's local metric is the one it is served with under the whole choice (a fused
    group whose members chose differently shares the scale of the one reaching farthest,
    ``lab.analyse.served.as_chosen``); for a tensor a server fuses, ``served as`` names the fused
    unit and the member setting its shared scale, and ``per layer`` gives the metric with the
    layer's own scales."""
    best = choose(analysis, metric)
    chosen_all = {key: choices.get(key, best.get(key)) for key in analysis.keys()}
    served = as_chosen(analysis, {key: name for key, name in chosen_all.items() if name is not None})
    local = metric.removeprefix(PER_LAYER_PREFIX)
    rows = []
    for e in analysis.entries:
        key = (e.layer, e.tensor)
        chosen, found = chosen_all[key], served.get(key)
        value = _metric_of(e, chosen, metric)
        if found is not None and metric in ob.HIGHER_IS_BETTER:
            value = found.result.metrics.get(metric)
        row = {"layer": e.layer, "tensor": e.tensor, "observer": chosen, metric: value}
        row |= {"best": best.get(key), f"best {metric}": _metric_of(e, best.get(key), metric)}
        if e.served is not None:
            setter = (found.set_by or "").rpartition(".")[2] if found is not None else ""
            row["served as"] = f"{e.served.unit}, one {e.served.collapse} set by {setter or 'none'}"
            if found is not None and local in ob.HIGHER_IS_BETTER:
                row[f"per layer {local}"] = found.own.metrics.get(local)
        rows.append(row)
    return pd.DataFrame(rows)


def valid_choices(analysis: Analysis, choices: Mapping[tuple[str, str], str]) -> tuple[Choices, list[str]]:
    """The choices that name an analysed tensor and an observer that produced qparams on it,
    and one note per choice that does not (so a stale or failed choice never reaches an export)."""
    usable = {(e.layer, e.tensor): set(usable_observers(e)) for e in analysis.entries}
    kept: Choices = {}
    notes = []
    for key, observer in choices.items():
        if key not in usable:
            notes.append(f"{key[0]} · {key[1]}: not analysed in this run")
        elif observer not in usable[key]:
            notes.append(f"{key[0]} · {key[1]}: {observer} gave no qparams here")
        else:
            kept[key] = observer
    return kept, notes


def layer_output_rows(model, analysis: Analysis, observers: Sequence[str]) -> pd.DataFrame:
    """Layer-output error on the captured inputs per layer and observer: weight-only,
    activation-only and both quantized (``sample_models.layer_output_error``)."""
    from sample_models import layer_output_error

    rows = []
    for layer in dict.fromkeys(e.layer for e in analysis.entries):
        try:
            weight, inputs = analysis.entry(layer, "weight"), analysis.entry(layer, "input")
        except ValueError:
            continue
        if inputs.data.shape[0] == 0:
            continue
        on_both = set(usable_observers(weight)) & set(usable_observers(inputs))
        for name in (name for name in observers if name in on_both):
            w_res, x_res = weight.result(name), inputs.result(name)
            w_hat = ob.fake_quantize(weight.data, w_res.qparams, weight.spec)
            x_hat = ob.fake_quantize(inputs.data, x_res.qparams, inputs.spec)
            for mode, (qw, qx) in {
                "weight only": (w_hat, None),
                "activation only": (weight.data, x_hat),
                "both": (w_hat, x_hat),
            }.items():
                metrics = layer_output_error(model, layer, inputs.data, qw, qx, weight=weight.data)
                rows.append({"layer": layer, "observer": name, "quantized": mode, **metrics})
    return pd.DataFrame(rows)


def spec_text(spec: ob.QuantSpec) -> str:
    """A spec in a few words, as the CLI's ``list`` and the report print it:
    ``int4 sym group 128``, ``int8 sym block 128x128 dynamic``."""
    text = f"{spec.dtype} {'sym' if spec.symmetric else 'asym'} {spec.strategy}"
    if spec.strategy == "group":
        text += f" {spec.group_size}"
    if spec.strategy == "block":
        text += f" {spec.block_size[0]}x{spec.block_size[1]}"
    return text + (" dynamic" if spec.dynamic else "")


def export_selection(
    analysis: Analysis, choices: Mapping[tuple[str, str], str], allow_uncalibrated: bool = False
) -> tuple[list[tuple[TensorAnalysis, ServedChoice]], list[TensorAnalysis]]:
    """What an export writes: each chosen entry of ``choices`` in analysis order with its choice as a
    server runs the whole choice (``lab.analyse.served.as_chosen``: a fused group shares its scales),
    and the activation entries that saw no calibration tokens (recorded as uncalibrated).

    Raises one ``ValueError`` listing every problem: uncalibrated tensors unless
    ``allow_uncalibrated`` (any qparams for them would be made up), choices naming a tensor that
    was not analysed or an observer that was not run or failed, or nothing chosen at all.
    Uncalibrated tensors are never exported with qparams, whatever their choice.
    """
    missing = uncalibrated(analysis)
    if missing and not allow_uncalibrated:
        listed = "\n  - ".join(f"{e.layer} {e.tensor}" for e in missing)
        raise ValueError(
            "refusing to export activation qparams: these tensors saw no calibration tokens:\n  - "
            f"{listed}\nCalibrate with more or other text, or pass allow_uncalibrated=True "
            "(CLI: --allow-uncalibrated) to record them as uncalibrated with no qparams."
        )
    skipped = {(e.layer, e.tensor) for e in missing}
    problems = []
    known = {(e.layer, e.tensor): e for e in analysis.entries}
    for key, observer in choices.items():
        entry = known.get(tuple(key))
        if entry is None:
            problems.append(f"{key[0]} {key[1]}: not in the analysis")
            continue
        if tuple(key) in skipped:
            continue
        result = next((r for r in entry.results if r.name == observer), None)
        if result is None:
            problems.append(f"{key[0]} {key[1]}: observer {observer!r} was not run")
        elif result.qparams is None:
            problems.append(f"{key[0]} {key[1]}: observer {observer!r} failed: {result.error}")
        else:
            problems += [f"{key[0]} {key[1]}: observer {observer!r} {bad}" for bad in unusable_scales(result.qparams)]
    if problems:
        raise ValueError("cannot export these choices:\n  - " + "\n  - ".join(problems))
    kept = {key: observer for key, observer in choices.items() if tuple(key) not in skipped}
    served = as_chosen(analysis, kept)
    problems = [
        f"{e.layer} {e.tensor}: observer {kept[key]!r} as served {bad}"
        for e in analysis.entries
        if (key := (e.layer, e.tensor)) in served
        for bad in (
            [served[key].result.error]
            if served[key].result.qparams is None
            else unusable_scales(served[key].result.qparams)
        )
    ]
    if problems:
        raise ValueError("cannot export these choices:\n  - " + "\n  - ".join(problems))
    selected = [(e, served[(e.layer, e.tensor)]) for e in analysis.entries if (e.layer, e.tensor) in served]
    if not selected:
        raise ValueError("nothing to export: no (layer, tensor) has a chosen observer")
    return selected, missing


def unusable_scales(qp: ob.QParams) -> list[str]:
    """What no export may write: a scale or global scale that is NaN, infinite, zero or negative
    (a runtime would divide by it, or silently zero the tensor)."""
    found = []
    for name, tensor in (("scale", qp.scale), ("global_scale", qp.global_scale)):
        if tensor is None or not tensor.is_floating_point():
            continue
        bad = int((~torch.isfinite(tensor) | (tensor <= 0)).sum())
        if bad:
            found.append(f"gave {bad} non-finite or non-positive {name} value(s) of {tensor.numel()}")
    return found
