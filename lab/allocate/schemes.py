"""What an allocation chooses between, and under what: the candidate schemes (``--schemes``) and the
budget (``--budget``, ``--budgets``), read once from what a person writes.

A scheme is a compressed-tensors preset (``NVFP4``, ``W4A16``, ``FP8``, …: its weight and, where it
has one, its input format), ``none`` (the layer stays in its dtype), or a weight-only spec string
``DTYPE[:STRATEGY[:SIZE]]`` (``int4:group:64``, ``int8:channel``, ``fp8_e4m3:block:128x128``). With
``--kinds weight`` every scheme quantizes weights only, as ``run`` does.

A budget is average bits per weight over the chosen layers (``4.8``, ``4.8bits``) or the whole
checkpoint's size (``3.2GB``, ``900MiB``); a run's budgets are all in one unit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import observers as ob
from lab.settings import parse_bytes

NONE = "none"
"""The scheme that keeps a layer in its dtype."""


@dataclass(frozen=True)
class Scheme:
    """One candidate: its name as written, its weight spec (None: kept dense) and its input spec
    (None: the layer's inputs stay in their dtype)."""

    name: str
    weight: ob.QuantSpec | None
    input: ob.QuantSpec | None = None

    @property
    def dense(self) -> bool:
        return self.weight is None

    def specs(self) -> dict[str, ob.QuantSpec]:
        """The ``RunConfig`` specs of the scheme: its weight, and its input when it has one."""
        found = {"weight": self.weight, "input": self.input}
        return {kind: spec for kind, spec in found.items() if spec is not None}


def parse_scheme(text: str, weights_only: bool = False) -> Scheme:
    """One scheme from its name: a preset (any case), ``none`` or a weight-only spec string."""
    name = text.strip()
    if name.lower() == NONE:
        return Scheme(NONE, None)
    presets = {preset.lower(): preset for preset in ob.PRESET_NAMES}
    if name.lower() in presets:
        specs = ob.preset(presets[name.lower()])
        return Scheme(presets[name.lower()], specs["weight"], None if weights_only else specs["input"])
    return Scheme(name, _spec_string(name))


def parse_schemes(text: str, weights_only: bool = False) -> list[Scheme]:
    """``--schemes``: comma-separated schemes, each once."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("--schemes is empty: name at least one scheme, e.g. NVFP4,W4A16,FP8,none")
    schemes = [parse_scheme(name, weights_only) for name in names]
    seen = [scheme.name for scheme in schemes]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if twice:
        raise ValueError(f"--schemes names {', '.join(twice)} twice")
    if all(scheme.dense for scheme in schemes):
        raise ValueError("--schemes has nothing to quantize with: add a scheme besides 'none'")
    return schemes


def _spec_string(text: str) -> ob.QuantSpec:
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise ValueError(_unknown(text))
    fields: dict = {"dtype": parts[0]}
    if len(parts) >= 2:
        fields["strategy"] = parts[1]
    if len(parts) == 3:
        size = parts[2].lower()
        if re.fullmatch(r"\d+x\d+", size):
            fields["block_size"] = tuple(int(v) for v in size.split("x"))
        elif size.isdigit():
            fields["group_size"] = int(size)
        else:
            raise ValueError(f"scheme {text!r}: the size must be a group size (128) or a block (128x128)")
    try:
        spec = ob.QuantSpec(**fields)
        spec.check_kind("weight")
    except ValueError as err:
        if parts[0] not in ob.FORMATS:
            raise ValueError(_unknown(text)) from None
        raise ValueError(f"scheme {text!r}: {err}") from None
    return spec


def _unknown(text: str) -> str:
    return (
        f"unknown scheme {text!r}: use a preset ({', '.join(ob.PRESET_NAMES)}), 'none', or a weight spec "
        "DTYPE[:STRATEGY[:SIZE]] such as int4:group:64"
    )


@dataclass(frozen=True)
class Budget:
    """A size budget as written: average bits per weight over the chosen layers, or the whole
    checkpoint's bytes."""

    text: str
    bits_per_weight: float | None = None
    checkpoint_bytes: int | None = None

    def layer_bytes(self, weights: int, rest_bytes: int) -> int:
        """The bytes the chosen layers may take: ``weights`` elements at the average bits, or the
        checkpoint's size less ``rest_bytes``, what it stores beside the chosen layers."""
        if self.bits_per_weight is not None:
            return int(self.bits_per_weight * weights // 8)
        return int(self.checkpoint_bytes) - rest_bytes

    @property
    def unit(self) -> str:
        return "bits per weight" if self.bits_per_weight is not None else "bytes"


def parse_budget(text: str) -> Budget:
    """``4.8`` or ``4.8bits`` (bits per weight), or a size such as ``3.2GB``."""
    plain = text.strip().lower().removesuffix("bits").removesuffix("bit").strip()
    try:
        bits = float(plain)
    except ValueError:
        bits = None
    if bits is not None:
        if not 0 < bits <= 64:
            raise ValueError(f"budget {text!r}: bits per weight must be above 0 and at most 64")
        return Budget(text.strip(), bits_per_weight=bits)
    try:
        return Budget(text.strip(), checkpoint_bytes=parse_bytes(text))
    except ValueError:
        raise ValueError(f"budget {text!r} is neither bits per weight (4.8) nor a size (3.2GB, 900MiB)") from None


def parse_budgets(budget: str | None, budgets: str | None) -> tuple[Budget | None, list[Budget]]:
    """``--budget`` and ``--budgets``: the budget the exports take (``--budget``, else the largest
    of ``--budgets``) and every budget the frontier measures, in increasing order, all in one unit."""
    sweep = [parse_budget(part) for part in (budgets or "").split(",") if part.strip()]
    single = None if budget is None else parse_budget(budget)
    every = sweep + ([] if single is None else [single])
    if not every:
        raise ValueError("give a --budget (4.8 bits per weight, or 3.2GB) or --budgets 4.5,5,6")
    units = {b.unit for b in every}
    if len(units) > 1:
        written = ", ".join(b.text for b in every)
        raise ValueError(f"the budgets {written} mix bits per weight and sizes: give them all in one unit")
    ordered = sorted({_amount(b): b for b in every}.values(), key=_amount)
    return single or ordered[-1], ordered


def _amount(budget: Budget) -> float:
    return budget.bits_per_weight if budget.bits_per_weight is not None else float(budget.checkpoint_bytes)


def describe(schemes: Sequence[Scheme]) -> str:
    """The schemes as one line (``NVFP4 (weight nvfp4, input nvfp4 dynamic), none (dense)``)."""
    parts = []
    for scheme in schemes:
        if scheme.dense:
            parts.append(f"{scheme.name} (dense)")
            continue
        inputs = "" if scheme.input is None else f", input {scheme.input.dtype}"
        parts.append(f"{scheme.name} (weight {scheme.weight.dtype}{inputs})")
    return ", ".join(parts)
