"""The Allocate page's state and steps, without streamlit: what a person asks (``AllocateForm``),
checked as ``allocate``'s flags are (one line for the first problem, in the page's words); the
flow of ``lab.allocate.command.run`` (score on the held-out text's scoring part, solve, measure
the frontier on its measuring part and in sample) with the app's analyses
(the session's result cache and capture memo, the Model page's calibration settings) and one
progress fraction over its three stages; and a chosen allocation's exports (Observer Lab JSON,
recipe, the lab file a checkpoint is written from), made once per allocation viewed."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

import observers as ob
from lab.allocate.frontier import Frontier, Options, Point, score_name
from lab.allocate.held_out import HeldOut
from lab.allocate.schemes import NONE, Budget, Scheme, parse_budgets, parse_schemes
from lab.allocate.score import Scores
from lab.analyse.run_config import RunConfig
from lab.scheme.cost import LayerSizes
from lab.settings import RunSettings, knob_overrides
from sample_models.effect import HELD_OUT_SAMPLES, HELD_OUT_SEQ_LEN

SCHEME_OPTIONS = (*ob.PRESET_NAMES, NONE)
DEFAULT_SCHEMES = ("W4A16", "FP8", NONE)
STAGES = {"calibrate": (0.0, 0.3), "score": (0.3, 0.9), "measure": (0.9, 1.0)}
"""Each stage's share of the one progress bar: the calibration runs, the one-layer runs, the allocations measured."""
_APP_WORDS = (
    ("--schemes names", "the schemes name"),
    ("--schemes has", "the schemes have"),
    ("--schemes", "the schemes"),
    ("--budgets", "the frontier budgets"),
    ("--budget", "the budget"),
)
Progress = Callable[[float, str], None]
"""Told the fraction of the whole allocation done and what runs now."""


def app_words(text: str) -> str:
    """A message of ``lab.allocate`` with the CLI's flags named as the page names its fields."""
    for flag, words in _APP_WORDS:
        text = text.replace(flag, words)
    return text


@dataclass(frozen=True)
class Asked:
    """What ``Score and allocate`` runs: the layers, schemes, budgets (``budget``: the one the
    exports take first), the scoring observers (None: every one that applies) and metric."""

    layers: tuple[str, ...]
    schemes: tuple[Scheme, ...]
    budget: Budget
    budgets: tuple[Budget, ...]
    observers: tuple[str, ...] | None
    metric: str | None


@dataclass
class AllocateForm:
    """The page's fields: ``layers`` (None: the Model page's selection), the preset schemes ticked
    and ``specs`` (more schemes as text), ``weights_only``, the budget and the frontier's budgets
    as typed, the observers to score (empty: every one that applies), the held-out settings and
    the metric (None: the model's default)."""

    layers: list[str] | None = None
    schemes: list[str] = field(default_factory=lambda: list(DEFAULT_SCHEMES))
    specs: str = ""
    weights_only: bool = False
    budget: str = "6"
    budgets: str = "4.5, 8, 12"
    observers: list[str] = field(default_factory=list)
    samples: int = HELD_OUT_SAMPLES
    seq_len: int = HELD_OUT_SEQ_LEN
    metric: str | None = None

    def layers_among(self, names: Sequence[str], model_page: Sequence[str]) -> list[str]:
        """The chosen layers that ``names`` (the model's) has; the Model page's until a person chooses."""
        chosen = [n for n in (self.layers if self.layers is not None else model_page) if n in set(names)]
        return chosen or [n for n in model_page if n in set(names)]

    def scheme_text(self) -> str:
        """The schemes as ``allocate --schemes`` takes them: the ticked presets, then the typed specs."""
        return ",".join([*self.schemes, *(part.strip() for part in self.specs.split(",") if part.strip())])


@dataclass(frozen=True)
class Exports:
    """One allocation's files: the Observer Lab JSON (``json``), parsed again as the checkpoint
    writer takes it (``lab_file``), the model facts it was checked against, the recipe, and why
    there is no recipe or checkpoint (``refused``, ``recipe_problem``)."""

    json: bytes
    lab_file: Any
    facts: Any = None
    recipe: Any = None
    refused: str | None = None
    recipe_problem: str | None = None


@dataclass
class Allocation:
    """One press of Score and allocate: the model it ran on (``request``), what was asked, the
    layers' sizes and fused groups, the scores, each layer's options, the measured frontier, the
    settings the JSON records, the calibration runs' notes and the exports made so far."""

    request: Any
    model_name: str
    asked: Asked
    sizes: LayerSizes
    groups: list[tuple[str, list[str]]]
    scores: Scores
    options: Options
    frontier: Frontier
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    exports: dict[str, Exports] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The budgets' allocations by name (``budget 5``), in increasing budget."""
        return [p.name for p in self.frontier.allocations]

    @property
    def chosen_name(self) -> str:
        """The allocation of the budget the exports take."""
        return next(p.name for p in self.frontier.allocations if p.budget == self.asked.budget.text)

    def point(self, name: str) -> Point:
        return next(p for p in self.frontier.allocations if p.name == name)

    def fused(self) -> list[tuple[str, list[str]]]:
        """The groups of more than one layer, which were given one scheme."""
        return [(name, members) for name, members in self.groups if len(members) > 1]

    def choices_frame(self, point: Point) -> pd.DataFrame:
        """One row per layer of ``point``: its scheme, observers, what it stores and its score."""
        name = score_name(self.frontier.metric)
        rows = []
        for c in point.choices:
            height, width = self.sizes.shapes[c.layer]
            rows.append(
                {
                    "layer": c.layer,
                    "scheme": c.scheme,
                    "observer": c.observer or "– (dense)",
                    "input observer": c.input_observer or "–",
                    "bits per weight": 8 * c.bytes / (height * width),
                    "bytes": c.bytes,
                    f"score ({name})": c.score,
                }
            )
        return pd.DataFrame(rows)

    def exports_of(self, point: Point, model: Any, provenance: dict[str, Any] | None = None) -> Exports:
        """``point``'s files, made once (checking them against the model hashes its weight files),
        said to be asked for as ``provenance`` says (``lab.provenance``) the first time."""
        if point.name not in self.exports:
            self.exports[point.name] = _exports(self, point, model, provenance)
        return self.exports[point.name]


def _exports(allocation: Allocation, point: Point, model: Any, provenance: dict[str, Any] | None) -> Exports:
    from lab.allocate import export
    from lab.export import checkpoint, lab_json, recipe
    from lab.export.chosen import of_lab_file
    from lab.provenance import provenance_lines

    schemes = list(allocation.asked.schemes)
    document = export.document(point, allocation.scores, schemes, allocation.frontier, allocation.settings)
    document |= {} if provenance is None else {"provenance": provenance}
    text = lab_json.dumps(document)
    lab_file = lab_json.parse_document(json.loads(text))
    if not export.quantized_layers(point):
        refused = f"{point.name} keeps every layer dense: there is no checkpoint or recipe to write"
        return Exports(text.encode("utf-8"), lab_file, refused=refused)
    facts = checkpoint.check_fits(lab_file, model)
    try:
        built = recipe.of_chosen(of_lab_file(lab_file.entries), facts, provenance_lines(lab_file.provenance))
    except ValueError as err:
        return Exports(text.encode("utf-8"), lab_file, facts, recipe_problem=str(err))
    return Exports(text.encode("utf-8"), lab_file, facts, built)


def base_config(settings: RunSettings, schemes: Sequence[Scheme], observers: tuple[str, ...] | None) -> RunConfig:
    """The calibration settings every scheme's analyses share, from the Model page (samples,
    sequence length, batch size, the calibration set, the capture) and the Run page's knobs;
    ``score`` puts each scheme's specs in."""
    if settings.texts is not None and not any(text.strip() for text in settings.texts):
        raise ValueError(
            "the pasted calibration text is empty: paste some text on the Model page or use the built-in set"
        )
    first = next(s for s in schemes if not s.dense)
    return RunConfig(
        specs={"weight": first.weight},
        observers=observers,
        knobs=knob_overrides(settings.knobs),
        samples=int(settings.samples),
        seq_len=int(settings.seq_len),
        texts=settings.texts,
        batch_size=int(settings.batch_size),
        dataset=settings.dataset,
        sequential=settings.sequential,
        max_memory=settings.max_memory,
    )


def _staged(progress: Progress | None, stage: str) -> Callable[[float, str], None]:
    low, high = STAGES[stage]
    if progress is None:
        return lambda fraction, line: None
    return lambda fraction, line: progress(low + (high - low) * min(max(fraction, 0.0), 1.0), line)


def _fraction(done: int, total: int) -> float:
    return done / total if total else 1.0


@dataclass
class AllocateState:
    """The Allocate page's state in a session (``Workspace.allocation``): the form, the chosen
    layers' sizes (read once per model and layers), the held-out text's two parts (``HeldOut``:
    their float runs, once per model and held-out settings), the last allocation and which of its
    budgets is viewed."""

    form: AllocateForm = field(default_factory=AllocateForm)
    sizes_key: tuple | None = None
    sizes: LayerSizes | None = None
    held_out: HeldOut | None = None
    held_out_key: tuple | None = None
    result: Allocation | None = None
    viewed: str | None = None

    def sizes_of(self, model: Any, request: Any, layers: Sequence[str]) -> LayerSizes:
        key = (request, tuple(layers))
        if self.sizes_key != key:
            self.sizes, self.sizes_key = LayerSizes.of(model, list(layers)), key
        return self.sizes

    def check(self, model: Any, request: Any, layers: Sequence[str], calibration_problem: str | None) -> Asked:
        """The form as ``Asked``, or a ``ValueError`` saying the first problem in one line: no layer,
        no scheme, an unknown scheme, budgets in two units or below the cheapest allocation."""
        from lab.allocate.frontier import check_budgets, scheme_layers

        form = self.form
        if not layers:
            raise ValueError("choose at least one layer")
        if not form.scheme_text():
            raise ValueError("choose at least one candidate scheme")
        if not (form.budget.strip() or form.budgets.strip()):
            raise ValueError("give a budget: bits per weight (4.8) or a size (80MB)")
        if calibration_problem:
            raise ValueError(f"the calibration set on the Model page cannot be used ({calibration_problem})")
        try:
            schemes = parse_schemes(form.scheme_text(), weights_only=form.weights_only)
            budget, budgets = parse_budgets(form.budget.strip() or None, form.budgets)
            sizes = self.sizes_of(model, request, layers)
            scheme_layers(sizes, schemes)
            check_budgets(sizes, schemes, budgets)
        except ValueError as err:
            raise ValueError(app_words(str(err))) from None
        observers = tuple(form.observers) or None
        return Asked(tuple(layers), tuple(schemes), budget, tuple(budgets), observers, form.metric)

    def held_out_for(self, model: Any, request: Any, settings: RunSettings, slot: Any = None) -> HeldOut:
        """The built-in held-out paragraphs split in two (``lab.allocate.held_out.split``) with each
        part's float run of ``model`` on the form's held-out settings (and the Model page's capture),
        built inside ``slot`` (the server's heavy-run slot) when it is not already."""
        from contextlib import nullcontext

        from lab.allocate.held_out import split

        form = self.form
        key = (request, int(form.samples), int(form.seq_len), settings.sequential, settings.max_memory)
        if self.held_out is None or self.held_out_key != key:
            self.held_out, self.held_out_key = None, None
            with slot or nullcontext():
                self.held_out = split(
                    model,
                    samples=int(form.samples),
                    seq_len=int(form.seq_len),
                    sequential=settings.sequential,
                    max_memory=settings.max_memory,
                )
            self.held_out_key = key
        return self.held_out

    def run(
        self,
        model: Any,
        request: Any,
        asked: Asked,
        settings: RunSettings,
        cache: Any,
        memo: dict[str, Any],
        progress: Progress | None = None,
    ) -> Allocation:
        """``allocate``'s flow on ``model``: each quantizing scheme's analyses (the app's analysis
        path, with the session's result ``cache`` and capture ``memo``), every (layer, scheme,
        observer) scored on the held-out text's scoring part, each budget solved and every
        allocation measured end to end on its measuring part (and in sample on the scoring part).
        The result replaces the last one and its budget is viewed."""
        from lab.allocate import frontier
        from lab.allocate.score import part_configs, score
        from lab.runtime.fusion import fused_groups
        from lab.serve.session_runs import SessionRun

        layers, schemes = list(asked.layers), list(asked.schemes)
        sizes = self.sizes_of(model, request, layers)
        groups = fused_groups(layers)
        mine = frontier.scheme_layers(sizes, schemes)
        base = base_config(settings, schemes, asked.observers)
        held_out = self.held_out_for(model, request, settings)
        parts = sum(len(part_configs(base, s)) for s in schemes if not s.dense)
        calls, notes = itertools.count(), []
        calibrating, scoring, measuring = (_staged(progress, stage) for stage in STAGES)

        def analysed(scheme: Scheme, config: RunConfig, chosen: Sequence[str]) -> Any:
            index, what = next(calls), "inputs" if "input" in config.specs else "weights"

            def told(done: int, total: int, line: str) -> None:
                calibrating((index + _fraction(done, total)) / parts, f"calibrating {scheme.name} {what} · {line}")

            computed = SessionRun(model, list(chosen), config, (), cache, memo).compute(told)
            notes.extend(computed.notes)
            return computed.analysis

        def scored(done: int, total: int, line: str) -> None:
            if not line.startswith("analysing "):  # the calibration runs tell their own steps
                scoring(_fraction(done, total), f"scoring {done}/{total} · {line}")

        try:
            scores = score(held_out, mine, schemes, base, analysed, metric=asked.metric, progress=scored)
            options = frontier.layer_options(scores, sizes, schemes)
            measured = frontier.frontier(
                held_out,
                scores,
                options,
                groups,
                sizes,
                list(asked.budgets),
                lambda done, total, line: measuring(_fraction(done, total), f"{done}/{total} · {line}"),
            )
        except ValueError as err:
            raise ValueError(app_words(str(err))) from None
        recorded = {"layers": layers, "budgets": [b.text for b in asked.budgets], "held_out": held_out.describe()}
        name = getattr(model, "name", str(request))
        self.result = Allocation(
            request, name, asked, sizes, groups, scores, options, measured, recorded, list(dict.fromkeys(notes))
        )
        self.viewed = self.result.chosen_name
        return self.result


def state_of(workspace: Any) -> AllocateState:
    """The session's ``AllocateState`` (``Workspace.allocation``), made on the page's first visit."""
    if workspace.allocation is None:
        workspace.allocation = AllocateState()
    return workspace.allocation
