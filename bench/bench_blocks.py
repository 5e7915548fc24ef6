"""Block formats (MX, NVFP4, BFP16): fake-quant against the clone() floor and reference roundings."""

from __future__ import annotations

import torch

import observers as ob
from bench.common import case, llm_weight, median_seconds


def _observe_qparams(name: str, x: torch.Tensor, spec: ob.QuantSpec, **knobs) -> ob.QParams:
    obs = ob.create(name, spec, kind="weight", **knobs)
    obs.observe(x)
    return obs.qparams()


def _frexp_grid(x: torch.Tensor, exp_bits: int, man_bits: int, max_value: float) -> torch.Tensor:
    """The textbook minifloat rounding (frexp -> step -> round), the previous implementation."""
    _, exponent = torch.frexp(x.abs())
    step = torch.ldexp(torch.ones_like(x), (exponent - 1).clamp(min=2 - 2 ** (exp_bits - 1)) - man_bits)
    return torch.copysign(torch.round(x.abs() / step).mul_(step).clamp_(max=max_value), x)


def _block_scale(qp: ob.QParams, block: int) -> torch.Tensor:
    return qp.effective_scale.repeat_interleave(block, dim=1)


def cases(device: str = "cpu") -> list[dict]:
    w = llm_weight(4096, 4096, device)
    clone = median_seconds(lambda: w.clone(), device)
    floor = median_seconds(lambda: w.sum(), device)
    rows = []

    mxfp4 = ob.QuantSpec("mxfp4")
    qp = _observe_qparams("memoryless_minmax", w, mxfp4)
    scale = _block_scale(qp, 32)
    ours = median_seconds(lambda: ob.fake_quantize(w, qp, mxfp4), device)
    ref_s = median_seconds(lambda: _frexp_grid(w / scale, 2, 1, 6.0) * scale, device)
    same = torch.equal(ob.fake_quantize(w, qp, mxfp4), _frexp_grid(w / scale, 2, 1, 6.0) * scale)
    rows.append(
        case(
            "fake_quantize mxfp4 4096x4096",
            ours,
            ref_s,
            "frexp grid rounding (torch has no FP4)",
            clone,
            f"{'identical' if same else 'differs'}; {ours / clone:.2f}x clone()",
        )
    )

    mxfp8 = ob.QuantSpec("mxfp8_e4m3")
    qp = _observe_qparams("memoryless_minmax", w, mxfp8)
    scale = _block_scale(qp, 32)

    def torch_float8():
        return (w / scale).clamp_(-448, 448).to(torch.float8_e4m3fn).float().mul_(scale)

    ours = median_seconds(lambda: ob.fake_quantize(w, qp, mxfp8), device)
    ref_s = median_seconds(torch_float8, device)
    same = torch.equal(ob.fake_quantize(w, qp, mxfp8), torch_float8())
    rows.append(
        case(
            "fake_quantize mxfp8_e4m3 4096x4096",
            ours,
            ref_s,
            "torch float8_e4m3fn cast",
            clone,
            f"{'identical' if same else 'differs'}; {ours / clone:.2f}x clone()",
        )
    )

    nvfp4 = ob.QuantSpec("nvfp4")
    ours = median_seconds(lambda: _observe_qparams("memoryless_minmax", w, nvfp4), device)
    qp = _observe_qparams("memoryless_minmax", w, nvfp4)
    exact = torch.equal(qp.scale.to(torch.float8_e4m3fn).float(), qp.scale)
    rows.append(
        case(
            "memoryless_minmax nvfp4 qparams 4096x4096",
            ours,
            None,
            "missing: no NVFP4 observer in torch",
            floor,
            f"block scales E4M3-exact: {exact}",
        )
    )
    ours = median_seconds(lambda: ob.fake_quantize(w, qp, nvfp4), device)
    rows.append(case("fake_quantize nvfp4 4096x4096", ours, None, "missing: no FP4 in torch", clone, ""))

    bfp16 = ob.QuantSpec("bfp16")
    qp = _observe_qparams("memoryless_minmax", w, bfp16)
    ours = median_seconds(lambda: ob.fake_quantize(w, qp, bfp16), device)
    rows.append(case("fake_quantize bfp16 4096x4096", ours, None, "missing: no BFP in torch", clone, ""))

    sub = w[:1024].contiguous()
    searched = _observe_qparams("mx_exponent_search", sub, mxfp4, scope=2)
    start = _observe_qparams("memoryless_minmax", sub, mxfp4)
    ours = median_seconds(lambda: _observe_qparams("mx_exponent_search", sub, mxfp4, scope=2), device)
    ratio = float((ob.fake_quantize(sub, searched, mxfp4) - sub).square().sum()) / float(
        (ob.fake_quantize(sub, start, mxfp4) - sub).square().sum()
    )
    rows.append(
        case(
            "mx_exponent_search mxfp4 scope 2 1024x4096",
            ours,
            None,
            "missing: Quark PerBlockMXDiffsObserver not installed",
            median_seconds(lambda: sub.clone(), device),
            f"SSE ratio vs memoryless_minmax {ratio:.3f}",
        )
    )
    return rows
