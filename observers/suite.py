"""Run many observers on one tensor and collect comparable results.

This is the call the app and the CLI make per layer and tensor kind; an observer that cannot
handle the spec or kind gives a result with ``error`` set instead of stopping the suite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from observers.base import Observer, available, create
from observers.metrics import quantization_metrics
from observers.qparams import QParams
from observers.shared import Reduce, agree, gather_tokens
from observers.spec import QuantSpec


@dataclass
class SuiteResult:
    """One observer's outcome on one tensor. ``error`` is set (and the rest empty) when the
    observer does not apply to the spec/kind or failed on this input."""

    name: str
    qparams: QParams | None
    metrics: dict[str, float | None]
    seconds: float
    knobs: dict[str, Any] = field(default_factory=dict)
    num_observed_tokens: int = 0
    error: str | None = None


def _batches(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    batches = list(x)
    if not batches or not all(isinstance(b, torch.Tensor) for b in batches):
        raise ValueError("run_suite needs a tensor or a non-empty sequence of tensors")
    return batches


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(
    name: str,
    x: torch.Tensor | Sequence[torch.Tensor],
    spec: QuantSpec,
    kind: str = "weight",
    g_idx: torch.Tensor | None = None,
    across: Reduce | None = None,
    **knobs: Any,
) -> SuiteResult:
    """Observe every batch of ``x`` with observer ``name``, then fake-quantize and measure.

    Metrics are computed on the concatenation of the batches (for weights: the weight).
    ``seconds`` times observe + qparams only, synchronized on CUDA.
    ``across``: ``x`` is this rank's part of batches split between processes; every rank calls
    ``run_one`` in lockstep and gets the result of the whole (``observers.shared``), per-token
    qparams in rank order.
    """
    batches = _batches(x)
    try:
        observer = create(name, spec, kind=kind, **knobs)
        _synchronize(batches[0].device)
        start = time.perf_counter()
        for batch in batches:
            observer.observe(batch, g_idx=g_idx, across=across)
        _synchronize(batches[0].device)
        seconds = time.perf_counter() - start
    except ValueError as exc:
        if across is not None:  # every rank, failed or not, learns whether any rank failed
            try:
                agree(exc, across, batches[0].device)
            except ValueError as agreed:
                exc = agreed
        return SuiteResult(name, None, {}, 0.0, dict(knobs), 0, str(exc))
    reference = batches[-1] if spec.strategy == "token" else _concat(batches, kind)
    return finish(observer, reference, across, seconds, knobs)


def finish(
    observer: Observer,
    reference: torch.Tensor,
    across: Reduce | None = None,
    seconds: float = 0.0,
    knobs: dict[str, Any] | None = None,
) -> SuiteResult:
    """The result of an observer that has seen its batches: its qparams (``seconds`` is the time
    it took to observe; computing the qparams is added) and the error metrics of those qparams on
    ``reference`` (the tensor, or a sample of the tokens that were streamed through it; an empty
    reference gives no metrics). With ``across`` every rank calls it in lockstep."""
    device = reference.device
    try:
        start = time.perf_counter()
        qp, error = observer.qparams(), None
        _synchronize(device)
        seconds += time.perf_counter() - start
    except ValueError as exc:
        qp, error = None, exc
    if across is not None:  # every rank, failed or not, learns whether any rank failed
        try:
            agree(error, across, device)
        except ValueError as exc:
            error = exc
    if error is not None:
        return SuiteResult(observer.name, None, {}, 0.0, dict(knobs or {}), 0, str(error))
    spec = observer.spec
    metrics = quantization_metrics(reference, qp, spec, across) if across or reference.numel() else {}
    if across is not None and spec.strategy == "token":
        qp = gather_tokens(qp, across)
    return SuiteResult(observer.name, qp, metrics, seconds, observer.config, observer.num_observed_tokens)


def _concat(batches: list[torch.Tensor], kind: str) -> torch.Tensor:
    if len(batches) == 1:
        return batches[0]
    if kind == "attention":
        return torch.cat(batches, dim=0)
    return torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], dim=0)


def run_suite(
    x: torch.Tensor | Sequence[torch.Tensor],
    spec: QuantSpec,
    names: Sequence[str] | None = None,
    kind: str = "weight",
    knobs: dict[str, dict[str, Any]] | None = None,
    g_idx: torch.Tensor | None = None,
) -> list[SuiteResult]:
    """Every registered observer (or ``names``) on ``x`` (a tensor or a list of batches).

    ``knobs`` maps an observer name to its knob overrides.
    """
    spec.check_kind(kind)
    names = list(available()) if names is None else list(names)
    knobs = knobs or {}
    unknown = set(knobs) - set(names)
    if unknown:
        raise ValueError(f"knobs given for observer(s) not being run: {', '.join(sorted(unknown))}")
    return [run_one(name, x, spec, kind, g_idx=g_idx, **knobs.get(name, {})) for name in names]


def results_frame(results: Sequence[SuiteResult]):
    """A pandas DataFrame, one row per observer: metrics, seconds, tokens, error."""
    import pandas as pd

    rows = []
    for r in results:
        row = {
            "observer": r.name,
            **r.metrics,
            "seconds": r.seconds,
            "num_observed_tokens": r.num_observed_tokens,
            "error": r.error,
        }
        if r.qparams is not None:
            row["scale_min"] = float(r.qparams.scale.min())
            row["scale_max"] = float(r.qparams.scale.max())
        rows.append(row)
    return pd.DataFrame(rows)
