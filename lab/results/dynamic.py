"""Dynamic activations in the app: how far each observer's static scales are from the run-time ones.

With ``QuantSpec(dynamic=True)`` a runtime computes every token's (or token group's) range on the
fly, so a static range is only a summary of calibration. ``dynamic_summary`` puts the run-time
scales (``ob.dynamic_qparams`` on the calibration tokens) and each observer's static scales side
by side: scale percentiles, spread, how many run-time scales exceed the static one (those tokens
would clip with it) and the SQNR of quantizing with each. No streamlit here; pages draw it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

import observers as ob
from observers.suite import SuiteResult

DYNAMIC_LABEL = "run time (dynamic min-max)"
ACTIVATION_TENSORS = ("input", "output")
PERCENTILES = (1, 50, 99)


def dynamic_applies(entry) -> bool:
    """True for an activation tensor (``input``/``output``) of a dynamic spec that saw tokens:
    the cases where run-time scales exist to compare with."""
    return entry.spec.dynamic and entry.tensor in ACTIVATION_TENSORS and entry.data.numel() > 0


def effective_scales(qp: ob.QParams) -> np.ndarray:
    """Every step size of ``qp`` (``scale / global_scale`` for NVFP4) as a flat array: the fp32
    values held as float64, so percentiles and ratios of them are computed without rounding."""
    return qp.effective_scale.detach().to(torch.float32).flatten().cpu().numpy().astype(np.float64)


def static_on_runtime_grid(static: torch.Tensor, runtime: torch.Tensor) -> torch.Tensor | None:
    """A static scale tensor shaped to broadcast against the run-time ones: per-tensor ``(1,)``
    and per-group ``(G,)`` become one row ``(1, ·)`` shared by every token; per-token
    ``(tokens, 1)`` stays. None when they do not correspond (e.g. per-token qparams of other tokens)."""
    aligned = static.reshape(1, -1) if static.ndim == 1 else static
    try:
        torch.broadcast_shapes(aligned.shape, runtime.shape)
    except RuntimeError:
        return None
    return aligned


def _row(label: str, scales: np.ndarray, metrics: dict, runtime_p50: float, above: float | None) -> dict:
    p1, p50, p99 = np.percentile(scales, PERCENTILES)
    clip = metrics.get("clip_ratio")
    return {
        "scales from": label,
        "scales": scales.size,
        "scale p1": float(p1),
        "scale p50": float(p50),
        "scale p99": float(p99),
        "max/min": float(scales.max() / scales.min()),
        "p50 / run-time p50": float(p50 / runtime_p50),
        "run-time scales above it %": above,
        "clipped %": None if clip is None else 100 * clip,
        "SQNR dB": metrics.get("sqnr_db"),
    }


def dynamic_summary(entry, results: Sequence[SuiteResult] | None = None) -> pd.DataFrame:
    """For ``entry`` (a ``lab.analyse.analysis.TensorAnalysis``): one row for the run-time scales
    (``ob.dynamic_error_metrics`` on the calibration tokens), then one per observer (``results``,
    default all of the entry's) with static qparams: scale p1/p50/p99, max/min ratio, the static
    p50 over the run-time p50, the share of run-time scales above the static scale of the same
    group (those tokens' ranges exceed it, so they clip), clipped share and SQNR of quantizing
    with it."""
    runtime_qp, runtime_metrics = ob.dynamic_error_metrics(entry.data, entry.spec)
    runtime = runtime_qp.effective_scale.float()
    runtime_scales = effective_scales(runtime_qp)
    runtime_p50 = float(np.percentile(runtime_scales, 50))
    rows = [_row(DYNAMIC_LABEL, runtime_scales, runtime_metrics, runtime_p50, None)]
    for r in entry.results if results is None else results:
        if r.error is not None or r.qparams is None:
            continue
        static = static_on_runtime_grid(r.qparams.effective_scale.float().to(runtime.device), runtime)
        above = None if static is None else 100 * float((runtime > static).float().mean())
        rows.append(_row(r.name, effective_scales(r.qparams), r.metrics, runtime_p50, above))
    return pd.DataFrame(rows)
