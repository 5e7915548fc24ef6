"""What one sweep analyses (``Plan``): its layers (those a server fuses with a chosen one added),
the units it writes, what torchrun ranks split (calibration batches or layers), how the units are
chunked into calibration passes without splitting a fused group, and the hash of the settings a
resume must match. ``lab.scale.sweep`` runs a plan."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lab.analyse.model_facts import describe_source
from lab.analyse.run_config import RunConfig
from lab.results import check_metric
from lab.runtime.fusion import fused_groups
from lab.runtime.scales import serving_level, with_fused_members
from lab.scale.distributed import RankSplit
from lab.vocab import DEFAULT_METRIC, TensorKind

LAYERS_PER_CHUNK = 8
"""Layers per chunk when ranks split the layers and activations are captured: each chunk costs one
calibration pass. One process, or ranks that split the batches, analyse every layer in one pass
(its finished blocks written as they come); weight-only sweeps go one layer at a time."""

Unit = tuple[int, str, bool]
"""``(index, name, is_attention_block)``: layers first in model order, then attention blocks."""


@dataclass(frozen=True)
class Plan:
    """What one sweep analyses: ``layers`` (and ``attention`` blocks when ``config`` has a ``kv``
    spec) of ``model``, chosen by ``metric``; ``chunk`` layers at a time (None: the default)."""

    model: Any
    layers: tuple[str, ...]
    config: RunConfig
    attention: tuple[str, ...] = ()
    metric: str = DEFAULT_METRIC
    allow_uncalibrated: bool = False
    chunk: int | None = None
    split: RankSplit | None = None
    added: tuple[str, ...] = field(default=(), init=False)
    """The notes on layers added because a server fuses them with chosen ones (``with_fused_members``)."""

    def __post_init__(self) -> None:
        check_metric(self.metric)
        every = [info.name for info in self.model.layers()] if hasattr(self.model, "layers") else self.layers
        layers, added = with_fused_members(self.layers, every, self.config.specs)
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "added", tuple(added))
        if self.split is not None:
            object.__setattr__(self, "split", RankSplit(self.split))
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"--chunk must be at least 1, got {self.chunk}")
        if not (self.layers or self.attention):
            raise ValueError("choose at least one layer or attention block")

    def units(self) -> list[Unit]:
        named = [(name, False) for name in self.layers] + [(name, True) for name in self.attention]
        return [(index, name, block) for index, (name, block) in enumerate(named)]

    @cached_property
    def groups(self) -> dict[str, int]:
        """Each layer's fused group (``lab.runtime``) at the level the run's scales are shared, by
        index: a group's layers go to one rank and one chunk, since their served figures are
        computed together; every layer is a group of its own when nothing is shared."""
        serving = serving_level(self.config.specs)
        groups = fused_groups(self.layers, serving) if serving is not None else [(n, [n]) for n in self.layers]
        return {layer: index for index, (_, members) in enumerate(groups) for layer in members}

    def group(self, unit: Unit) -> int:
        """The index ``unit`` shares with the layers a server fuses it with (an attention block: its own)."""
        index, name, block = unit
        return len(self.layers) + index if block else self.groups[name]

    @property
    def captures(self) -> bool:
        """Whether the sweep runs calibration passes (activations, or inputs for activation order)."""
        return self.config.actorder or any(kind != TensorKind.WEIGHT for kind in self.config.specs)

    def chunk_size(self, world_size: int = 1) -> int | None:
        """Units per chunk; None: all of them in one calibration pass (the default when the sweep
        captures and the batches are not split by layer), each block written as it finishes."""
        if self.chunk is not None:
            return self.chunk
        if not self.captures:
            return 1
        return None if self.split_for(world_size) == RankSplit.BATCHES or world_size == 1 else LAYERS_PER_CHUNK

    def split_for(self, world_size: int) -> RankSplit:
        """What the ranks divide: the calibration batches when the sweep captures (each rank then
        runs 1/N of every pass) and there are at least as many batches as ranks, else the layers;
        ``split`` overrides (an explicit ``batches`` with too few batches is refused when the
        batches are shared out). One process: layers."""
        if world_size <= 1:
            return RankSplit.LAYERS
        if self.split is not None:
            return self.split
        if not self.captures or self._calibration_batches < world_size:
            return RankSplit.LAYERS
        return RankSplit.BATCHES

    def split_note(self, world_size: int) -> str | None:
        """One line when the default split fell back to layers because the calibration makes
        fewer batches than there are ranks; None otherwise."""
        if world_size <= 1 or self.split is not None or not self.captures:
            return None
        batches = self._calibration_batches
        if batches >= world_size:
            return None
        return (
            f"the calibration set makes {batches} batch(es), fewer than the {world_size} ranks: "
            "the ranks split the layers instead of the batches"
        )

    def calibration_shortfall(self) -> str | None:
        """One line when the calibration set has fewer samples than asked (the sweep goes on)."""
        if not self.captures:
            return None
        options = self.config.capture_options()
        return self.model.calibration_set(options["texts"], options["samples"], options["seq_len"]).shortfall

    @cached_property
    def _calibration_batches(self) -> int:
        options = self.config.capture_options()
        return self.model.calibration_batches(options["texts"], options["samples"], options["seq_len"])

    def settings_hash(self, world_size: int) -> str:
        """Changes exactly when a unit's records could change (the chunk size does not count)."""
        payload = {
            "source": describe_source(self.model),
            "layers": self.layers,
            "attention": self.attention,
            "config": self.config.to_dict(),
            "metric": self.metric,
            "allow_uncalibrated": self.allow_uncalibrated,
            "world_size": world_size,
            "split": self.split_for(world_size),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def chunked(units: list[Unit], size: int | None, group: Callable[[Unit], int]) -> list[list[Unit]]:
    """Consecutive runs of at most ``size`` units (None: no limit), never mixing layers and
    attention blocks, and never splitting a fused group (``group``), which may take a chunk past
    ``size``."""
    chunks: list[list[Unit]] = []
    for unit in units:
        same_kind = chunks and chunks[-1][0][2] == unit[2]
        fits = chunks and (size is None or len(chunks[-1]) < size or group(chunks[-1][-1]) == group(unit))
        if same_kind and fits:
            chunks[-1].append(unit)
        else:
            chunks.append([unit])
    return chunks
