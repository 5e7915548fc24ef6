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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

import observers as ob
from lab.model_facts import ModelFacts
from lab.vocab import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, KV, KV_TENSORS, LAYER_TENSORS, SPEC_KEYS, spec_key
from lab.vocab import observer_kind as _observer_kind
from observers.suite import SuiteResult

ProgressFn = Callable[[int, int, str], None]


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

    @property
    def observer_names(self) -> tuple[str, ...]:
        return tuple(ob.available()) if self.observers is None else tuple(self.observers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "specs": {kind: spec.to_dict() for kind, spec in self.specs.items()},
            "observers": list(self.observer_names),
            "knobs": self.knobs,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "texts": None if self.texts is None else list(self.texts),
            "actorder": self.actorder,
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


@dataclass
class TensorAnalysis:
    """The suite's results on one tensor of one layer."""

    layer: str
    tensor: str
    spec: ob.QuantSpec
    data: torch.Tensor
    results: list[SuiteResult]
    g_idx: torch.Tensor | None = None

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
            return int(self.data.shape[0] * self.data.shape[2])
        return int(self.data.shape[0])


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


def _captured(model, layers: Sequence[str], config: RunConfig) -> dict[tuple[str, str], torch.Tensor]:
    """Captured activations as ``{(layer, "input"|"output"): (tokens, hidden)}``."""
    wants_input = "input" in config.specs or config.actorder
    wants_output = "output" in config.specs
    if not (wants_input or wants_output):
        return {}
    captured = model.capture(list(layers), outputs=wants_output, **config.capture_options())
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


def _captured_kv(model, attention: Sequence[str], config: RunConfig) -> dict[tuple[str, str], torch.Tensor]:
    """Key and value states as ``{(block, "k"|"v"): (1, kv_heads, tokens, head_dim)}``."""
    if not attention:
        return {}
    states = model.capture_kv(list(attention), **config.capture_options())
    return {(block, which): data for block, pair in states.items() for which, data in pair.items()}


def _g_idx_for(config: RunConfig, spec: ob.QuantSpec, inputs: torch.Tensor | None) -> torch.Tensor | None:
    if not config.actorder or spec.strategy != "group" or spec.format.is_block:
        return None
    if inputs is None or inputs.shape[0] == 0:
        return None
    return ob.activation_order_g_idx(ob.column_importance(inputs), spec.group_size)


def _importance_for(tensor: str, inputs: torch.Tensor | None) -> torch.Tensor | None:
    """Per-column importance for weight observers that take one (``imatrix_mse``): the mean
    squared captured input, when the layer's inputs were captured."""
    if tensor != "weight" or inputs is None or inputs.numel() == 0:
        return None
    return ob.column_importance(inputs)


def analyse(
    model,
    layers: Sequence[str],
    config: RunConfig,
    progress: ProgressFn | None = None,
    cache: ResultCache | None = None,
    attention: Sequence[str] = (),
) -> Analysis:
    """Run ``config`` on ``layers`` of ``model`` (a ``sample_models`` model), and its ``kv`` spec
    on the key and value states of the ``attention`` blocks (entries ``(block, "k")`` and
    ``(block, "v")``, observed as ``kind="attention"``).

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
    weights = {layer: model.weight(layer) for layer in layers} if "weight" in config.specs or config.actorder else {}
    activations = _captured(model, layers, config) if layers else {}
    activations |= _captured_kv(model, attention, config)
    names = config.observer_names
    jobs = [(layer, tensor) for layer in layers for tensor in layer_kinds]
    jobs += [(block, which) for block in attention for which in KV_TENSORS]
    total = len(jobs) * len(names)
    entries: list[TensorAnalysis] = []
    warnings: list[str] = []
    step = 0
    for layer, tensor in jobs:
        data = weights.get(layer) if tensor == "weight" else activations.get((layer, tensor))
        if data is None:
            warnings.append(f"{layer}: no {tensor} activations were captured")
            step += len(names)
            continue
        spec = config.specs[spec_key(tensor)]
        inputs = activations.get((layer, "input"))
        g_idx = _g_idx_for(config, spec, inputs) if tensor == "weight" else None
        extra = config.calibration_key() if tensor != "weight" or g_idx is not None else ""
        importance = _importance_for(tensor, inputs)
        results = []
        for name in names:
            if progress is not None:
                progress(step, total, f"{layer} · {tensor} · {name}")
            step += 1
            knobs = dict(config.knobs.get(name, {}))
            key = cache.key(f"{source_id}|{layer}|{tensor}", spec, name, knobs, extra + str(config.actorder))
            if importance is not None and "importance" in ob.knobs(name) and "importance" not in knobs:
                key = cache.key(
                    f"{source_id}|{layer}|{tensor}", spec, name, knobs, f"importance|{config.calibration_key()}"
                )
                knobs["importance"] = importance
            run = partial(ob.run_one, name, data, spec, _observer_kind(tensor), g_idx=g_idx, **knobs)
            results.append(cache.get_or_run(key, run))
        entries.append(TensorAnalysis(layer, tensor, spec, data, results, g_idx))
    if progress is not None:
        progress(total, total, "done")
    return Analysis(facts, config, entries, time.perf_counter() - start, warnings)


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
