"""Run settings as a person gives them (app widgets or CLI flags) and the one way they become a
``RunConfig``.

``SpecSettings`` holds the values of one spec editor (format, range, granularity, sizes, MX
rounding, dynamic) and turns them into a ``QuantSpec``; ``RunSettings`` holds a whole run (the
weight, activation and KV-cache editors, what to analyse, observers, knob values, calibration,
activation order). The app's Run page and ``python -m observers run`` both fill a ``RunSettings``
and call ``config()``, so the same settings give the same run. No streamlit here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

import observers as ob
from lab.analyse.run_config import RunConfig, default_observers
from lab.vocab import DEFAULT_BATCH_SIZE, DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, KV, LINEAR_TYPES, SPEC_KEYS, TensorKind
from observers.formats import FAMILIES
from sample_models.calibration_sets import CalibrationSource, CalibrationSourceError

CALIBRATION_KINDS = ("built-in", "pasted", "uploaded file", "local path", "hub id")
DATASET_KINDS = CALIBRATION_KINDS[2:]
"""The app's calibration sets: the built-in texts, pasted text, or records read with ``datasets``."""
MISSING_SOURCE = {
    "uploaded file": "upload a calibration file",
    "local path": "enter the path of a calibration file or of a directory saved by save_to_disk",
    "hub id": "enter a hub dataset id",
}
ROLE_OF_KIND = {TensorKind.WEIGHT: "weight", TensorKind.INPUT: "act", TensorKind.OUTPUT: "act", KV: "kv"}
OBSERVER_KIND_OF_ROLE = {"weight": "weight", "act": "activation", "kv": "attention"}


def strategies(role: str) -> tuple[str, ...]:
    """Granularities a spec editor offers: those the observer library allows for its kind."""
    return tuple(str(s) for s in ob.STRATEGIES_BY_KIND[OBSERVER_KIND_OF_ROLE[role]])


# ---------------------------------------------------------------- formats


def formats_by_family() -> dict[str, list[str]]:
    """Every ``ob.FORMATS`` dtype grouped by its ``family`` (known families first, in the order
    of ``observers.formats.FAMILIES``; any new family after them)."""
    groups: dict[str, list[str]] = {}
    for name, fmt in ob.FORMATS.items():
        groups.setdefault(fmt.family, []).append(name)
    ordered = [f for f in FAMILIES if f in groups] + [f for f in groups if f not in FAMILIES]
    return {family: groups[family] for family in ordered}


def dtype_options(role: str = "weight") -> list[str]:
    """The formats a spec editor offers, in family order; a KV cache holds one scale per tensor
    or head, so it gets no block formats."""
    names = [name for names in formats_by_family().values() for name in names]
    if role == "kv":
        return [name for name in names if not ob.get_format(name).is_block]
    return names


def dtype_label(name: str) -> str:
    """``family · dtype``, as the format box shows it."""
    return f"{ob.get_format(name).family} · {name}"


# ---------------------------------------------------------------- one spec


@dataclass
class SpecSettings:
    """Widget values (or CLI flags) of one spec editor."""

    dtype: str = "int8"
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: int = 128
    block_rows: int = 128
    block_cols: int = 128
    scale_rounding: str = "floor"
    dynamic: bool = False

    def spec(self) -> ob.QuantSpec:
        """The ``QuantSpec``: only the fields the strategy and format use are set. This is the one
        place of the rule "block formats (MX, NVFP4, BFP) are group-wise with their own block
        size and symmetric; float formats are symmetric"."""
        fmt = ob.get_format(self.dtype)
        fields: dict[str, Any] = {"dtype": self.dtype, "strategy": self.strategy, "dynamic": self.dynamic}
        fields["symmetric"] = self.symmetric if self.free_range else True
        if fmt.is_block:
            fields["strategy"] = "group"
        elif self.strategy == "group":
            fields["group_size"] = int(self.group_size)
        elif self.strategy == "block":
            fields["block_size"] = (int(self.block_rows), int(self.block_cols))
        if fmt.scale_kind == "e8m0":
            fields["scale_rounding"] = self.scale_rounding
        return ob.QuantSpec(**fields)

    @property
    def free_range(self) -> bool:
        """True when the format lets a person choose symmetric or asymmetric (plain integers)."""
        fmt = ob.get_format(self.dtype)
        return fmt.kind == "int" and not fmt.is_block

    @classmethod
    def from_spec(cls, spec: ob.QuantSpec) -> SpecSettings:
        block = spec.block_size or (128, 128)
        return cls(
            dtype=spec.dtype,
            symmetric=spec.symmetric,
            strategy=spec.strategy,
            group_size=spec.group_size or 128,
            block_rows=block[0],
            block_cols=block[1],
            scale_rounding=spec.scale_rounding,
            dynamic=spec.dynamic,
        )


# ---------------------------------------------------------------- knobs


def knob_overrides(values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Only the knobs that differ from their defaults, per observer (what ``RunConfig.knobs`` takes)."""
    overrides = {}
    for name, knobs in values.items():
        defaults = ob.knobs(name)
        changed = {k: v for k, v in knobs.items() if k in defaults and v != defaults[k]}
        if changed:
            overrides[name] = changed
    return overrides


def parse_knob(declared: ob.Knob, name: str, text: str) -> Any:
    """A knob value typed as text (the CLI's ``--knob``) read as its declared type; a value that
    does not read is a ``ValueError`` saying what the knob allows."""
    text = text.strip()
    if declared.optional and text.lower() in ("", "none"):
        return None
    readers: dict[type, Any] = {bool: _read_bool, int: int, float: float, str: str}
    reader = readers.get(declared.type)
    if reader is None:
        raise ValueError(f"{name} cannot be given as text ({declared.allowed()})")
    try:
        return reader(text)
    except ValueError:
        raise ValueError(f"{name} must be {declared.allowed()}, got {text!r}") from None


def _read_bool(text: str) -> bool:
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if text.lower() not in words:
        raise ValueError(text)
    return words[text.lower()]


def check_knobs(knobs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per bad knob value (``observer.knob: why``), checked against each knob's
    declaration, so a run is refused before anything is computed."""
    problems = []
    for observer, values in knobs.items():
        if observer not in ob.available():
            problems.append(f"{observer}: unknown observer; available: {', '.join(ob.available())}")
            continue
        declared = ob.knob_specs(observer)
        for knob, value in values.items():
            if knob not in declared:
                problems.append(f"{observer}.{knob}: unknown knob; {observer} has {', '.join(declared)}")
                continue
            try:
                declared[knob].check(knob, value)
            except ValueError as err:
                problems.append(f"{observer}.{err}")
    return problems


# ---------------------------------------------------------------- a whole run


def _default_wants() -> dict[str, bool]:
    return {kind: kind in ("weight", "input") for kind in SPEC_KEYS}


@dataclass
class RunSettings:
    """Everything a run is set up with, before it becomes a ``RunConfig``.

    ``wants`` says which tensor kinds to analyse (``weight``, ``input``, ``output``, ``kv``);
    ``observers`` None means every registered observer; ``knobs`` holds knob values per observer
    (only those that differ from the defaults reach the config); ``texts`` None means the
    built-in calibration texts.
    """

    weight: SpecSettings = field(default_factory=SpecSettings)
    act: SpecSettings = field(default_factory=SpecSettings)
    kv: SpecSettings = field(default_factory=lambda: SpecSettings(dtype="fp8_e4m3"))
    wants: dict[str, bool] = field(default_factory=_default_wants)
    observers: tuple[str, ...] | None = None
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = DEFAULT_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    texts: tuple[str, ...] | None = None
    actorder: bool = False
    batch_size: int = DEFAULT_BATCH_SIZE
    dataset: CalibrationSource | None = None
    propagate: bool = False
    preset: str = "custom"
    sequential: bool | None = None
    max_memory: int | None = None
    transform: str | None = None
    """Look through a transform (``observers.TransformKind``) or None; its seed and SmoothQuant's alpha follow."""
    transform_seed: int = 0
    smooth_alpha: float = 0.5
    tools: tuple[str, ...] = ()
    """Also run each tensor as these tools would by default (``lab.analyse.tools``)."""
    gptq: ob.GPTQSpec | None = None
    """Also put the weight observers' qparams through GPTQ (``lab.gptq``), or None."""
    gptq_knobs: ob.GPTQSpec = field(default_factory=ob.GPTQSpec)
    """The Run page's GPTQ knobs, kept while its switch is off (``gptq`` is these when it is on)."""

    def editor(self, role: str) -> SpecSettings:
        """The spec editor of ``role`` (``weight``, ``act`` or ``kv``)."""
        return {"weight": self.weight, "act": self.act, "kv": self.kv}[role]

    def apply_preset(self, name: str) -> None:
        """Fill the weight and activation editors from preset ``name``; a preset that keeps
        activations in high precision also stops analysing inputs."""
        self.preset = name
        if name == "custom":
            return
        specs = ob.preset(name)
        self.weight = SpecSettings.from_spec(specs["weight"])
        if specs.get("input") is not None:
            self.act = SpecSettings.from_spec(specs["input"])
        self.wants = {**self.wants, "input": specs.get("input") is not None}

    @property
    def actorder_applies(self) -> bool:
        """Activation order needs group-wise integer weights and captured inputs."""
        fmt = ob.get_format(self.weight.dtype)
        return self.weight.strategy == "group" and not fmt.is_block and self.wants.get("input", False)

    def kinds(self, has_layers: bool = True, has_attention: bool = False, can_capture: bool = True) -> list[str]:
        """The spec keys this run analyses: layer tensors only with layers, ``kv`` only with
        attention blocks, activations and key/value states only where the model can run."""
        return [
            kind
            for kind in SPEC_KEYS
            if self.wants.get(kind, False)
            and (has_attention if kind == KV else has_layers)
            and (can_capture or kind == TensorKind.WEIGHT)
        ]

    def default_observers(
        self, has_layers: bool = True, has_attention: bool = False, can_capture: bool = True
    ) -> list[str]:
        """The observers a run of these settings compares when none are chosen: every one that
        applies to a spec it analyses (a spec the editors cannot build yet is left out)."""
        specs = {}
        for kind in self.kinds(has_layers, has_attention, can_capture):
            try:
                specs[kind] = self.editor(ROLE_OF_KIND[kind]).spec()
            except ValueError:
                continue
        return list(default_observers(specs))

    def calibrates(self, has_layers: bool = True, has_attention: bool = False, can_capture: bool = True) -> bool:
        """Whether a run of these settings reads the calibration set: activations or key/value
        states to observe, or SmoothQuant's scales to find from layer inputs."""
        smooths = self.transform == ob.TransformKind.SMOOTHQUANT and has_layers and can_capture
        return smooths or any(kind != TensorKind.WEIGHT for kind in self.kinds(has_layers, has_attention, can_capture))

    def config(self, has_layers: bool = True, has_attention: bool = False, can_capture: bool = True) -> RunConfig:
        """The ``RunConfig`` of these settings (``kinds`` says which specs it holds); a bad knob
        value is a ``ValueError`` listing every problem, before anything runs."""
        problems = check_knobs(self.knobs)
        if problems:
            raise ValueError("bad knob value(s): " + "; ".join(problems))
        if self.texts is not None and not any(text.strip() for text in self.texts):
            raise ValueError("the pasted calibration text is empty: paste some text or use the built-in set")
        if self.transform == ob.TransformKind.SMOOTHQUANT and not (can_capture and has_layers):
            raise ValueError(
                "SmoothQuant finds its scales from captured layer inputs: choose layers of a model that runs"
            )
        kinds = self.kinds(has_layers, has_attention, can_capture)
        specs = {kind: self.editor(ROLE_OF_KIND[kind]).spec() for kind in kinds}
        return RunConfig(
            specs=specs,
            observers=self.observers,
            knobs=knob_overrides(self.knobs),
            samples=int(self.samples),
            seq_len=int(self.seq_len),
            texts=self.texts,
            batch_size=int(self.batch_size),
            dataset=self.dataset,
            propagate=bool(self.propagate),
            actorder=bool(self.actorder and self.actorder_applies and can_capture),
            sequential=self.sequential,
            max_memory=self.max_memory,
            transform=self.transform_spec(),
            tools=tuple(self.tools),
            gptq=self.gptq,
        )

    def transform_spec(self) -> ob.TransformSpec | None:
        """The transform the run looks through, validated (None: the model as it is)."""
        if self.transform is None:
            return None
        return ob.TransformSpec(self.transform, seed=int(self.transform_seed), alpha=float(self.smooth_alpha))

    def copy(self) -> RunSettings:
        """An independent copy (editors and dicts included)."""
        return replace(
            self,
            weight=replace(self.weight),
            act=replace(self.act),
            kv=replace(self.kv),
            wants=dict(self.wants),
            knobs={k: dict(v) for k, v in self.knobs.items()},
        )


# ---------------------------------------------------------------- the app's calibration set


@dataclass
class CalibrationForm:
    """The Model page's calibration fields: which set (``CALIBRATION_KINDS``), the path, hub id
    and split typed, the text column, the shuffle seed as typed (empty: file order), the saved
    upload (its path, the name the person's file had, a digest of its bytes) and ``problem``: why
    the chosen set cannot be used (set each time the page draws it; the Run page refuses then)."""

    kind: str = "built-in"
    path: str = ""
    hub_id: str = ""
    split: str = "train"
    text_column: str = "text"
    shuffle_seed: str = ""
    upload: str = ""
    upload_name: str = ""
    upload_digest: str = ""
    problem: str | None = None

    @property
    def reads_dataset(self) -> bool:
        """An uploaded file, a local path or a hub id (read with ``datasets``)."""
        return self.kind in DATASET_KINDS

    def location(self) -> str:
        return {"uploaded file": self.upload, "local path": self.path, "hub id": self.hub_id}.get(self.kind, "").strip()

    def source(self) -> CalibrationSource:
        """The ``CalibrationSource`` of the fields; what cannot be one (a missing local path, a seed
        that is not a whole number) is a ``CalibrationSourceError``."""
        location, seed = self.location(), self.shuffle_seed.strip()
        if not location:
            raise CalibrationSourceError(MISSING_SOURCE.get(self.kind, f"choose a calibration set, not {self.kind!r}"))
        if self.kind == "local path" and not Path(location).expanduser().exists():
            raise CalibrationSourceError(f"calibration file {location} does not exist")
        if seed and not (seed.isascii() and seed.isdigit()):
            raise CalibrationSourceError(f"the shuffle seed must be a whole number (0 or more) or empty, got {seed!r}")
        return CalibrationSource(
            location,
            text_column=self.text_column.strip() or "text",
            split=self.split.strip() or "train",
            shuffle_seed=int(seed) if seed else None,
        )


# ---------------------------------------------------------------- memory

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A memory size as a person writes it (``150MB``, ``8GiB``, ``1.5 GB``, ``4096``) in bytes;
    anything else is a ``ValueError`` saying what is accepted."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"memory size {text!r} must be a positive number with an optional unit (MB, GB, MiB, GiB)")
    return int(float(match.group(1)) * _UNITS[unit])


# ---------------------------------------------------------------- layers


def default_layer_names(infos: Sequence, count: int = 6) -> list[str]:
    """The first ``count`` linear layers (else the first 2-D layers): a quick, typical selection."""
    linear = [i.name for i in infos if i.type in LINEAR_TYPES]
    if linear:
        return linear[:count]
    return [i.name for i in infos if len(i.shape) >= 2][:count]


def layer_pattern(text: str) -> str | None:
    """A filter box's text as a ``Model.layers`` pattern: empty means all; a plain word (no glob
    characters, no ``re:``) matches names containing it."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("re:") or any(c in text for c in "*?["):
        return text
    return f"*{text}*"


def layer_frame(infos: Sequence) -> pd.DataFrame:
    """The layer table: name, type, shape, params."""
    return pd.DataFrame(
        {
            "name": [i.name for i in infos],
            "type": [i.type for i in infos],
            "shape": [" × ".join(map(str, i.shape)) for i in infos],
            "params": [i.params for i in infos],
        }
    )
