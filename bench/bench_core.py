"""Min-max family and fake-quant: against torch.ao and the memory-bandwidth floor."""

from __future__ import annotations

from functools import partial

import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import observers as ob
from bench.common import case, llm_weight, median_seconds


def _observe_qparams(name: str, x: torch.Tensor, spec: ob.QuantSpec, kind: str = "weight") -> ob.QParams:
    obs = ob.create(name, spec, kind=kind)
    obs.observe(x)
    return obs.qparams()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.flatten().double() - b.flatten().double()).abs() / b.flatten().double().abs()).max())


def cases(device: str = "cpu") -> list[dict]:
    w = llm_weight(4096, 4096, device)
    rows = []
    floor = median_seconds(lambda: w.sum(), device)
    clone = median_seconds(lambda: w.clone(), device)

    group = ob.QuantSpec("int4", strategy="group", group_size=128)
    ours = median_seconds(lambda: _observe_qparams("memoryless_minmax", w, group), device)
    naive = median_seconds(lambda: torch.aminmax(w.view(4096, 32, 128), dim=-1), device)
    rows.append(
        case("memoryless_minmax int4 g128 4096x4096", ours, naive, "naive aminmax(dim=-1)", floor, "same min/max")
    )

    channel = ob.QuantSpec("int8", strategy="channel")
    ref_obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)

    def torch_ao_channel():
        ref_obs.reset_min_max_vals()
        ref_obs(w)
        return ref_obs.calculate_qparams()

    ref_s = median_seconds(torch_ao_channel, device)
    ours = median_seconds(lambda: _observe_qparams("minmax", w, channel), device)
    agree = _max_rel(_observe_qparams("minmax", w, channel).scale, torch_ao_channel()[0])
    rows.append(
        case(
            "minmax int8 per-channel 4096x4096",
            ours,
            ref_s,
            "torch.ao PerChannelMinMaxObserver",
            floor,
            f"max rel scale diff {agree:.1e}",
        )
    )

    tensor = ob.QuantSpec("int8")
    ref_tensor = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)

    def torch_ao_tensor():
        ref_tensor.reset_min_max_vals()
        ref_tensor(w)
        return ref_tensor.calculate_qparams()

    ref_s = median_seconds(torch_ao_tensor, device)
    ours = median_seconds(lambda: _observe_qparams("minmax", w, tensor), device)
    agree = _max_rel(_observe_qparams("minmax", w, tensor).scale, torch_ao_tensor()[0])
    rows.append(
        case(
            "minmax int8 per-tensor 4096x4096",
            ours,
            ref_s,
            "torch.ao MinMaxObserver",
            floor,
            f"max rel scale diff {agree:.1e}",
        )
    )

    qp = _observe_qparams("memoryless_minmax", w, group)
    ours = median_seconds(lambda: ob.fake_quantize(w, qp, group), device)
    rows.append(case("fake_quantize int4 g128 4096x4096", ours, None, "", clone, "clone() floor"))

    qp = _observe_qparams("minmax", w, channel)
    scale, zero_point = qp.scale.flatten(), qp.zero_point.flatten()
    ref_s = median_seconds(lambda: torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, -128, 127), device)
    ours = median_seconds(lambda: ob.fake_quantize(w, qp, channel), device)
    theirs = torch.fake_quantize_per_channel_affine(w, scale, zero_point, 0, -128, 127)
    differing = int((ob.fake_quantize(w, qp, channel) != theirs).sum())
    rows.append(
        case(
            "fake_quantize int8 per-channel 4096x4096",
            ours,
            ref_s,
            "torch.fake_quantize_per_channel_affine",
            clone,
            f"{differing} of {w.numel()} differ (torch multiplies by 1/scale, we divide)",
        )
    )
    return rows


def scaling(device: str = "cpu") -> list[dict]:
    """Time vs tensor size (1M -> 64M elements) for min-max at group 128: cost should be linear."""
    rows = []
    spec = ob.QuantSpec("int4", strategy="group", group_size=128)
    for millions in (1, 4, 16, 64):
        w = torch.randn(millions * 1024, 1024, device=device)
        floor = median_seconds(w.sum, device)
        ours = median_seconds(partial(_observe_qparams, "memoryless_minmax", w, spec), device)
        rows.append(
            case(
                f"scaling memoryless_minmax g128 {millions}M elements",
                ours,
                None,
                "",
                floor,
                f"{ours / millions * 1e3:.2f} ms per M elements",
            )
        )
    return rows
