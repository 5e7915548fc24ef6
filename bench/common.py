"""Timing and test-tensor helpers shared by the benchmark modules."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], object], device: str | torch.device = "cpu", repeats: int = 5, warmup: int = 1
) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs, synchronized on CUDA."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llm_weight(rows: int, cols: int, device: str = "cpu", seed: int = 0, outlier_channels: int = 8) -> torch.Tensor:
    """A synthetic LLM-shaped weight: Gaussian, a few input channels ×20 (outlier channels) and
    heavy-tailed rows (Student-t), like the weights of real decoder layers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    channels = torch.randperm(cols, generator=g)[:outlier_channels]
    w[:, channels] *= 20
    heavy_rows = torch.randperm(rows, generator=g)[: max(1, rows // 64)]
    w[heavy_rows] = torch.distributions.StudentT(3.0).sample((len(heavy_rows), cols)) * 0.02
    return w.to(device)


def activation_batches(
    batches: int, tokens: int, hidden: int, device: str = "cpu", seed: int = 0, growth: float = 1.0
) -> list[torch.Tensor]:
    """Calibration-like activations with massive-activation channels; ``growth`` > 1 makes each
    batch's range larger than the last (the case where running histograms must re-bin)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batches):
        x = torch.randn(tokens, hidden, generator=g)
        x[:, :4] *= 30
        out.append((x * growth**i).to(device))
    return out


def case(
    name: str,
    ours_s: float,
    reference_s: float | None = None,
    reference: str = "",
    floor_s: float | None = None,
    agreement: str = "",
) -> dict:
    """One row of the benchmark table."""
    return {
        "case": name,
        "ours_s": ours_s,
        "reference_s": reference_s,
        "reference": reference,
        "floor_s": floor_s,
        "agreement": agreement,
    }
