"""What a run is: ``RunConfig``, the one validated description of what to analyse (specs per
tensor kind, observers and knobs, the calibration set and how to stream it), and the default
observers of a set of specs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import observers as ob
from lab.analyse.tools import Tool
from lab.vocab import DEFAULT_BATCH_SIZE, DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, SAMPLE_BYTES, SPEC_KEYS
from lab.vocab import observer_kind as _observer_kind
from sample_models.calibration_sets import CalibrationSource, calibration_stamp


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
    do not change what the observers see, so they are not part of ``to_dict``. A budget also
    bounds the sample of tokens kept for metrics (``sample_bytes``), which the calibration key records."""

    specs: dict[str, ob.QuantSpec]
    observers: tuple[str, ...] | None = None
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = DEFAULT_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    texts: tuple[str, ...] | None = None
    actorder: bool = False
    dataset: CalibrationSource | None = None
    """The user's calibration records (``sample_models.calibration_sets``) instead of ``texts``."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Samples per forward pass: the batches the observers see one by one (a moving average's steps,
    a memoryless observer's last batch). Ranks that split the batches each run this many samples,
    so ``N`` ranks observe what one process with ``N`` times the batch size observes."""
    propagate: bool = False
    """Calibrate block ``i + 1`` on the outputs of block ``i`` fake-quantized with the choices made so
    far (by the default metric), as llm-compressor's sequential pipeline does by default
    (``propagate_error``); False: every block sees the float model's activations. Needs the
    layer-by-layer capture, which it then uses."""
    sequential: bool | None = None
    max_memory: int | None = None
    transform: ob.TransformSpec | None = None
    tools: tuple[str, ...] = ()
    """Also run each tensor as these tools would by default (``lab.analyse.tools``), beside the observers."""
    gptq: ob.GPTQSpec | None = None
    """Also put each weight observer's qparams through GPTQ on its layer (``lab.gptq``): the layer's
    inputs are captured for their Hessian even when only weights are analysed."""

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
        for knob in ("samples", "seq_len", "batch_size"):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{knob} must be a positive integer, got {value!r}")
        if self.dataset is not None and not isinstance(self.dataset, CalibrationSource):
            raise ValueError(f"dataset must be a CalibrationSource, got {type(self.dataset).__name__}")
        if self.propagate and self.sequential is False:
            raise ValueError("propagation runs block by block: it cannot be combined with the whole-model capture")
        if self.dataset is not None and self.texts is not None:
            raise ValueError("calibrate on a dataset or on pasted texts, not both")
        if self.transform is not None and not isinstance(self.transform, ob.TransformSpec):
            raise ValueError(f"transform must be an observers.TransformSpec, got {type(self.transform).__name__}")
        if self.gptq is not None:
            if not isinstance(self.gptq, ob.GPTQSpec):
                raise ValueError(f"gptq must be an observers.GPTQSpec, got {type(self.gptq).__name__}")
            if "weight" not in self.specs:
                raise ValueError("GPTQ quantizes weights, not activations or KV states: analyse the weights too")
            try:
                ob.check_gptq_spec(self.specs["weight"], self.gptq.scales, self.gptq.actorder)
            except ValueError as err:
                raise ValueError(f"--gptq: {err}") from None

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
            "dataset": None if self.dataset is None else self.dataset.to_dict(),
            "actorder": self.actorder,
            "batch_size": self.batch_size,
            "propagate": self.propagate,
            "transform": None if self.transform is None else self.transform.to_dict(),
            "tools": list(self.tools),
        } | ({"gptq": self.gptq.to_dict()} if self.gptq is not None else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The config ``to_dict`` wrote (a kept run's, ``lab.history``); its observers are the ones
        it ran, named."""
        gptq, transform, dataset = data.get("gptq"), data.get("transform"), data.get("dataset")
        return cls(
            specs={kind: ob.QuantSpec.from_dict(spec) for kind, spec in data["specs"].items()},
            observers=tuple(data["observers"]),
            knobs={name: dict(knobs) for name, knobs in data.get("knobs", {}).items()},
            samples=data["samples"],
            seq_len=data["seq_len"],
            texts=None if data.get("texts") is None else tuple(data["texts"]),
            actorder=bool(data.get("actorder", False)),
            dataset=None if dataset is None else CalibrationSource.from_dict(dataset),
            batch_size=data.get("batch_size", DEFAULT_BATCH_SIZE),
            propagate=bool(data.get("propagate", False)),
            transform=None if transform is None else ob.TransformSpec.from_dict(transform),
            tools=tuple(data.get("tools", ())),
            gptq=None if gptq is None else ob.GPTQSpec.from_dict(gptq),
        )

    def capture_options(self) -> dict[str, Any]:
        """The keyword arguments of ``capture`` / ``capture_kv`` for this run: the calibration set,
        and how to capture when one was chosen."""
        options: dict[str, Any] = {
            "texts": self.dataset if self.dataset is not None else None if self.texts is None else list(self.texts),
            "samples": self.samples,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "max_bytes": self.sample_bytes(),
        }
        how = {"sequential": True if self.propagate else self.sequential, "max_memory": self.max_memory}
        return options | {k: v for k, v in how.items() if v is not None}

    def sample_bytes(self) -> int:
        """Bytes of tokens kept for plots and metrics: ``SAMPLE_BYTES``, or a quarter of a
        ``max_memory`` budget when that is less, since the sample lives beside the weights the
        budget bounds (the observers see every token either way)."""
        return SAMPLE_BYTES if self.max_memory is None else min(SAMPLE_BYTES, self.max_memory // 4)

    def calibration_key(self) -> str:
        """Changes exactly when the captured activations would change."""
        payload = {"samples": self.samples, "seq_len": self.seq_len, "texts": self.texts}
        payload |= {"batch_size": self.batch_size, "sample_bytes": self.sample_bytes(), "propagate": self.propagate}
        payload |= {"dataset": None if self.dataset is None else calibration_stamp(self.dataset)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
