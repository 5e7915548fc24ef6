"""The app's AWQ state and steps, without streamlit (issue 41): what the Run page's switch asks (on
or off, and AWQ's knobs, declared once in ``observers.AWQ_KNOBS``), why it cannot run beside the
page's settings (one line, before anything runs), the AWQ walk the Run button hands the analysis's
calibration pass to ride (its model, layers, weight spec, weight observers with their knobs and the
Model page's calibration set, taken from its ``RunConfig`` as ``run --awq`` takes them), and what the
Error and Ranges pages read of the run: a layer's mapping, its rows of ``awq_frame``, where the
ranking turns over between variants, a balance layer's smoothed weight with an observer's range,
and the model-level effect, measured once when asked."""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

import observers as ob
from lab.awq import candidates
from lab.awq.mappings import NOT_A_DECODER
from lab.awq.options import conflict
from lab.awq.run import AWQRun, AWQWalk, Progress, walk_of_config
from lab.awq.search import MappingResult, Variant
from lab.awq.table import awq_frame, best_model_level, best_observers
from lab.settings import RunSettings
from observers.suite import SuiteResult

CLI_ADVICE = NOT_A_DECODER.rsplit(":", 1)[-1]
"""What the stage's encoder line tells a command-line user, which the app says in its own words."""


def app_words(text: str) -> str:
    """A refusal of ``lab.awq`` with the command line's advice said as the Run page says it."""
    return text.replace(CLI_ADVICE, " switch AWQ off on the Run page")


def default_knobs() -> dict[str, Any]:
    """Each AWQ knob's declared default (``observers.AWQ_KNOBS``)."""
    return {name: knob.default for name, knob in ob.AWQ_KNOBS.items()}


@dataclass
class AWQResult:
    """One AWQ run beside one analysis: the ``AWQRun``, its ``awq_frame``, the model it ran on
    (``request``), how long it took, and the model-level effect once measured. ``beside`` is a weak
    reference to the analysis: a later one (another Run, the demo, a kept run) replaces what the run
    is compared with, and the old analysis is not kept alive for it. ``modules``: a balance layer's
    module name by the name the analysis lists it under, where the two differ (a hub Mixtral's
    experts, listed where they are stored: the walk's ``listed``)."""

    run: AWQRun
    frame: pd.DataFrame
    request: Any
    seconds: float
    beside: Callable[[], Any]
    effect: pd.DataFrame | None = None
    effect_metric: str | None = None
    modules: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """The run in one line: mappings, observers, time and tokens."""
        found = self.run
        return (
            f"{len(found.results)} mapping(s) searched for {len(found.observers)} weight observer(s) under "
            f"{len(Variant)} variants in {self.seconds:.1f} s, on {found.tokens} calibration tokens "
            f"({found.held_out_tokens} held-out)"
        )

    def mapping_of(self, layer: str) -> MappingResult | None:
        """The mapping ``layer`` is a balance layer of (None: AWQ did not search one)."""
        module = self.modules.get(layer, layer)
        return next((r for r in self.run.results if module in r.mapping.balance), None)

    def rows(self, mapping: MappingResult) -> pd.DataFrame:
        """The mapping's rows of ``awq_frame``: observer × variant."""
        return self.frame[self.frame["mapping"] == mapping.mapping.name].reset_index(drop=True)

    def turnover(self, mapping: MappingResult) -> str:
        """In words: the best observer by mapping error under each variant (``best_observers``, as
        the command line's ``best`` line), and between which variants the best one changes."""
        picks = best_observers(self.frame).loc[mapping.mapping.name].dropna()
        if picks.empty:
            return "No observer has a mapping error here under any variant."
        named = ", ".join(f"{variant}: {observer}" for variant, observer in picks.items())
        if picks.nunique() == 1:
            return f"Best by mapping error: {picks.iloc[0]} under every variant; the best does not change."
        pairs = itertools.pairwise(picks.items())
        changes = [f"{a} and {b} ({was} → {now})" for (a, was), (b, now) in pairs if was != now]
        return f"Best by mapping error: {named}. The ranking turns over between {'; '.join(changes)}."

    def smoothed(
        self, model: Any, mapping: MappingResult, layer: str, variant: Variant, observer: str
    ) -> tuple[torch.Tensor, SuiteResult]:
        """``layer``'s weight ``W·diag(s)`` as ``variant`` smooths it for ``observer`` (as it is under
        ``rtn``), and the observer's qparams on it as a result the range histogram draws, with the
        row's clipped share; a row without figures gives a result that says why."""
        key, module = (variant, observer), self.modules.get(layer, layer)
        weight = candidates.smoothed(model.weight(layer), mapping.scales.get(key))
        row = mapping.row(variant, observer)
        if row.error is not None:
            return weight, SuiteResult(observer, None, {}, 0.0, error=row.error)
        return weight, SuiteResult(observer, mapping.qparams[key][module], {"clip_ratio": row.clipped[module]}, 0.0)

    def measure_effect(self, model: Any, slot: AbstractContextManager[Any] | None = None) -> pd.DataFrame:
        """The model-level effect (``lab.awq.effect.model_effect``: every balance layer quantized as
        each variant deploys it, on the built-in held-out text), measured once, inside ``slot`` (the
        server's heavy-run slot)."""
        from lab.awq.effect import model_effect
        from lab.effect.evaluate import Evaluator

        if self.effect is None:
            with slot or nullcontext():
                evaluator = Evaluator(model)
                self.effect = model_effect(model, self.run, evaluator)
            self.effect_metric = evaluator.default_metric
        return self.effect

    def effect_best(self) -> dict[str, str]:
        """Per variant, the observer whose deployed model is nearest the float one by the effect's
        metric (KL for a decoder)."""
        from lab.results import higher_is_better
        from lab.vocab import MODEL_METRIC_PREFIX

        metric = self.effect_metric
        best = best_model_level(self.effect, metric, higher_is_better(f"{MODEL_METRIC_PREFIX}{metric}"))
        return {variant: row["observer"] for variant, row in best.items()}


@dataclass
class AWQState:
    """The AWQ switch and its last run in a session (``Workspace.awq``): ``on``, the knobs' values
    as the widgets hold them (kept while the switch is off) and the last ``AWQResult``."""

    on: bool = False
    knobs: dict[str, Any] = field(default_factory=default_knobs)
    result: AWQResult | None = None

    def asked(self) -> ob.AWQSpec | None:
        """What the switch asks: None when off, else the knobs as an ``AWQSpec``; a knob out of its
        bounds (or a combination ``AWQSpec`` refuses) is one ``ValueError`` line."""
        if not self.on:
            return None
        try:
            return ob.AWQSpec(**self.knobs)
        except ValueError as err:
            raise ValueError(f"AWQ's knobs: {err}") from None

    def refusal(self, settings: RunSettings, kinds: list[str], model: Any) -> str | None:
        """Why AWQ cannot run beside the Run page's settings (None: it can, or it is off), found
        before anything runs: a knob out of its bounds, no weights analysed, a model of weights
        alone, and what ``run --awq`` does not combine it with (GPTQ, a transform, a layer-by-layer
        capture). What needs the model's modules (an encoder, a group size that does not divide a
        balance layer) the run itself refuses, in one line too."""
        try:
            if self.asked() is None:
                return None
        except ValueError as err:
            return f"{err}."
        if "weight" not in kinds:
            return "AWQ smooths weights: tick Weights on the Model page."
        if not model.supports_activations:
            return f"AWQ searches its scales on calibration inputs, and {model.name} holds weights only."
        why = conflict(settings)
        return None if why is None else f"{why}."

    def walk(self, model: Any, layers: list[str], config: Any, progress: Progress | None = None) -> AWQWalk:
        """The walk the Run button hands the analysis's calibration pass (``Workspace.run``'s ``tap``):
        ``layers`` and the weight spec, weight observers (with their knobs), calibration windows and
        memory budget of the run's ``RunConfig``, as ``run --awq`` rides its analysis. What AWQ
        refuses (switched off, no weights, an encoder, a group size that does not divide) is one
        ``ValueError`` line, before anything runs; the last result is dropped."""
        self.result = None
        awq = self.asked()
        if awq is None:
            raise ValueError("AWQ is switched off: switch it on on the Run page")
        if "weight" not in config.specs:
            raise ValueError("AWQ smooths weights: tick Weights on the Model page")
        try:
            return walk_of_config(model, layers, config, awq, progress)
        except ValueError as err:
            raise ValueError(app_words(str(err))) from None

    def finish(self, model: Any, request: Any, analysis: Any, walk: AWQWalk) -> AWQResult:
        """The walk's result beside ``analysis``. When no pass of this session carried it (the
        analysis was read from another session's run or the server's recent results) it walks a
        pass of its own over the run's calibration set."""
        seconds = walk.seconds
        if not walk.passed:
            start = time.perf_counter()
            model.capture([], tap=walk, **analysis.config.capture_options())
            seconds += time.perf_counter() - start
        found = walk.result()
        modules = {listed: module for module, listed in walk.listed.items() if listed != module}
        self.result = AWQResult(found, awq_frame(found), request, seconds, weakref.ref(analysis), modules=modules)
        return self.result

    def run(self, model: Any, request: Any, analysis: Any, progress: Progress | None = None) -> AWQResult:
        """``finish`` of a walk on a pass of its own, beside an ``analysis`` already made (its weight
        layers and ``RunConfig``)."""
        layers = [e.layer for e in analysis.entries if e.tensor == "weight"]
        return self.finish(model, request, analysis, self.walk(model, layers, analysis.config, progress))

    def shown_with(self, analysis: Any) -> AWQResult | None:
        """The last run when it ran beside ``analysis`` (the session's results), else None."""
        if self.result is None or self.result.beside() is not analysis:
            return None
        return self.result


def state_of(workspace: Any) -> AWQState:
    """The session's ``AWQState`` (``Workspace.awq``), made on the first page that asks."""
    if workspace.awq is None:
        workspace.awq = AWQState()
    return workspace.awq
