"""The llm-compressor recipe export: the lab's per-layer observer choices as one
``QuantizationModifier`` that llm-compressor's ``oneshot`` runs, so a model can be calibrated by
llm-compressor itself with the observer the lab chose for each layer. A run made with GPTQ
(``RunConfig.gptq``) gets a ``GPTQModifier`` instead, with the same config groups and the run's
block size, dampening and activation order. An AWQ deployment (``lab.awq.deploy``) puts an
``AWQModifier`` first, with the run's knobs and its exact mappings, as llm-compressor runs AWQ
before quantizing.

The compressed-tensors export records one observer per config group (the most common choice) and
carries the lab's qparams beside it. A recipe carries no qparams: llm-compressor computes them again
on its own calibration data, so the observer choice is all there is to keep, and every choice is
kept. Layers share a config group only when their compressed-tensors args, llm-compressor observer
and ``observer_kwargs`` are all the same; a layer whose observer differs gets its own group. Targets
are the exact layer names (compressed-tensors matches a target without ``re:`` by name equality), so
nothing else in the model is matched and ``ignore`` stays empty.

What each tensor may become is decided where the compressed-tensors export decides it (``ct_args``,
``ct_layers``, ``ct_observer``, ``CT_OBSERVER_NAMES``), so both exports leave out and name the same
settings. An observer llm-compressor lacks becomes its nearest one (``NEAREST_LC_OBSERVERS``), with a
YAML comment beside the group and a note. Key/value states become ``kv_cache_scheme``, which
llm-compressor applies to every attention block with one observer: the most common choice.

``build(analysis, choices)`` gives a ``Recipe`` without touching a disk; ``.text`` (or ``.to_bytes()``)
is the in-memory form the app offers, ``.write(path)`` (or ``save_file``) the file form.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import observers as ob
from lab.analyse.analysis import Analysis
from lab.analyse.model_facts import ModelFacts
from lab.export.chosen import Chosen, of_analysis
from lab.export.compressed_tensors import CT_ARG_NAMES, CT_OBSERVER_NAMES, CtLayer, ct_layers, ct_observer
from lab.provenance import provenance_lines
from lab.results import export_selection
from lab.runtime.fusion import Level, fused_groups, linked_by_llm_compressor
from lab.runtime.scales import Collapse, collapse
from lab.scheme.stored import ct_args, ragged_groups
from lab.vocab import KV_TENSORS, LAYER_TENSORS

RECIPE_FILE = "recipe.yaml"
STAGE = "quant_stage"
"""llm-compressor reads a recipe's stages from keys ending in ``_stage`` and the modifier groups
inside them from keys ending in ``_modifiers``."""
MODIFIER_GROUP = "quant_modifiers"
MODIFIER = "QuantizationModifier"
GPTQ_MODIFIER = "GPTQModifier"
AWQ_MODIFIER = "AWQModifier"
LC_ACTORDER = {"none": None, "weight": "static", "group": "group"}
"""The lab's activation orders (``observers.gptq``, aliases resolved) as ``GPTQModifier`` spells them."""

# Lab observers llm-compressor 0.14 has no equivalent of (every other one is in CT_OBSERVER_NAMES):
# lab name -> (llm-compressor observer for weights, for activations and key/value states, why).
# Weights are observed once, so the memoryless observers are llm-compressor's usual ones there;
# activations take the observer that keeps a range over every batch, as the lab's histogram
# observers do. Searches that minimise an error become llm-compressor's MSE grid search; rules that
# clip at a quantile or keep the range become min-max (llm-compressor has no quantile observer).
_MINMAX = ("memoryless_minmax", "static_minmax")
_MSE = ("memoryless_mse", "mse")
NEAREST_LC_OBSERVERS: dict[str, tuple[str, str, str]] = {
    "histogram": (*_MSE, "a least-L2-error range search"),
    "mse": (*_MSE, "a least-squared-error amax sweep"),
    "entropy": (*_MSE, "a least-KL-divergence clipping search"),
    "sqnr": (*_MSE, "a least-noise grid search"),
    "modelopt_mse": (*_MSE, "a least-squared-error amax sweep"),
    "mx_exponent_search": (*_MSE, "a least-squared-error exponent search"),
    "nvfp4_fp8_sweep": ("nvfp4_expanded_mse", "nvfp4_expanded_mse", "an NVFP4 scale search past the range"),
    "local_hessian": ("nvfp4_expanded_imatrix", "nvfp4_expanded_imatrix", "an input-weighted NVFP4 search"),
    "percentile": (*_MINMAX, "a quantile clip near the extremes"),
    "layerwise_percentile": (*_MINMAX, "a quantile clip near the extremes"),
    "nvfp4_act_headroom": (*_MINMAX, "a quantile-based amax"),
    "placeholder": (*_MINMAX, "a cast that reports the min/max"),
}
_FALLBACK = (*_MINMAX, "no closer rule")


def lc_observer(name: str, knobs: Mapping[str, Any], tensor: str) -> tuple[str, dict[str, Any], str | None]:
    """llm-compressor's observer for lab observer ``name`` on a ``tensor`` kind, its
    ``observer_kwargs``, and why it is only the nearest one (None when it is the same observer).
    A nearest observer gets no kwargs: the lab knobs belong to another rule."""
    lc_name, kwargs = ct_observer(name, knobs)
    if name in CT_OBSERVER_NAMES:
        return lc_name, kwargs, None
    weights, activations, why = NEAREST_LC_OBSERVERS.get(name, _FALLBACK)
    return (weights if tensor == "weight" else activations), {}, why


@dataclass(frozen=True)
class _Mapped:
    """One tensor's args as the recipe writes them and, when its observer is only the nearest
    one, the lab observer it replaces."""

    args: dict[str, Any]
    lab: str | None = None


def _mapped(
    args: dict[str, Any], observer: str, knobs: Mapping[str, Any], tensor: str, where: str, notes: list[str]
) -> _Mapped:
    """``args`` with the llm-compressor observer of the lab's choice; fully dynamic args keep none
    (llm-compressor computes their qparams at run time and attaches no observer)."""
    if args["dynamic"] is True:
        return _Mapped(dict(args))
    name, kwargs, why = lc_observer(observer, knobs, tensor)
    mapped = _Mapped({**args, "observer": name, "observer_kwargs": kwargs}, None if why is None else observer)
    if why is not None:
        dropped = ct_observer(observer, knobs)[1]
        extra = f"; its knobs {dropped} are not carried over" if dropped else ""
        notes.append(
            f"{where}: lab observer {observer!r} has no llm-compressor equivalent; written as its nearest, "
            f"{name!r} ({why}){extra}"
        )
    return mapped


def _plain(value: Any) -> Any:
    """Plain JSON types (str enums become str) so YAML writes them as scalars."""
    return json.loads(json.dumps(value))


def _comments(arg_name: str, members: list[tuple[str, _Mapped]]) -> list[str]:
    """The YAML comments of one tensor kind of a group: each lab observer that became its nearest
    llm-compressor one, with the layers that chose it when the group's layers chose differently."""
    lines = []
    labs = {mapped.lab for _, mapped in members}
    for lab in sorted(lab for lab in labs if lab is not None):
        lc = next(m.args["observer"] for _, m in members if m.lab == lab)
        line = f"# {arg_name}: lab observer {lab!r} -> llm-compressor {lc!r} (nearest)"
        if len(labs) > 1:
            line += " for " + ", ".join(layer for layer, m in members if m.lab == lab)
        lines.append(line)
    return lines


@dataclass
class _Group:
    scheme: dict[str, Any]
    targets: list[str]
    mapped: dict[str, list[tuple[str, _Mapped]]]


def _indivisible(item: CtLayer, shapes: Mapping[str, tuple[int, ...]], notes: list[str]) -> bool:
    """Whether the layer's weight has ragged groups (``ragged_groups``): then it is left out and noted."""
    why = ragged_groups(item.args.get("weight"), (shapes.get(item.layer) or (0,))[-1])
    if why is not None:
        notes.append(f"{item.layer} weight: {why}; not exported")
    return why is not None


def config_groups_of(
    items: list[CtLayer], shapes: Mapping[str, tuple[int, ...]], notes: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """``config_groups`` (one per distinct args, observer and kwargs of weight, input and output,
    observers as llm-compressor names them) and the YAML comments of each group: the recipe's
    groups, and the compressed checkpoint's."""
    groups: dict[str, _Group] = {}
    for item in items:
        if _indivisible(item, shapes, notes):
            item.args.pop("weight")
            item.entries.pop("weight")
            if not item.args:
                continue
        scheme: dict[str, Any] = {}
        mapped: dict[str, _Mapped] = {}
        for tensor in LAYER_TENSORS:
            arg_name = CT_ARG_NAMES[tensor]
            args = item.args.get(tensor)
            if args is None:
                scheme[arg_name] = None
                continue
            chosen, where = item.entries[tensor], f"{item.layer} {tensor}"
            mapped[arg_name] = _mapped(args, chosen.observer, chosen.knobs, tensor, where, notes)
            scheme[arg_name] = _plain(mapped[arg_name].args)
        group = groups.setdefault(json.dumps(scheme, sort_keys=True), _Group(scheme, [], {}))
        group.targets.append(item.layer)
        for arg_name, one in mapped.items():
            group.mapped.setdefault(arg_name, []).append((item.layer, one))
    config_groups: dict[str, dict[str, Any]] = {}
    comments: dict[str, list[str]] = {}
    for index, group in enumerate(groups.values()):
        name = f"group_{index}"
        config_groups[name] = {"targets": group.targets, **group.scheme}
        comments[name] = [line for arg, members in group.mapped.items() for line in _comments(arg, members)]
    return config_groups, comments


def _kv_cache_scheme(
    chosen: list[Chosen], notes: list[str], attention_blocks: Sequence[str] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """``kv_cache_scheme`` and its comments: one args for every attention block, with the most
    common chosen observer (first on ties); blocks that chose otherwise are noted."""
    kv = [entry for entry in chosen if entry.tensor in KV_TENSORS]
    if not kv:
        return None, []
    args, reasons = ct_args(kv[0].spec, "k")
    notes.extend(f"key/value states: {reason}" + ("; not exported" if args is None else "") for reason in reasons)
    if args is None:
        return None, []
    observer = Counter(entry.observer for entry in kv).most_common(1)[0][0]
    notes.extend(
        f"{entry.layer} {entry.tensor}: chose {entry.observer!r} but kv_cache_scheme records {observer!r} "
        "(llm-compressor has one KV-cache observer)"
        for entry in kv
        if entry.observer != observer
    )
    analysed = {entry.layer for entry in kv}
    others = [block for block in attention_blocks or [] if block not in analysed]
    if others:
        notes.append(
            "kv_cache_scheme applies to every attention block: llm-compressor also calibrates these, which the "
            f"lab did not analyse: {', '.join(others)}"
        )
    knobs = next(entry.knobs for entry in kv if entry.observer == observer)
    mapped = _mapped(args, observer, knobs, "k", "kv", notes)
    return _plain(mapped.args), _comments("kv_cache_scheme", [("", mapped)])


def _dump(value: Mapping[str, Any], indent: int) -> list[str]:
    text = yaml.safe_dump(dict(value), sort_keys=False, default_flow_style=False, width=1_000_000)
    return [" " * indent + line for line in text.splitlines()]


def _render(
    config_groups: dict[str, dict[str, Any]],
    comments: dict[str, list[str]],
    kv_cache_scheme: dict[str, Any] | None,
    kv_comments: list[str],
    notes: list[str],
    gptq: dict[str, Any] | None = None,
    awq: dict[str, Any] | None = None,
) -> str:
    """The recipe's YAML: a header, the notes as comments, an ``AWQModifier`` with its arguments
    for an AWQ deployment, then the one quantizing modifier (a ``GPTQModifier`` with its knobs for
    a GPTQ run) with a comment line above each group whose observer is only the nearest
    llm-compressor one."""
    lines = [
        "# llm-compressor recipe written by Observer Lab: the observer chosen for each layer.",
        "# llm-compressor calibrates the qparams itself (oneshot); the lab's own qparams are not in it.",
        *(f"# note: {' '.join(note.splitlines())}" for note in notes),
        f"{STAGE}:",
        f"  {MODIFIER_GROUP}:",
        *([] if awq is None else [f"    {AWQ_MODIFIER}:", *_dump(awq, 6)]),
        f"    {MODIFIER if gptq is None else GPTQ_MODIFIER}:",
        "      ignore: []",
        *([] if gptq is None else _dump(gptq, 6)),
    ]
    if config_groups:
        lines.append("      config_groups:")
        for name, group in config_groups.items():
            lines += [" " * 8 + line for line in comments[name]]
            lines += _dump({name: group}, 8)
    lines += [" " * 6 + line for line in kv_comments]
    lines += _dump({"kv_cache_scheme": kv_cache_scheme}, 6)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Recipe:
    """A built recipe: its YAML ``text``, the ``config_groups`` and ``kv_cache_scheme`` written in
    it (as ``yaml.safe_load`` reads them back), and ``notes`` on what it could not keep."""

    text: str
    config_groups: dict[str, dict[str, Any]]
    kv_cache_scheme: dict[str, Any] | None
    notes: list[str]
    gptq: dict[str, Any] | None = None
    """The ``GPTQModifier``'s own arguments (block size, dampening, activation order) for a GPTQ
    run; None: a ``QuantizationModifier``."""
    awq: dict[str, Any] | None = None
    """The ``AWQModifier``'s arguments (knobs, mappings) for an AWQ deployment; None: no AWQ."""

    def to_yaml(self) -> str:
        """The recipe as YAML text."""
        return self.text

    def to_bytes(self) -> bytes:
        """The recipe as UTF-8 bytes (the app's download)."""
        return self.text.encode("utf-8")

    def write(self, path: str | Path) -> str:
        """Write the recipe to ``path`` (into ``recipe.yaml`` when ``path`` is a directory);
        the path written."""
        out = Path(path)
        if out.is_dir():
            out = out / RECIPE_FILE
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(self.to_bytes())
        return str(out)


def build(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> Recipe:
    """The llm-compressor recipe of ``choices`` over ``analysis``.

    Activation tensors that saw no calibration tokens make this raise unless
    ``allow_uncalibrated``; they are then left out and listed in the notes (llm-compressor would
    calibrate them on its own data, but the lab has no choice for them worth keeping). The notes
    begin with who asked for the recipe (``provenance``, ``lab.provenance``).
    """
    selected, missing = export_selection(analysis, choices, allow_uncalibrated)
    notes = provenance_lines(provenance)
    notes += [f"{e.layer} {e.tensor}: saw no calibration tokens; uncalibrated, left out of the recipe" for e in missing]
    gptq = None if analysis.config.gptq is None else analysis.config.gptq.to_dict()
    return of_chosen(of_analysis(selected), analysis.facts, notes, gptq)


def of_chosen(
    chosen: list[Chosen],
    facts: ModelFacts,
    notes: Sequence[str] = (),
    gptq: Mapping[str, Any] | None = None,
    awq: Any = None,
) -> Recipe:
    """The recipe of ``chosen`` tensors (``lab.export.chosen``: an analysis's choices or a saved
    file's) on the model ``facts`` describe; ``notes`` come first in the recipe's notes. ``gptq``:
    the run's GPTQ settings (``GPTQSpec.to_dict``), which make the modifier a ``GPTQModifier``;
    ``awq``: an AWQ deployment (``lab.awq.deploy``'s; its ``modifier`` gives the ``AWQModifier``)."""
    notes = list(notes)
    items = ct_layers(chosen, notes)
    kv_cache_scheme, kv_comments = _kv_cache_scheme(chosen, notes, facts.attention_blocks)
    config_groups, comments = config_groups_of(items, facts.layer_shapes, notes)
    if not config_groups and kv_cache_scheme is None:
        raise ValueError("no chosen setting has an llm-compressor equivalent:\n  - " + "\n  - ".join(notes))
    modifier = None if gptq is None else gptq_modifier_args(gptq, notes)
    smoothing = None if awq is None else awq.modifier(notes)
    notes = list(dict.fromkeys([*notes, *unlinked(chosen)]))
    text = _render(config_groups, comments, kv_cache_scheme, kv_comments, notes, modifier, smoothing)
    return Recipe(text, config_groups, kv_cache_scheme, notes, modifier, smoothing)


def unlinked(chosen: Sequence[Chosen]) -> list[str]:
    """One note per fused group of weights whose shared scale llm-compressor's oneshot of the
    recipe does not share (``lab.runtime``): per-tensor scales, and NVFP4 global scales of layers
    it does not link (a BERT's query/key/value). A fusing server keeps one value for the group; the
    lab's checkpoint writes it, the recipe's oneshot gives each member its own."""
    specs = {c.layer: c.spec for c in chosen if c.tensor == "weight"}
    notes = []
    for unit, members in fused_groups(specs, Level.LINEAR):
        how = collapse(specs[members[0]], "weight")
        if len(members) < 2 or how is None:
            continue
        if how == Collapse.GLOBAL_SCALE and linked_by_llm_compressor(members[0]):
            continue
        names = ", ".join(member.rpartition(".")[2] for member in members)
        notes.append(
            f"{unit}: llm-compressor's oneshot of this recipe gives {names} their own {how.value}s (it links only "
            "the NVFP4 global scales of q/k/v, gate/up, q_a/kv_a_with_mqa and w1/w3); a fusing server keeps one for "
            "the group, which the lab's checkpoint writes"
        )
    return notes


def gptq_modifier_args(gptq: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """``GPTQModifier``'s arguments for a run's GPTQ settings. llm-compressor 0.14 fixes every
    group's scales before the sweep: a ``refit`` run gets a note, since oneshot will not refit."""
    spec = ob.GPTQSpec.from_dict(dict(gptq))
    if spec.scales == "refit":
        notes.append(
            "GPTQ: this choice refits each group's scales as the sweep reaches it; llm-compressor 0.14's GPTQModifier "
            "fixes them before the sweep, so its oneshot gives other codes and scales than the lab's checkpoint"
        )
    actorder = LC_ACTORDER[ob.gptq.ACTORDER_ALIASES[spec.actorder]]
    return {"block_size": spec.block_size, "dampening_frac": spec.dampening, "actorder": actorder}


def save(analysis: Analysis, choices: Mapping[tuple[str, str], str], allow_uncalibrated: bool = False) -> bytes:
    """The recipe as YAML bytes."""
    return build(analysis, choices, allow_uncalibrated).to_bytes()


def save_file(
    analysis: Analysis, choices: Mapping[tuple[str, str], str], path: str | Path, allow_uncalibrated: bool = False
) -> Recipe:
    """Write the recipe to ``path`` (a file, or ``recipe.yaml`` in a directory); returns what was written."""
    built = build(analysis, choices, allow_uncalibrated)
    built.write(path)
    return built
