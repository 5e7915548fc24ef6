"""Min-max family and integer fake-quant on synthetic LLM weights (4096x4096 and 4096x11008).

References, all in this process on the same tensors: llm-compressor ``memoryless_minmax``, Quark's
``PerGroupMinMaxObserver`` / ``PerChannelMinMaxObserver`` / ``PerTensorMinMaxObserver``, torch.ao's
``MinMaxObserver`` / ``PerChannelMinMaxObserver``, compressed-tensors' ``fake_quantize`` and
``torch.fake_quantize_per_channel_affine``.
"""

from __future__ import annotations

import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import observers as ob
from bench.common import Ref, elements_agree, llm_weight, measure, observe, ref_or_missing, rows_for
from bench.refs import INT4_G128, agree_scales, lc_observer_ref, quark_observer_ref
from observers import kernels

GROUP = ob.QuantSpec("int4", strategy="group", group_size=128)
CHANNEL = ob.QuantSpec("int8", strategy="channel")
TENSOR = ob.QuantSpec("int8")


def _eager_minmax_ref(w: torch.Tensor) -> Ref:
    """Ours with the native one-read kernel switched off (two eager passes, amin then amax), so
    the table shows what the kernel buys; on CUDA both are the eager path."""

    def run() -> torch.Tensor:
        with kernels.disabled():
            return observe("memoryless_minmax", w, GROUP).scale

    return Ref("ours, eager amin + amax (kernels.disabled())", run, agree_scales)


def _minmax_group_cases(w: torch.Tensor, device: str) -> list[dict]:
    shape = "x".join(map(str, w.shape))
    refs = [
        lc_observer_ref("memoryless_minmax", w, INT4_G128),
        quark_observer_ref("PerGroupMinMaxObserver", "Int4PerGroupSpec", w, {"ch_axis": 1, "group_size": 128}),
        _eager_minmax_ref(w),
    ]
    return measure(
        f"memoryless_minmax int4 g128 {shape}",
        lambda: observe("memoryless_minmax", w, GROUP),
        w.sum,
        device,
        refs,
    )


def _ao_ref(label: str, observer, x: torch.Tensor) -> Ref:
    observer = observer.to(x.device)

    def run() -> torch.Tensor:
        observer.reset_min_max_vals()
        observer.to(x.device)  # the per-channel reset makes its empty min/max on the CPU
        observer(x)
        return observer.calculate_qparams()[0]

    return Ref(label, run, agree_scales)


def _fake_quant_group_case(w: torch.Tensor, device: str) -> list[dict]:
    shape = "x".join(map(str, w.shape))
    qp = observe("memoryless_minmax", w, GROUP)

    def build(forward):
        from compressed_tensors.quantization import QuantizationArgs

        args = QuantizationArgs(**INT4_G128)
        return lambda: forward.fake_quantize(w, qp.scale, qp.zero_point, args)

    ref = ref_or_missing(
        "compressed-tensors fake_quantize",
        "compressed_tensors.quantization.lifecycle.forward",
        build,
        elements_agree,
    )
    return measure(f"fake_quantize int4 g128 {shape}", lambda: ob.fake_quantize(w, qp, GROUP), w.clone, device, [ref])


def cases(device: str = "cpu") -> list[dict]:
    rows_n = rows_for(4096)
    w = llm_weight(rows_n, 4096, device)
    wide = llm_weight(rows_n, 11008, device, seed=1)
    rows = []
    for x in (w, wide):
        rows += _minmax_group_cases(x, device)

    shape = f"{rows_n}x4096"
    rows += measure(
        f"minmax int8 per-channel {shape}",
        lambda: observe("minmax", w, CHANNEL),
        w.sum,
        device,
        [
            _ao_ref(
                "torch.ao PerChannelMinMaxObserver",
                PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
                w,
            ),
            quark_observer_ref("PerChannelMinMaxObserver", "Int8PerChannelSpec", w, {"ch_axis": 0, "symmetric": True}),
        ],
    )
    rows += measure(
        f"minmax int8 per-tensor {shape}",
        lambda: observe("minmax", w, TENSOR),
        w.sum,
        device,
        [
            _ao_ref(
                "torch.ao MinMaxObserver", MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric), w
            ),
            quark_observer_ref("PerTensorMinMaxObserver", "Int8PerTensorSpec", w, {"symmetric": True}),
        ],
    )

    for x in (w, wide):
        rows += _fake_quant_group_case(x, device)

    qp = observe("minmax", w, CHANNEL)
    scale, zero_point = qp.scale.flatten(), qp.zero_point.flatten()
    rows += measure(
        f"fake_quantize int8 per-channel {shape}",
        lambda: ob.fake_quantize(w, qp, CHANNEL),
        w.clone,
        device,
        [
            Ref(
                "torch.fake_quantize_per_channel_affine",
                lambda: torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, -128, 127),
                lambda ours, theirs: f"{elements_agree(ours, theirs)} (torch multiplies by 1/scale, we divide)",
            )
        ],
    )
    return rows
