"""Run the observer suite over chosen layers of a model: the one code path of the app and CLI.

``analyse(model, layers, config, attention=blocks)`` reads each layer's weight, captures the
layer's input (and optionally output) activations on calibration text, captures the key and value
states of the chosen attention blocks (the tensors a KV cache holds), and runs every requested
observer on each tensor. Results are cached per (tensor, spec, observer, knobs), so a re-run after one knob
changes recomputes only that observer; ``CapturingModel`` memoizes the capture itself. The
``Analysis`` records the facts of its model (``lab.model_facts``), so its results stay tied to
that model. Ranking and choosing observers live in ``lab.results``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

import observers as ob
from lab import observed
from lab.distributed import SINGLE, Ranks, owner
from lab.model_facts import ModelFacts
from lab.tools import Tool, profile
from lab.vocab import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, KV, KV_TENSORS, LAYER_TENSORS, SPEC_KEYS, spec_key
from lab.vocab import observer_kind as _observer_kind
from observers.suite import SuiteResult

ProgressFn = Callable[[int, int, str], None]


def default_observers(specs: dict[str, ob.QuantSpec]) -> tuple[str, ...]:
    """Every observer that applies to at least one of ``specs`` (keyed by tensor kind), in
    registry order: what a run with no observers named compares."""
    found = {name for key, spec in specs.items() for name in ob.applicable(spec, _observer_kind(key))}
    return tuple(name for name in ob.available() if name in found)


@dataclass(frozen=True)
class RunConfig:
    """What to run: a spec per tensor kind (``weight``/``input``/``output`` of layers, ``kv`` for
    the key and value states of attention blocks, as one KV-cache scheme covers both; absent =
    skip), the observers (None = all registered), knob overrides per observer, calibration settings,
    and whether group weights use activation order (``actorder``).

    ``sequential`` and ``max_memory`` say *how* activations are captured (layer by layer, under a
    memory budget in bytes; None: the model decides, see ``sample_models.Model.capture``); they
    do not change a single captured value, so they are not part of ``to_dict`` or any cache key."""

    specs: dict[str, ob.QuantSpec]
    observers: tuple[str, ...] | None = None
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = DEFAULT_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    texts: tuple[str, ...] | None = None
    actorder: bool = False
    sequential: bool | None = None
    max_memory: int | None = None
    transform: ob.TransformSpec | None = None
    tools: tuple[str, ...] = ()
    """Also run each tensor as these tools would by default (``lab.tools``), beside the observers."""

    def __post_init__(self) -> None:
        unknown = set(self.specs) - set(SPEC_KEYS)
        if unknown:
            raise ValueError(f"unknown tensor kind(s) {sorted(unknown)}; allowed: {', '.join(SPEC_KEYS)}")
        if not self.specs:
            raise ValueError("choose at least one tensor kind to analyse (weight, input, output, kv)")
        for kind, spec in self.specs.items():
            if not isinstance(spec, ob.QuantSpec):
                raise ValueError(f"spec for {kind!r} must be a QuantSpec, got {type(spec).__name__}")
        for kind, spec in self.specs.items():
            spec.check_kind(_observer_kind(kind))
        if self.tools:
            known = [tool.value for tool in Tool]
            unknown = [tool for tool in self.tools if tool not in known]
            if unknown:
                raise ValueError(f"unknown tool(s) {', '.join(map(str, unknown))}; allowed: {', '.join(known)}")
        object.__setattr__(self, "tools", tuple(str(tool) for tool in self.tools))
        if self.transform is not None and not isinstance(self.transform, ob.TransformSpec):
            raise ValueError(f"transform must be an observers.TransformSpec, got {type(self.transform).__name__}")

    @property
    def observer_names(self) -> tuple[str, ...]:
        """The observers named, else (None) every observer that applies to any of the specs,
        in registry order (``observers_for`` says which run on each tensor)."""
        return tuple(self.observers) if self.observers is not None else default_observers(self.specs)

    def observers_for(self, key: str) -> tuple[str, ...]:
        """The observers run on the tensors of spec ``key``: the named ones (an observer that
        does not apply reports why in its result), else ``observers.applicable`` for the spec."""
        if self.observers is not None:
            return tuple(self.observers)
        return tuple(ob.applicable(self.specs[key], _observer_kind(key)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "specs": {kind: spec.to_dict() for kind, spec in self.specs.items()},
            "observers": list(self.observer_names),
            "knobs": self.knobs,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "texts": None if self.texts is None else list(self.texts),
            "actorder": self.actorder,
            "transform": None if self.transform is None else self.transform.to_dict(),
            "tools": list(self.tools),
        }

    def capture_options(self) -> dict[str, Any]:
        """The keyword arguments of ``capture`` / ``capture_kv`` for this run: the calibration set,
        and how to capture when one was chosen."""
        options: dict[str, Any] = {
            "texts": None if self.texts is None else list(self.texts),
            "samples": self.samples,
            "seq_len": self.seq_len,
        }
        how = {"sequential": self.sequential, "max_memory": self.max_memory}
        return options | {k: v for k, v in how.items() if v is not None}

    def calibration_key(self) -> str:
        """Changes exactly when the captured activations would change."""
        payload = {"samples": self.samples, "seq_len": self.seq_len, "texts": self.texts}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ToolResult:
    """One tool's default on one tensor: its ``profile`` (observer, knobs, spec with the tool's
    conventions; None when the tool cannot express the scheme, ``result.error`` says why) and the
    suite's result, named ``"<tool>: <observer>"`` so plots and tables tell it from the observers."""

    tool: str
    profile: Any
    result: SuiteResult


@dataclass
class TensorAnalysis:
    """The suite's results on one tensor of one layer.

    When ranks split the calibration batches, ``data`` is this rank's part, ``total_shape`` the
    shape of the whole (every rank's tokens) and ``rank`` is None (all ranks computed it);
    ``rank`` is the rank that computed a weight's results."""

    layer: str
    tensor: str
    spec: ob.QuantSpec
    data: torch.Tensor
    results: list[SuiteResult]
    g_idx: torch.Tensor | None = None
    total_shape: tuple[int, ...] | None = None
    rank: int | None = 0
    tool_results: list[ToolResult] = field(default_factory=list)
    """What each of ``RunConfig.tools`` produces by default (``lab.tools``): shown beside the
    observers, recorded in the JSON, never ranked, chosen or exported as qparams."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The analysed tensor's shape (all ranks' tokens together for a split calibration)."""
        return tuple(self.data.shape) if self.total_shape is None else self.total_shape

    def result(self, observer: str) -> SuiteResult:
        for r in self.results:
            if r.name == observer:
                return r
        raise ValueError(f"observer {observer!r} was not run on {self.layer} {self.tensor}")

    @property
    def num_tokens(self) -> int:
        """Calibration tokens in ``data`` (0 for weights): rows of an activation, sequence
        positions of attention states ``(batch, heads, seq, head_dim)``."""
        if self.tensor == "weight":
            return 0
        if self.tensor in KV_TENSORS:
            return int(self.shape[0] * self.shape[2])
        return int(self.shape[0])


@dataclass
class Analysis:
    """Everything one run produced, in run order, and the facts of the model it ran on."""

    facts: ModelFacts
    config: RunConfig
    entries: list[TensorAnalysis]
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def source(self) -> dict[str, Any]:
        """Where the analysed weights came from (``ModelFacts.source``)."""
        return self.facts.source

    def keys(self) -> list[tuple[str, str]]:
        """The analysed ``(layer, tensor)`` pairs in run order."""
        return [(e.layer, e.tensor) for e in self.entries]

    def entry(self, layer: str, tensor: str) -> TensorAnalysis:
        for e in self.entries:
            if e.layer == layer and e.tensor == tensor:
                return e
        raise ValueError(f"no results for layer {layer!r} tensor {tensor!r}")

    def frame(self):
        """pandas DataFrame: one row per (layer, tensor, observer) with metrics and time."""
        import pandas as pd

        rows = []
        for e in self.entries:
            frame = ob.results_frame(e.results)
            frame.insert(0, "tensor", e.tensor)
            frame.insert(0, "layer", e.layer)
            rows.append(frame)
        return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


class ResultCache:
    """SuiteResults keyed by everything that determines them; lives as long as its owner
    (the app keeps one per browser session, the CLI one per run)."""

    def __init__(self) -> None:
        self._store: dict[str, SuiteResult] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(tensor_id: str, spec: ob.QuantSpec, observer: str, knobs: dict[str, Any], extra: str = "") -> str:
        payload = json.dumps([tensor_id, spec.to_dict(), observer, knobs, extra], sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()

    def get_or_run(self, key: str, run: Callable[[], SuiteResult]) -> SuiteResult:
        if key in self._store:
            self.hits += 1
            return self._store[key]
        self.misses += 1
        result = run()
        self._store[key] = result
        return result

    def __len__(self) -> int:
        return len(self._store)


def _captured(model, layers: Sequence[str], config: RunConfig, ranks: Ranks) -> dict[tuple[str, str], torch.Tensor]:
    """Captured activations as ``{(layer, "input"|"output"): (tokens, hidden)}``."""
    wants_input = "input" in config.specs or config.actorder or observed.smooths(config)
    wants_output = "output" in config.specs
    if not (wants_input or wants_output):
        return {}
    captured = model.capture(list(layers), outputs=wants_output, **_capture_options(config, ranks))
    found: dict[tuple[str, str], torch.Tensor] = {}
    for layer, value in captured.items():
        if isinstance(value, dict):
            for tensor, data in value.items():
                found[(layer, tensor)] = data
        else:
            found[(layer, "input")] = value
    for layer, data in getattr(captured, "outputs", {}).items():
        found[(layer, "output")] = data
    return found


def _captured_kv(
    model, attention: Sequence[str], config: RunConfig, ranks: Ranks
) -> dict[tuple[str, str], torch.Tensor]:
    """Key and value states as ``{(block, "k"|"v"): (1, kv_heads, tokens, head_dim)}``."""
    if not attention:
        return {}
    states = model.capture_kv(list(attention), **_capture_options(config, ranks))
    return {(block, which): data for block, pair in states.items() for which, data in pair.items()}


def _capture_options(config: RunConfig, ranks: Ranks) -> dict[str, Any]:
    """``config.capture_options()``, and this rank's share of the batches when ranks split them."""
    split = {"share": (ranks.rank, ranks.world_size)} if ranks.world_size > 1 else {}
    return config.capture_options() | split


def analyse(
    model,
    layers: Sequence[str],
    config: RunConfig,
    progress: ProgressFn | None = None,
    cache: ResultCache | None = None,
    attention: Sequence[str] = (),
    ranks: Ranks = SINGLE,
) -> Analysis:
    """Run ``config`` on ``layers`` of ``model`` (a ``sample_models`` model), and its ``kv`` spec
    on the key and value states of the ``attention`` blocks (entries ``(block, "k")`` and
    ``(block, "v")``, observed as ``kind="attention"``).

    With several ``ranks`` (torchrun) the ranks split the calibration batches: every rank calls
    ``analyse`` with the same arguments, captures its share, and the activation observers merge
    their statistics across ranks (``observers.shared``), so every rank ends with the same
    activation results; the weights are split instead, layer ``i`` analysed by rank
    ``i % world_size`` only (``lab.distributed.owner``).

    ``progress(done, total, label)`` is called before each (layer, tensor, observer) step.
    Errors of one observer land in its ``SuiteResult.error``; a bad layer name or a missing
    activation source raises ``ValueError`` before anything runs.
    """
    layer_kinds = [kind for kind in LAYER_TENSORS if kind in config.specs]
    if attention and KV not in config.specs:
        raise ValueError("attention blocks were chosen but no KV-cache spec: add a 'kv' spec to the run config")
    if KV in config.specs and not attention:
        raise ValueError("a KV-cache spec needs at least one attention block to capture keys and values from")
    if layer_kinds and not layers:
        raise ValueError("choose at least one layer")
    if not layers and not attention:
        raise ValueError("choose at least one layer or attention block")
    cache = ResultCache() if cache is None else cache
    start = time.perf_counter()
    facts = ModelFacts.of(model, with_kv=bool(attention))
    source_id = json.dumps(
        [getattr(model, "name", ""), str(getattr(model, "source", "")), str(getattr(model, "dtype", ""))]
    )
    split = ranks.world_size > 1
    mine = [layer for i, layer in enumerate(layers) if not split or owner(i, ranks.world_size) == ranks.rank]
    read = layers if observed.smooths(config) else mine if "weight" in config.specs else []
    weights, activations, failed, notes = {}, {}, None, []
    try:
        weights = {layer: model.weight(layer) for layer in read}
        activations = _captured(model, layers, config, ranks) if layers else {}
        activations |= _captured_kv(model, attention, config, ranks)
    except (ValueError, OSError, RuntimeError) as err:  # one rank's reads failing stops every rank
        failed = err
    ranks.agree(failed)
    if config.transform is not None:
        weights, activations, notes = observed.transformed(config, layers, weights, activations, ranks)
    weights = {layer: weights[layer] for layer in mine if layer in weights} if "weight" in config.specs else {}
    statistics = observed.input_statistics(layers, activations, config, ranks)
    same = observed.identical_activations(activations, ranks)
    jobs = [(layer, tensor) for layer in layers for tensor in layer_kinds]
    jobs += [(block, which) for block in attention for which in KV_TENSORS]
    names_for = {key: config.observers_for(key) for key in config.specs}
    total = sum(len(names_for[spec_key(tensor)]) for _, tensor in jobs)
    entries: list[TensorAnalysis] = []
    warnings: list[str] = list(notes)
    step = 0
    for layer, tensor in jobs:
        data = weights.get(layer) if tensor == "weight" else activations.get((layer, tensor))
        if data is None:
            if tensor != "weight":
                warnings.append(f"{layer}: no {tensor} activations were captured")
            step += len(names_for[spec_key(tensor)])
            continue
        spec = config.specs[spec_key(tensor)]
        names = names_for[spec_key(tensor)]
        weight_job = tensor == "weight"
        given = statistics.get(layer, {}) if weight_job else {}
        g_idx = observed.g_idx_for(config, spec, given.get("importance")) if weight_job else None
        extra = config.calibration_key() if not weight_job or g_idx is not None else ""
        extra += f"|share {ranks.rank}/{ranks.world_size}" if split else ""
        extra += f"|{json.dumps(config.transform.to_dict(), sort_keys=True)}" if config.transform else ""
        across = ranks.reduce if split and not weight_job else None
        first_layer, first_tensor = same.get((layer, tensor), (layer, tensor))
        tensor_id = f"{source_id}|{first_layer}|{first_tensor}"  # identical tensors share their results
        results = []
        for name in names:
            if progress is not None:
                progress(step, total, f"{layer} · {tensor} · {name}")
            step += 1
            knobs = dict(config.knobs.get(name, {}))
            key = cache.key(tensor_id, spec, name, knobs, extra + str(config.actorder))
            filled = sorted(knob for knob in given if knob in ob.knobs(name) and knob not in knobs)
            if filled:
                inputs_key = f"{'+'.join(filled)}|{config.calibration_key()}"
                key = cache.key(tensor_id, spec, name, knobs, inputs_key + extra)
                knobs |= {knob: given[knob] for knob in filled}
            run = partial(ob.run_one, name, data, spec, _observer_kind(tensor), g_idx=g_idx, across=across, **knobs)
            results.append(cache.get_or_run(key, run))
        shared = across is not None
        whole = observed.total_shape(tensor, data, ranks) if shared else None
        entry = TensorAnalysis(layer, tensor, spec, data, results, g_idx, whole, None if shared else ranks.rank)
        entry.tool_results = [_as_tool(tool, entry, across, cache, tensor_id, extra) for tool in config.tools]
        entries.append(entry)
    if progress is not None:
        progress(total, total, "done")
    return Analysis(facts, config, entries, time.perf_counter() - start, warnings)


def _as_tool(
    tool: str, entry: TensorAnalysis, across: Any, cache: ResultCache, tensor_id: str, extra: str
) -> ToolResult:
    """``entry``'s tensor observed as ``tool`` would by default: its observer, knobs and conventions,
    through the result cache like the observers (a re-run after a knob change reuses it)."""
    try:
        found = profile(tool, entry.tensor, entry.spec)
    except ValueError as err:
        return ToolResult(tool, None, SuiteResult(tool, None, {}, 0.0, {}, 0, str(err)))
    kind = _observer_kind(entry.tensor)
    run = partial(
        ob.run_one, found.observer, entry.data, found.spec, kind, g_idx=entry.g_idx, across=across, **found.knobs
    )
    result = cache.get_or_run(cache.key(tensor_id, found.spec, found.observer, found.knobs, extra), run)
    return ToolResult(tool, found, replace(result, name=f"{tool}: {found.observer}"))


class CapturingModel:
    """A model whose ``capture`` / ``capture_kv`` are memoized in ``store`` (the app keeps one
    per browser session): re-running after changing only a knob or a format reuses the
    activations captured for the same layers and texts."""

    def __init__(self, model, store: dict[str, Any]) -> None:
        self._model = model
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def capture(self, names: list[str], **kwargs: Any):
        return self._memo("capture", names, kwargs)

    def capture_kv(self, blocks: list[str], **kwargs: Any):
        return self._memo("capture_kv", blocks, kwargs)

    def _memo(self, method: str, names: list[str], kwargs: dict[str, Any]):
        key = repr((getattr(self._model, "source", ""), str(getattr(self._model, "dtype", "")), names, kwargs))
        slot = self._store.setdefault(method, {})
        if slot.get("key") != key:
            slot.clear()
            slot["value"] = getattr(self._model, method)(names, **kwargs)
            slot["key"] = key
        return slot["value"]
