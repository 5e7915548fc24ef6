"""Scaling curve: the main observers and fake-quant from 1M to 64M elements (0.25M and 1M with
``--quick``). Cost per element should stay flat (linear work) and the multiple of the floor should
not grow; the agreement column gives nanoseconds per element."""

from __future__ import annotations

import torch

import observers as ob
from bench.common import SETTINGS, measure, observe

GROUP = ob.QuantSpec("int4", strategy="group", group_size=128)
UINT8 = ob.QuantSpec("uint8", symmetric=False)


def sizes() -> tuple[float, ...]:
    """Millions of elements per step."""
    return (0.25, 1) if SETTINGS.quick else (1, 4, 16, 64)


def _size_rows(millions: float, device: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(int(millions * 1024), 1024, generator=g).to(device)
    qp = observe("memoryless_minmax", w, GROUP)
    steps = {
        "memoryless_minmax int4 g128": (lambda: observe("memoryless_minmax", w, GROUP), w.sum),
        "mse_grid int4 g128": (lambda: observe("mse_grid", w, GROUP), w.clone),
        "histogram uint8 (activation)": (lambda: observe("histogram", w, UINT8, kind="activation"), w.sum),
        "fake_quantize int4 g128": (lambda: ob.fake_quantize(w, qp, GROUP), w.clone),
    }
    rows = []
    for label, (fn, floor) in steps.items():
        row = measure(f"scaling {label} {millions:g}M elements", fn, floor, device)[0]
        row["agreement"] = f"{row['ours_s'] / w.numel() * 1e9:.2f} ns/element"
        rows.append(row)
    return rows


def cases(device: str = "cpu") -> list[dict]:
    rows = [row for millions in sizes() for row in _size_rows(millions, device)]
    return sorted(rows, key=lambda r: r["case"].split(" ")[1])
