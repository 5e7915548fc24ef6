"""Block formats (MX, NVFP4, BFP16): qparams and fake-quant against Quark, llm-compressor /
compressed-tensors and torch, in this process on the same synthetic LLM weights."""

from __future__ import annotations

import torch

import observers as ob
from bench.common import Ref, elements_agree, llm_weight, measure, observe, ref_or_missing, rows_for, scales_agree
from bench.refs import lc_observer_ref, quark_observer_ref

MXFP4 = ob.QuantSpec("mxfp4")
MXFP4_EVEN = ob.QuantSpec("mxfp4", scale_rounding="even")
MXFP4_CEIL = ob.QuantSpec("mxfp4", scale_rounding="ceil")
NVFP4 = ob.QuantSpec("nvfp4")
NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}


def _frexp_grid(x: torch.Tensor, exp_bits: int, man_bits: int, max_value: float) -> torch.Tensor:
    """The textbook minifloat rounding (frexp -> step -> round), the previous implementation."""
    _, exponent = torch.frexp(x.abs())
    step = torch.ldexp(torch.ones_like(x), (exponent - 1).clamp(min=2 - 2 ** (exp_bits - 1)) - man_bits)
    return torch.copysign(torch.round(x.abs() / step).mul_(step).clamp_(max=max_value), x)


def _block_scale(scale: torch.Tensor, block: int, like: torch.Tensor) -> torch.Tensor:
    return scale.reshape(like.shape[0], -1).repeat_interleave(block, dim=1)


def _mxfp4_sse(w: torch.Tensor, scale: torch.Tensor) -> float:
    """Squared error of MXFP4 fake-quant of ``w`` with per-block ``scale`` (frexp rounding)."""
    full = _block_scale(scale, 32, w)
    return float((_frexp_grid(w / full, 2, 1, 6.0) * full - w).double().square().sum())


def _quark_fake_quant_ref(w: torch.Tensor, qp: ob.QParams) -> Ref:
    """Quark's MX kernel ``scaled_fake_quantize("fp4", ...)`` with our scales, called as Quark's
    PerBlockMXDiffsObserver calls it."""

    def build(kernel):
        from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
        from quark.torch.quantization.utils import calculate_qmin_qmax

        qmin, qmax = calculate_qmin_qmax(Dtype.fp4)
        scale = qp.effective_scale.contiguous()
        zero = torch.zeros_like(scale, dtype=torch.int)
        return lambda: kernel.scaled_fake_quantize(
            Dtype.fp4.value, w, scale, zero, -1, 32, qmin, qmax, RoundType.half_even.value, QSchemeType.per_group.value,
            "None",
        )  # fmt: skip

    return ref_or_missing("Quark scaled_fake_quantize fp4", "quark.torch.kernel", build, elements_agree)


def _mx_cases(w: torch.Tensor, device: str, with_qparams: bool) -> list[dict]:
    shape = "x".join(map(str, w.shape))
    qp = observe("memoryless_minmax", w, MXFP4)
    scale = _block_scale(qp.effective_scale, 32, w)
    rows = measure(
        f"fake_quantize mxfp4 {shape}",
        lambda: ob.fake_quantize(w, qp, MXFP4),
        w.clone,
        device,
        [
            _quark_fake_quant_ref(w, qp),
            Ref(
                "frexp grid rounding (torch has no FP4)",
                lambda: _frexp_grid(w / scale, 2, 1, 6.0) * scale,
                elements_agree,
            ),
        ],
    )
    if not with_qparams:
        return rows
    rows += measure(
        f"memoryless_minmax mxfp4 qparams (even rounding) {shape}",
        lambda: observe("memoryless_minmax", w, MXFP4_EVEN),
        w.sum,
        device,
        [
            quark_observer_ref(
                "PerBlockMXObserver",
                "OCP_MXFP4Spec",
                w,
                {"ch_axis": -1, "is_dynamic": False},
                agree=lambda ours, theirs: scales_agree(ours.effective_scale, theirs),
            )
        ],
    )

    def agree_search(ours: ob.QParams, theirs: torch.Tensor) -> str:
        ratio = _mxfp4_sse(w, ours.effective_scale) / _mxfp4_sse(w, theirs)
        return f"{scales_agree(ours.effective_scale, theirs)}; SSE ours/Quark {ratio:.5f}"

    rows += measure(
        f"mx_exponent_search mxfp4 scope 2 (ceil start) {shape}",
        lambda: observe("mx_exponent_search", w, MXFP4_CEIL, scope=2),
        w.clone,
        device,
        [
            quark_observer_ref(
                "PerBlockMXDiffsObserver", "OCP_MXFP4DiffsSpec", w, {"ch_axis": -1}, {"scope": 2}, agree=agree_search
            )
        ],
    )
    return rows


def _nvfp4_cases(w: torch.Tensor, device: str) -> list[dict]:
    shape = "x".join(map(str, w.shape))

    def agree_nvfp4(ours: ob.QParams, theirs: torch.Tensor) -> str:
        stored = theirs.to(torch.float8_e4m3fn).float()  # llm-compressor stores block scales as FP8
        return f"{scales_agree(ours.scale, stored)} after LC's FP8 storage cast"

    rows = measure(
        f"memoryless_minmax nvfp4 qparams {shape}",
        lambda: observe("memoryless_minmax", w, NVFP4),
        w.sum,
        device,
        [lc_observer_ref("memoryless_minmax", w, NVFP4_ARGS, agree_nvfp4)],
    )
    qp = observe("memoryless_minmax", w, NVFP4)

    def build(forward):
        from compressed_tensors.quantization import QuantizationArgs

        args = QuantizationArgs(**NVFP4_ARGS)
        return lambda: forward.fake_quantize(w, qp.scale, None, args, global_scale=qp.global_scale)

    rows += measure(
        f"fake_quantize nvfp4 {shape}",
        lambda: ob.fake_quantize(w, qp, NVFP4),
        w.clone,
        device,
        [
            ref_or_missing(
                "compressed-tensors fake_quantize (tensor_group)",
                "compressed_tensors.quantization.lifecycle.forward",
                build,
                elements_agree,
            )
        ],
    )
    return rows


def _mxfp8_case(w: torch.Tensor, device: str) -> list[dict]:
    shape = "x".join(map(str, w.shape))
    spec = ob.QuantSpec("mxfp8_e4m3")
    qp = observe("memoryless_minmax", w, spec)
    scale = _block_scale(qp.effective_scale, 32, w)
    return measure(
        f"fake_quantize mxfp8_e4m3 {shape}",
        lambda: ob.fake_quantize(w, qp, spec),
        w.clone,
        device,
        [
            Ref(
                "torch float8_e4m3fn cast",
                lambda: (w / scale).clamp_(-448, 448).to(torch.float8_e4m3fn).float().mul_(scale),
                elements_agree,
            )
        ],
    )


def _bfp16_case(w: torch.Tensor, device: str) -> list[dict]:
    """Observe + fake-quant, because Quark's BFP16 is one fused call (no separate observer)."""
    shape = "x".join(map(str, w.shape))
    spec = ob.QuantSpec("bfp16")

    def build(kernel):
        return lambda: kernel.non_scaled_fake_quantize(w, "bfp16", "", -1, 8, "even")

    def agree(ours: torch.Tensor, theirs: torch.Tensor) -> str:
        text = elements_agree(ours, theirs)
        return text if text == "identical" else f"{text} (the -128 code, see BENCHMARKS.md)"

    return measure(
        f"observe + fake_quantize bfp16 {shape}",
        lambda: ob.fake_quantize(w, observe("memoryless_minmax", w, spec), spec),
        w.clone,
        device,
        [ref_or_missing("Quark non_scaled_fake_quantize bfp16", "quark.torch.kernel", build, agree)],
    )


def cases(device: str = "cpu") -> list[dict]:
    rows_n = rows_for(4096)
    w = llm_weight(rows_n, 4096, device)
    wide = llm_weight(rows_n, 11008, device, seed=1)
    return [
        *_mx_cases(w, device, with_qparams=True),
        *_mx_cases(wide, device, with_qparams=False),
        *_mxfp8_case(w, device),
        *_nvfp4_cases(w, device),
        *_bfp16_case(w, device),
    ]
