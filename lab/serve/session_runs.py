"""A session's run as the server shares it: what makes two sessions' runs the same computation
(``SessionRun.key``) and the analyses a run makes (``SessionRun.compute``), which every session
asking for that key reads (``lab.serve.shared_runs``)."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from lab.analyse.analysis import Analysis
from lab.analyse.model_facts import source_stamp
from lab.analyse.pipeline import analyse
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from lab.calibrate.capture_memo import CapturingModel
from lab.history.index import RunRecord
from lab.history.run_file import KeptRun
from sample_models.capture import BlockTap

ProgressFn = Callable[[int, int, str], None]
Keep = Callable[[KeptRun], RunRecord]
"""Keeps a computed run in the team's history (``lab.history.store.History.record``, bound to who asked)."""


@dataclass(frozen=True)
class ComputedRun:
    """A run's analyses (read-only once made, as sessions share them): as asked, through the
    transform, calibrated on the float model when propagation was asked; the run's notes, the
    result-cache hits and misses of the session that computed it, and the run as its history keeps
    it (``kept``; None when it was not kept)."""

    analysis: Analysis
    transformed: Analysis | None
    unpropagated: Analysis | None
    notes: tuple[str, ...]
    hits: int
    misses: int
    kept: RunRecord | None = None


@dataclass(frozen=True)
class SessionRun:
    """One press of Run: the model, layers, settings and attention blocks, with the session's own
    result cache and capture memo (so a session changing one knob recomputes one observer), and a
    stage riding the analysis's calibration pass (``tap``: the Run page's AWQ; it rides only a run
    this session computes)."""

    model: Any
    layers: list[str]
    config: RunConfig
    attention: Sequence[str]
    cache: ResultCache
    capture_memo: dict[str, Any]
    tap: BlockTap | None = None

    def key(self) -> str:
        """The same for two runs exactly when they compute the same: the model (its weight files'
        paths, sizes and modification times, dtype, device), the layers and attention blocks, the
        settings (specs, observers, knobs, transform, tools, propagation), the calibration set's
        fingerprint and how it is captured, and what a riding stage changes in the pass."""
        payload = {
            "model": source_stamp(self.model),
            "dtype": str(getattr(self.model, "dtype", "")),
            "device": str(getattr(self.model, "device", "")),
            "layers": self.layers,
            "attention": list(self.attention),
            "config": self.config.to_dict(),
            "calibration": self.config.calibration_key(),
            "capture": [self.config.sequential, self.config.max_memory],
            "tap": "" if self.tap is None else self.tap.key,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    def compute(self, progress: ProgressFn | None = None) -> ComputedRun:
        """The run's analyses; capture warnings (tokens subsampled under the memory cap) become notes."""
        cache, config = self.cache, self.config
        hits, misses = cache.hits, cache.misses
        wrapped = CapturingModel(self.model, self.capture_memo)
        run = partial(analyse, wrapped, self.layers, progress=progress, cache=cache, attention=self.attention)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            analysis = run(replace(config, transform=None), tap=self.tap)
            transformed = None if config.transform is None else run(config)
            unpropagated = run(replace(config, transform=None, propagate=False)) if config.propagate else None
        notes = (
            list(analysis.warnings)
            + list(transformed.warnings if transformed else [])
            + sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)})
        )
        counts = (cache.hits - hits, cache.misses - misses)
        return ComputedRun(analysis, transformed, unpropagated, tuple(dict.fromkeys(notes)), *counts)

    def sharing(
        self, progress: ProgressFn | None, keep: Keep | None = None, request: dict[str, Any] | None = None
    ) -> Callable[[Callable[[str], None]], ComputedRun]:
        """``compute`` as ``SharedRuns.run`` calls it: its progress also told to the waiting sessions,
        and the result kept by ``keep`` (with ``request``, how to open the model again), so every
        session that reads it reads the one record of who asked first."""

        def compute(tell: Callable[[str], None]) -> ComputedRun:
            def told(done: int, total: int, label: str) -> None:
                tell(f"{done}/{total} steps · {label}")
                if progress is not None:
                    progress(done, total, label)

            computed = self.compute(told)
            return computed if keep is None else kept(computed, keep, request or {})

        return compute


def kept(computed: ComputedRun, keep: Keep, request: dict[str, Any]) -> ComputedRun:
    """``computed`` with its history record; a run the history cannot take (a full disk, an output
    root it may not write) is still shown, with a note saying it was not kept."""
    run = KeptRun(computed.analysis, computed.transformed, computed.unpropagated, request)
    try:
        return replace(computed, kept=keep(run))
    except (OSError, ValueError) as err:
        return replace(computed, notes=(*computed.notes, f"This run was not kept in the team's history: {err}"))


def how_had(shared: str, hits: int, misses: int) -> str:
    """How a run's results were had, in a few words (the Run page and its status box say it)."""
    if shared == "joined":
        return "shared the run another session was computing"
    if shared == "cached":
        return "read from the server's recent results: the same run was computed before"
    if shared == "kept":
        return "opened from the team's run history: nothing recomputed"
    return f"{misses} computed, {hits} reused from cache"
