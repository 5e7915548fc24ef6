"""What a set of choices does to the model: end-to-end evaluation on held-out text.

A ``ChoiceSet`` says how each chosen tensor is quantized (spec plus static qparams, or run-time
qparams for a dynamic spec). It comes from an analysis and its choices (a run's best observers, a
person's overrides, "all min-max"), or from an imported Observer Lab JSON, which is first checked
against the model (same weights by fingerprint, every layer present, every spec and qparam shape
fitting its tensor). An ``Evaluator`` wraps ``sample_models.effect.EffectRunner`` (the float run
cached at every block boundary) and turns its outputs into the model-level metrics of
``lab.vocab.MODEL_METRICS``: a decoder LM's mean KL(float || quantized) of next-token
distributions, top-1 agreement and perplexity (float and quantized), an encoder's mean cosine of
sentence embeddings and the Spearman correlation of the pairwise similarities of the held-out
sentences; always the SQNR of the hidden states after each block, to show where error enters.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import observers as ob
from lab.analyse.analysis import Analysis
from lab.analyse.model_facts import ModelFacts, describe_source, same_weights
from lab.analyse.served import as_chosen
from lab.effect.metrics import FloatSides, decoder_metrics_of, encoder_metrics
from lab.export.json_values import json_safe
from lab.gptq.deploy import GPTQDeploy
from lab.gptq.hessians import HessianOf
from lab.gptq.layer import weight_quant
from lab.results import Choices, choose, usable_observers, valid_choices
from lab.vocab import DECODER_METRICS, ENCODER_METRICS, KV_TENSORS, observer_kind
from sample_models.effect import (
    HELD_OUT_SAMPLES,
    HELD_OUT_SEQ_LEN,
    EffectRunner,
    Quantization,
    RunResult,
    TensorQuant,
)

Key = tuple[str, str]
FLOAT = "float"
ALL_MINMAX = "all min-max"
BEST_LOCAL = "all best-local"
EFFECT_FORMAT = "observer-lab-effect"


@dataclass(frozen=True)
class ChoiceSet:
    """A named set of quantized tensors: ``{(layer, tensor): TensorQuant}`` and the observer that
    made each (``"run time"`` for a dynamic spec)."""

    name: str
    tensors: dict[Key, TensorQuant] = field(default_factory=dict)
    observers: dict[Key, str] = field(default_factory=dict)


def float_set() -> ChoiceSet:
    """Nothing quantized: the evaluation every other one is measured against (KL 0, cosine 1)."""
    return ChoiceSet(FLOAT)


def _is_dynamic(spec: ob.QuantSpec, tensor: str) -> bool:
    return spec.dynamic and tensor != "weight"


def from_analysis(analysis: Analysis, choices: Mapping[Key, str], name: str) -> ChoiceSet:
    """The choices (``{(layer, tensor): observer}``) over an analysis, with that observer's qparams
    (run-time ones for dynamic activation specs). Choices naming a tensor not analysed or an
    observer that gave no qparams there are refused, all named in one ``ValueError``. In a run made
    with GPTQ (``RunConfig.gptq``) a weight runs as its GPTQ weight, as the checkpoint deploys it."""
    transform = getattr(analysis.config, "transform", None)
    if transform:
        kind = getattr(transform, "kind", transform)
        raise ValueError(
            f"this analysis observed transformed tensors ({kind}): their qparams belong to the transformed model, "
            "not to the model as it is, so its choices cannot be evaluated on it; run without the transform"
        )
    kept, notes = valid_choices(analysis, choices)
    if notes:
        raise ValueError(f"choice set {name!r} cannot be evaluated:\n  - " + "\n  - ".join(notes))
    tensors, observers = {}, {}
    served = as_chosen(analysis, kept)
    for key, observer in kept.items():
        entry = analysis.entry(*key)
        dynamic = _is_dynamic(entry.spec, entry.tensor)
        if entry.tensor == "weight":
            tensors[key] = weight_quant(entry, served[key].result, analysis.config.gptq)
        else:
            tensors[key] = TensorQuant(entry.spec, None if dynamic else served[key].result.qparams)
        observers[key] = "run time" if dynamic else observer
    return ChoiceSet(name, tensors, observers)


def all_observer(analysis: Analysis, observer: str, name: str, keys: Sequence[Key] | None = None) -> ChoiceSet:
    """``observer`` on every tensor of ``keys`` (default: all analysed) where it gave qparams."""
    keys = analysis.keys() if keys is None else keys
    usable = {k: observer for k in keys if observer in usable_observers(analysis.entry(*k))}
    if not usable:
        raise ValueError(f"{observer} gave no qparams on any chosen tensor, so {name!r} cannot be evaluated")
    return from_analysis(analysis, usable, name)


def best_local(analysis: Analysis, metric: str, keys: Sequence[Key] | None = None) -> ChoiceSet:
    """The best observer per tensor by a local metric (``lab.results.choose``)."""
    chosen = choose(analysis, metric)
    wanted = set(analysis.keys() if keys is None else keys)
    return from_analysis(analysis, {k: v for k, v in chosen.items() if k in wanted}, f"{BEST_LOCAL} ({metric})")


def from_lab_file(lab_file: Any, model: Any, name: str = "file", hessians: HessianOf | None = None) -> ChoiceSet:
    """A loaded Observer Lab file (``lab.export.lab_json.load_file``) as a choice set for ``model``. A file
    made on other weights (its fingerprint differs), layers the model lacks or qparams that do not
    fit: one ``ValueError`` naming the problem. A file of a GPTQ run runs its weights as GPTQ weights,
    made again from ``hessians`` (``lab.gptq.hessians``), as the checkpoint does."""
    from lab.export.chosen import of_lab_file
    from lab.export.lab_apply import apply_choices

    here = describe_source(model)
    if not same_weights(lab_file.source, here):
        raise ValueError(
            f"{name} was made for the model {lab_file.source.get('name')!r} (other weights by fingerprint), "
            f"not for {here.get('name')!r}: its qparams do not apply"
        )
    with_kv = any(e.tensor in KV_TENSORS for e in lab_file.entries)
    applied = apply_choices(lab_file, ModelFacts.of(model, with_kv=with_kv))
    gptq = GPTQDeploy.of_config(lab_file.config, hessians)
    chosen = {(c.layer, c.tensor): c for c in of_lab_file(lab_file.entries)}
    tensors, observers = {}, {}
    for key, spec in applied["specs"].items():
        dynamic = _is_dynamic(spec, key[1])
        if gptq is not None and key[1] == "weight":
            weight, qparams = gptq.apply(chosen[key], model.weight(key[0]))
            tensors[key] = TensorQuant(spec, qparams, weight)
        else:
            tensors[key] = TensorQuant(spec, None if dynamic else applied["qparams"][key])
        observers[key] = "run time" if dynamic else applied["choices"][key]
    return ChoiceSet(name, tensors, observers)


def check_applies(choice_set: ChoiceSet, model: Any) -> None:
    """Every tensor of the set must exist in ``model`` and its spec and qparams must apply to it on
    held-out text: one ``ValueError`` listing each problem (a missing layer, a spec for another
    kind of tensor, static per-token qparams, which belong to the calibration tokens, a dynamic
    spec with no run-time form, qparams of another shape)."""
    from lab.scheme.stored import expected_qparam_shape

    problems = []
    blocks = None
    for (layer, tensor), quant in choice_set.tensors.items():
        where = f"{layer} {tensor}"
        try:
            if tensor in KV_TENSORS:
                blocks = model.attention_blocks() if blocks is None else blocks
                if layer not in blocks:
                    problems.append(f"{where}: the model has no attention block {layer!r}")
                    continue
                shape = tuple(model.kv_shape(layer))
            else:
                shape = tuple(model.layer(layer).shape)
            quant.spec.check_kind(observer_kind(tensor))
            if quant.qparams is None:
                ob.dynamic_view_spec(quant.spec)
            elif quant.spec.strategy == "token":
                problems.append(
                    f"{where}: static per-token qparams describe the calibration tokens and cannot apply to other "
                    "text; use a dynamic spec"
                )
            else:
                expected = expected_qparam_shape(quant.spec, tensor, shape, quant.qparams.extras.get("g_idx"))
                got = tuple(quant.qparams.scale.shape)
                if expected is not None and got != expected:
                    problems.append(f"{where}: the spec does not apply: scale of shape {list(got)}, needs {expected}")
        except ValueError as err:
            problems.append(f"{where}: {err}")
    if problems:
        raise ValueError(
            f"choice set {choice_set.name!r} does not apply to {model.name}:\n  - " + "\n  - ".join(problems)
        )


@dataclass
class Evaluation:
    """One choice set's model-level metrics, the float model's perplexity (decoders), the SQNR of
    the hidden states after each block, and how many tensors were quantized."""

    name: str
    metrics: dict[str, float]
    block_sqnr_db: list[float]
    tensors: int
    start: int

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "name": self.name,
                "tensors": self.tensors,
                "metrics": self.metrics,
                "block_sqnr_db": self.block_sqnr_db,
                "first_block": self.start,
            }
        )


class Evaluator:
    """A model's float run on held-out text (``EffectRunner``) and the metrics of its kind."""

    def __init__(
        self,
        model: Any,
        texts: Sequence[str] | None = None,
        *,
        samples: int = HELD_OUT_SAMPLES,
        seq_len: int = HELD_OUT_SEQ_LEN,
        sequential: bool | None = None,
        max_memory: int | None = None,
    ) -> None:
        self.model = model
        self.runner = EffectRunner(
            model, texts, samples=samples, seq_len=seq_len, sequential=sequential, max_memory=max_memory
        )
        self.held_out = {
            "texts": "built-in held-out paragraphs" if texts is None else f"{len(texts)} given text(s)",
            "samples": samples,
            "seq_len": seq_len,
            "batches": len(self.runner.batches),
            "tokens": self.runner.tokens,
            "digest": hashlib.sha256(repr(texts).encode()).hexdigest()[:16],
        }

    @property
    def kind(self) -> str:
        return self.runner.kind

    @property
    def metric_names(self) -> tuple[str, ...]:
        return DECODER_METRICS if self.kind == "decoder" else ENCODER_METRICS

    @property
    def default_metric(self) -> str:
        return self.metric_names[0]

    def metrics(self, run: RunResult) -> dict[str, float]:
        return self.metrics_of([run])[0]

    def metrics_of(self, runs: Sequence[RunResult]) -> list[dict[str, float]]:
        """``metrics`` of each of ``runs`` (a stacked run's variants), a decoder's float side of each
        held-out batch computed once for all of them."""
        if self.kind == "decoder":
            return decoder_metrics_of(self.runner.float_outputs, [run.outputs for run in runs], self.runner.batches)
        return [encoder_metrics(self.runner.float_outputs, run.outputs) for run in runs]

    def stacked_metrics(self, variants: Sequence[Quantization]) -> tuple[list[dict[str, float]], int]:
        """``metrics_of`` the stacked run of ``variants`` (``EffectRunner.run_stacked``) and the block
        it started at, a decoder's logits (and the float model's) made a few windows and a variant
        at a time and reduced to their sums as they come (each variant's own figures, up to the last
        bits of its head's product): no logits over the vocabulary are held for a whole batch."""
        if self.kind != "decoder":
            runs = self.runner.run_stacked(variants)
            return self.metrics_of(runs), runs[0].start
        sides = FloatSides(self.runner.batches)
        runs = self.runner.run_stacked(variants, reduce=sides.against)
        return [sides.metrics(run.outputs) for run in runs], runs[0].start

    def float_metrics(self) -> dict[str, float]:
        """The metrics of the float model against itself (KL 0, cosine 1; the float perplexity)."""
        run = RunResult(self.runner.float_outputs, [math.inf] * self.runner.num_blocks, self.runner.num_blocks)
        return self.metrics(run)

    def evaluate(self, choice_set: ChoiceSet, start: int | None = None) -> Evaluation:
        """The set's model-level metrics, running from its first quantized block (or ``start``)."""
        check_applies(choice_set, self.model)
        run = self.runner.run(choice_set.tensors, start)
        return Evaluation(choice_set.name, self.metrics(run), run.block_sqnr_db, len(choice_set.tensors), run.start)


def document(evaluator: Evaluator, evaluations: Sequence[Evaluation], **extra: Any) -> dict[str, Any]:
    """The JSON document of ``python -m observers evaluate`` (metric names as keys: ``kl``,
    ``top1_agreement``, ``perplexity``, ``cosine``, ``spearman``)."""
    return json_safe(
        {
            "format": EFFECT_FORMAT,
            "version": 1,
            "source": describe_source(evaluator.model),
            "model_kind": evaluator.kind,
            "metrics": list(evaluator.metric_names),
            "held_out": evaluator.held_out,
            "blocks": evaluator.runner.num_blocks,
            "evaluations": [e.to_dict() for e in evaluations],
            **extra,
        }
    )


def summary_rows(evaluations: Sequence[Evaluation]) -> list[dict[str, Any]]:
    """One row per evaluation: its name, metrics, the lowest block SQNR and the block where it is."""
    rows = []
    for e in evaluations:
        finite = [(v, i) for i, v in enumerate(e.block_sqnr_db) if math.isfinite(v)]
        worst = min(finite) if finite else (math.inf, None)
        rows.append(
            {
                "choice set": e.name,
                "tensors": e.tensors,
                **e.metrics,
                "final block SQNR dB": e.block_sqnr_db[-1],
                "lowest block SQNR dB": worst[0],
            }
        )
    return rows


def choices_of(choice_set: ChoiceSet) -> Choices:
    """The set's ``{(layer, tensor): observer}``."""
    return dict(choice_set.observers)
