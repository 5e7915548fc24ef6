"""The calibration stream: observers fed batch by batch from the capture hooks.

``analyse`` plans one ``Observation`` per (activation tensor, observer) whose result its cache does
not hold and hands an ``ObserverStream`` to ``Model.capture`` / ``capture_kv`` as their ``stream``.
Each calibration batch then updates every observation as the references calibrate (a moving
average sees the batches as they come, a memoryless observer keeps the last one), and the
statistics the weight observers take from a layer's inputs (``INPUT_STATISTICS``) are summed over
every token. Nothing the hooks hand over is kept: memory is the observers' state and one batch.
When every batch has gone through, ``Observation.result`` gives the ``SuiteResult``: qparams from
the statistics of every token, error metrics on the bounded sample of tokens the capture keeps.

With ranks that split the batches every rank makes the same calls (the capture pads a rank out of
batches with empty ones) and each observation merges across them (``observers.shared``); the ranks
first agree on each tensor's token count, so a tensor no rank saw in a batch is skipped by all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import observers as ob
from observers.shared import Op, Reduce
from observers.suite import SuiteResult, finish
from sample_models.capture import Key

View = Callable[[Key, torch.Tensor], torch.Tensor]
"""What a tensor looks like to its observers (a transform's view); identity when no transform."""


def token_axis(key: Key) -> int:
    """The token axis of a streamed tensor: rows of an activation, dim 2 of key/value states."""
    return 2 if key[1] in ("k", "v") else 0


@dataclass
class Observation:
    """One observer on one streamed tensor: its state while the batches go through, then its result.

    ``name`` is the result's name (an observer, or ``"<tool>: <observer>"``); ``cache_key`` is
    where ``analyse`` keeps the result."""

    name: str
    observer: str
    spec: ob.QuantSpec
    kind: str
    knobs: dict[str, Any]
    cache_key: str
    state: ob.Observer | None = None
    error: str | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        try:
            self.state = ob.create(self.observer, self.spec, kind=self.kind, **self.knobs)
        except ValueError as err:
            self.error = str(err)

    def observe(self, data: torch.Tensor, across: Reduce | None) -> None:
        if self.state is None:
            return
        start = time.perf_counter()
        try:
            self.state.observe(data, across=across)
        except ValueError as err:  # with ``across`` every rank raises it together (observers.shared)
            self.state, self.error = None, str(err)
        self.seconds += time.perf_counter() - start

    def result(self, sample: torch.Tensor, across: Reduce | None) -> SuiteResult:
        """The observer's qparams over every streamed token; metrics on ``sample``."""
        if self.error is None and (self.state is None or self.state.num_observed_tokens == 0):
            self.error = "saw no calibration tokens"
        if self.error is not None:
            return SuiteResult(self.name, None, {}, 0.0, dict(self.knobs), 0, self.error)
        return replace(finish(self.state, sample, across, self.seconds, self.knobs), name=self.name)


ADDED_BYTES = 64 << 20
"""fp64 bytes of a batch's statistic added into its sum at once: torch adds an fp32 tensor into an
fp64 one through an fp64 copy of the whole of it, which for an 11008-wide Hessian is 969 MB."""


class MeanStatistic:
    """The mean over every streamed token of ``fn(rows)`` (a mean over rows itself): sums of
    ``fn(rows) · len(rows)`` in fp64, merged across ranks once at the end."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.total: torch.Tensor | None = None
        self.count = 0
        self.features = 0
        self._mean: torch.Tensor | None = None
        self._settled = False

    def add(self, rows: torch.Tensor) -> None:
        self.features = rows.shape[-1]
        if rows.shape[0] == 0:
            return
        value = self.fn(rows)
        if self.total is None:  # zeros plus the first batch: no fp64 copy of it beside the sum
            self.total = torch.zeros_like(value, dtype=torch.float64)
        _add_in_slices(self.total, value, rows.shape[0])
        self.count += rows.shape[0]

    def value(self, across: Reduce | None, device: torch.device) -> torch.Tensor | None:
        """The mean (fp32), or None when no rank saw a token; raises ``ValueError`` from ``fn``.
        Asked once the stream is over: made the first time (the fp64 sum divided in place, then let
        go: a Hessian's sum is twice its mean's bytes), the same tensor after that (the layers a
        statistic stands for, q, k and v reading one input, share their mean)."""
        if not self._settled:
            self._mean = self._mean_of(across, device)
            self.total, self._settled = None, True
        return self._mean

    def _mean_of(self, across: Reduce | None, device: torch.device) -> torch.Tensor | None:
        total, count = self.total, self.count
        if across is not None:
            if total is None:
                total = torch.zeros_like(self.fn(torch.zeros(1, self.features, device=device)), dtype=torch.float64)
            total = across(total, Op.SUM)
            count = int(across(torch.tensor([count], device=device), Op.SUM))
        return None if count == 0 else total.div_(count).float()


def _add_in_slices(total: torch.Tensor, value: torch.Tensor, weight: int) -> None:
    """``total += weight · value`` in place, ``ADDED_BYTES`` of ``total`` at a time (whole rows):
    the same sums as one ``add_``, without its fp64 copy of the whole ``value``."""
    if total.ndim == 0:
        total.add_(value, alpha=weight)
        return
    step = max(1, ADDED_BYTES // max(1, total[0].numel() * total.element_size()))
    for start in range(0, total.shape[0], step):
        total[start : start + step].add_(value[start : start + step], alpha=weight)


class ChannelMax:
    """``max |x|`` per channel over every streamed token (SmoothQuant's activation statistic)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def add(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        found = rows.reshape(-1, rows.shape[-1]).float().abs().amax(dim=0)
        self.value = found if self.value is None else torch.maximum(self.value, found)


Statistic = MeanStatistic | ChannelMax


@dataclass
class ObserverStream:
    """The ``sample_models.capture.Stream`` of one analysis: each batch's rows of each key go,
    through ``view``, to the key's observations and statistics.

    ``empty``: each key's shape with no tokens, for a rank whose part of a batch is empty.
    Without ranks, keys fed the very same tensor (q, k and v read one hidden state) are observed
    once: ``same`` maps a key to the earlier key whose observations stand for it."""

    observations: dict[Key, list[Observation]]
    statistics: dict[Key, list[Statistic]]
    empty: dict[Key, tuple[int, ...]]
    view: View | None = None
    across: Reduce | None = None
    same: dict[Key, Key] = field(default_factory=dict)
    batches: int = 0

    def __call__(self, keys: list[Key], rows: dict[Key, torch.Tensor]) -> None:
        self.batches += 1
        wanted = [key for key in keys if self.observations.get(key) or self.statistics.get(key)]
        if self.across is not None:
            counts = [rows[key].shape[token_axis(key)] if key in rows else 0 for key in wanted]
            device = next((t.device for t in rows.values()), torch.device("cpu"))
            totals = self.across(torch.tensor(counts or [0], device=device), Op.SUM).tolist()
            wanted = [key for key, total in zip(wanted, totals, strict=False) if total]
        else:
            wanted = [key for key in wanted if key in rows]
        seen: dict[int, Key] = {}
        for key in wanted:
            data = rows.get(key)
            if data is None:
                device = next(iter(rows.values())).device if rows else torch.device("cpu")
                data = torch.zeros(self.empty[key], device=device)
            if self._stands_in(key, data, seen):
                continue
            seen.setdefault(id(data), key)
            if self.view is not None:
                data = self.view(key, data)
            for observation in self.observations.get(key, ()):
                observation.observe(data, self.across)
            for statistic in self.statistics.get(key, ()):
                statistic.add(data)

    def _stands_in(self, key: Key, data: torch.Tensor, seen: dict[int, Key]) -> bool:
        """Whether an earlier key of this batch, fed this very tensor, already observed for ``key``.
        Decided on the first batch and held to after it: a key whose tensor stops being its
        earlier key's would have missed batches, so its observations fail instead."""
        if self.across is not None:
            return False
        earlier = seen.get(id(data))
        if self.batches == 1 and earlier is not None and self._alike(key, earlier):
            self.same[key] = earlier
        if key not in self.same:
            return False
        if earlier == self.same[key]:
            return True
        for observation in self.observations.get(key, ()):
            observation.state, observation.error = None, f"stopped being the same tensor as {self.same[key][0]}"
        del self.same[key]
        return False

    def _alike(self, key: Key, earlier: Key) -> bool:
        """``earlier``'s observations and statistics can stand for ``key``'s: the same observers,
        and statistics of the same kinds (``statistics_of`` then answers with ``earlier``'s)."""
        names = [(o.name, o.spec, o.kind, o.knobs) for o in self.observations.get(key, ())]
        kinds = [type(s) for s in self.statistics.get(key, ())]
        return names == [(o.name, o.spec, o.kind, o.knobs) for o in self.observations.get(earlier, ())] and kinds == [
            type(s) for s in self.statistics.get(earlier, ())
        ]

    def stand_in(self, key: Key) -> Key:
        """The key whose observations and statistics stand for ``key``'s (itself, mostly)."""
        return self.same.get(key, key)
