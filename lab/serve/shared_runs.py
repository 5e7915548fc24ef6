"""Analyses shared between the sessions of one server: identical runs are computed once, different
heavy runs queue, and recent results stay for the next person within a byte bound.

``SharedRuns.run(key, compute, size)``: the first session asking for ``key`` computes it (when a
slot is free: ``slots`` heavy runs at once, first come first served); a session asking for the same
key meanwhile waits for that computation and reads its result; afterwards the result stays in a
least-recently-used cache of at most ``max_bytes``. A waiting session is told, through its
``waiting`` callback, what it waits for ("1 run ahead", or the other session's progress).

A leader that stops before its result exists (the person left, Streamlit stopped the script) leaves
no result behind: the sessions waiting on it start over, and one of them computes. An ordinary
error (bad input, out of memory) is the result's error: every session that waited gets it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

POLL_SECONDS = 0.5
"""How often a waiting session is told again what it waits for (and may be stopped by its page)."""

Waiting = Callable[[str], None]
Tell = Callable[[str], None]


@dataclass(eq=False)
class _Flight:
    """One computation under way: its result or error once ``done`` is set, and the leader's last
    progress line for the sessions that wait on it."""

    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: Exception | None = None
    abandoned: bool = False
    progress: str = ""


@dataclass(frozen=True)
class Counts:
    """What the server did with the runs asked of it: ``computed`` (by a leader), ``joined`` (read a
    computation another session started), ``cached`` (read a finished result), and how many results
    and bytes the cache holds."""

    computed: int
    joined: int
    cached: int
    kept: int
    kept_bytes: int


class SharedRuns:
    """The server's one queue and cache of runs (see the module docstring)."""

    def __init__(self, max_bytes: int, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.max_bytes = int(max_bytes)
        self.slots = slots
        self._cond = threading.Condition()
        self._kept: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self._queue: list[object] = []
        """Who waits for a slot, in arrival order: a run's ``_Flight``, or a ``slot`` token."""
        self._running = 0
        self._computed = self._joined = self._cached = 0

    def counts(self) -> Counts:
        with self._cond:
            held = sum(size for _, size in self._kept.values())
            return Counts(self._computed, self._joined, self._cached, len(self._kept), held)

    def run(
        self,
        key: str,
        compute: Callable[[Tell], Any],
        size: Callable[[Any], int],
        waiting: Waiting | None = None,
    ) -> tuple[Any, str]:
        """The result for ``key`` and how it was had: ``"computed"``, ``"joined"`` or ``"cached"``.

        ``compute(tell)`` makes the result (``tell(line)`` shows its progress to the sessions
        waiting on it); ``size(result)`` is its bytes, for the cache's bound; ``waiting(line)`` is
        called while this session waits, about every ``POLL_SECONDS``."""
        waiting = waiting or (lambda line: None)
        while True:
            with self._cond:
                if key in self._kept:
                    self._kept.move_to_end(key)
                    self._cached += 1
                    return self._kept[key][0], "cached"
                flight = self._flights.get(key)
                leader = flight is None
                if leader:
                    flight = self._flights[key] = _Flight()
                    self._queue.append(flight)
            if leader:
                return self._lead(key, flight, compute, size, waiting), "computed"
            while not flight.done.wait(POLL_SECONDS):
                waiting(f"waiting for the same run, which another session is computing ({flight.progress or 'queued'})")
            if flight.abandoned:
                continue
            if flight.error is not None:
                raise flight.error
            with self._cond:
                self._joined += 1
            return flight.value, "joined"

    @contextmanager
    def slot(self, waiting: Waiting | None = None) -> Iterator[None]:
        """Hold one of the ``slots`` for heavy work that is not shared (an evaluation, a checkpoint
        write): it queues with the runs, first come first served."""
        token = object()
        with self._cond:
            self._queue.append(token)
        started = False
        try:
            self._acquire(token, waiting or (lambda line: None), lambda line: None)
            started = True
            yield
        finally:
            self._release(token, started)

    def _acquire(self, token: object, waiting: Waiting, queued: Tell) -> None:
        """Wait until ``token`` heads the queue and a slot is free, then take the slot."""
        while True:
            with self._cond:
                if self._queue[0] is token and self._running < self.slots:
                    self._queue.pop(0)
                    self._running += 1
                    return
                self._cond.wait(POLL_SECONDS)
                ahead = self._running + self._queue.index(token)
            line = f"{ahead} run{'s' if ahead != 1 else ''} ahead"
            queued(f"queued behind {line}")
            waiting(f"waiting for {line}")

    def _release(self, token: object, started: bool) -> None:
        """Give the slot back (or leave the queue, when it never started) and wake the others."""
        with self._cond:
            if started:
                self._running -= 1
            elif token in self._queue:
                self._queue.remove(token)
            self._cond.notify_all()

    def _lead(self, key: str, flight: _Flight, compute: Callable[[Tell], Any], size, waiting: Waiting) -> Any:
        """Wait for a slot, compute, keep the result, wake the sessions waiting on it."""
        started, nbytes = False, 0

        def tell(line: str) -> None:
            flight.progress = line

        try:
            self._acquire(flight, waiting, tell)
            started = True
            flight.value = compute(tell)
            nbytes = size(flight.value)
        except Exception as err:
            flight.error = err
            raise
        except BaseException:
            flight.abandoned = True
            raise
        finally:
            self._release(flight, started)
            with self._cond:
                del self._flights[key]
                if flight.error is None and not flight.abandoned:
                    self._computed += 1
                    self._keep(key, flight.value, nbytes)
            flight.done.set()
        return flight.value

    def _keep(self, key: str, value: Any, nbytes: int) -> None:
        """Cache ``value`` (under the lock), dropping the least recently used past ``max_bytes``; a
        result larger than the whole bound is not kept."""
        if nbytes > self.max_bytes:
            return
        self._kept[key] = (value, nbytes)
        total = sum(size for _, size in self._kept.values())
        while total > self.max_bytes:
            _, (_, dropped) = self._kept.popitem(last=False)
            total -= dropped

    def clear(self) -> None:
        """Forget every kept result (runs under way finish and are kept as usual)."""
        with self._cond:
            self._kept.clear()


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors ``value`` holds (through dataclasses, lists, tuples and dicts), each
    storage counted once: what a kept result costs the server, for the cache's bound."""
    import dataclasses

    import torch

    seen: set[int] = set()
    total, stack = 0, [value]
    visited: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total
