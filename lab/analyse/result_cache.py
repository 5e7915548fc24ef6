"""The result cache: a ``SuiteResult`` per (tensor, spec, observer, knobs, calibration), so a
re-run after one knob changes recomputes only that observer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import observers as ob
from observers.suite import SuiteResult


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

    def peek(self, key: str) -> SuiteResult | None:
        """The result stored under ``key`` (a hit), else None: the caller computes it (or takes it
        from an identical tensor) and keeps it with ``store``, which counts it."""
        found = self._store.get(key)
        if found is not None:
            self.hits += 1
        return found

    def store(self, key: str, result: SuiteResult, computed: bool = True) -> SuiteResult:
        """Keep ``result`` under ``key`` after a ``peek`` that found nothing: a miss when it was
        ``computed``, a hit when it is the result of an identical tensor observed once."""
        self._store[key] = result
        if computed:
            self.misses += 1
        else:
            self.hits += 1
        return result

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
