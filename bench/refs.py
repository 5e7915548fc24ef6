"""Reference observers (llm-compressor, Quark, ModelOpt) as ``Ref``s that run in this process on
the benchmark's own tensors: each is imported where installed, else its rows say ``missing``."""

from __future__ import annotations

import math

import torch
from torch.ao.quantization.observer import HistogramObserver as TaoHistogramObserver

import observers as ob
from bench.common import Ref, ref_or_missing, scales_agree

INT4_G128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def amax_of(qp: ob.QParams) -> float:
    """The clipping range of per-tensor qparams, comparable with a reference's amax."""
    return max(-float(qp.min_val.min()), float(qp.max_val.max()))


def agree_scales(ours: ob.QParams | list[ob.QParams], theirs: torch.Tensor) -> str:
    """Ours' scale(s) against a reference's scales (flattened and concatenated for several tensors)."""
    mine = [ours] if isinstance(ours, ob.QParams) else ours
    return scales_agree(torch.cat([qp.scale.flatten() for qp in mine]), theirs)


def _tensors(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]


def lc_observer_ref(name: str, x: torch.Tensor | list[torch.Tensor], args: dict, agree=None) -> Ref:
    """llm-compressor's observer ``name`` on each weight in ``x`` with compressed-tensors
    ``QuantizationArgs(**args)`` (a fresh observer per weight, as llm-compressor calibrates);
    returns the scales, flattened and concatenated."""
    tensors = _tensors(x)

    def build(lc):
        from compressed_tensors.quantization import QuantizationArgs

        quant_args = QuantizationArgs(**args)

        def run() -> torch.Tensor:
            scales = []
            for t in tensors:
                obs = lc.Observer.load_from_registry(name, base_name="weight", args=quant_args)
                obs(t)
                scales.append(obs.get_qparams()["scale"].flatten())
            return torch.cat(scales)

        return run

    return ref_or_missing(f"llm-compressor {name}", "llmcompressor.observers", build, agree or agree_scales)


def quark_observer_ref(
    observer: str,
    spec: str,
    x: torch.Tensor | list[torch.Tensor],
    spec_args: dict,
    observer_args: dict | None = None,
    agree=None,
) -> Ref:
    """Quark's observer class ``observer(qspec, **observer_args)``, ``qspec`` built by Quark's own
    spec class ``spec(**spec_args)``: one observer per tensor in ``x``, forward then
    ``_calculate_qparams`` (what Quark's calibration calls); returns the scales, concatenated."""
    tensors = _tensors(x)

    def build(module):
        from quark.torch.quantization.config import config

        qspec = getattr(config, spec)(**spec_args).to_quantization_spec()
        cls = getattr(module, observer)

        def run() -> torch.Tensor:
            scales = []
            for t in tensors:
                obs = cls(qspec, **(observer_args or {}))
                obs(t)
                scales.append(obs._calculate_qparams()[0].flatten())
            return torch.cat(scales)

        return run

    label = f"Quark {observer}" + "".join(f" {k}={v}" for k, v in (observer_args or {}).items())
    return ref_or_missing(label, "quark.torch.quantization.observer.observer", build, agree or agree_scales)


def modelopt_ref(method: str, x: torch.Tensor | list[torch.Tensor], **compute_args) -> Ref:
    """ModelOpt's ``HistogramCalibrator`` (2048 bins of |x|), one per tensor in ``x`` (each layer
    calibrated on its own): collect, then ``compute_amax(method)``. Returns, per tensor, its amax
    and the centre of its first candidate bin (to spot an answer that is just the first candidate)."""
    tensors = _tensors(x)
    first = compute_args.get("start_bin", 128)

    def build(histogram):
        def run() -> list[tuple[float, float]]:
            out = []
            for t in tensors:
                calib = histogram.HistogramCalibrator(num_bits=8, axis=None, unsigned=False, num_bins=2048)
                calib.collect(t)
                edges = calib._calib_bin_edges
                out.append((float(calib.compute_amax(method, **compute_args)), float(edges[first : first + 2].mean())))
            return out

        return run

    def agree(ours: ob.QParams | list[ob.QParams], theirs: list[tuple[float, float]]) -> str:
        mine = [amax_of(qp) for qp in ([ours] if isinstance(ours, ob.QParams) else ours)]
        if len(mine) == 1:
            text = f"amax {mine[0]:.5g} vs {theirs[0][0]:.5g}"
        else:
            worst = max(abs(a - b) / b for a, (b, _) in zip(mine, theirs, strict=True))
            text = f"amax max rel diff {worst:.1e} over {len(mine)} tensors"
        if method == "mse" and any(math.isclose(b, c, rel_tol=1e-6) for b, c in theirs):
            text += " (ModelOpt's amax = its first candidate bin: a ModelOpt bug, see BENCHMARKS.md)"
        return text

    return ref_or_missing(
        f"ModelOpt HistogramCalibrator {method}", "modelopt.torch.quantization.calib.histogram", build, agree
    )


def quark_histogram_ref(method: str, x: torch.Tensor | list[torch.Tensor]) -> Ref:
    """Quark's per-tensor histogram observers by their ``observer_method`` name ("percentile",
    "MSE") through its ``Int8PerTensorSpec``, one per tensor in ``x``: forward, then
    ``_calculate_qparams``; returns the scales."""
    tensors = _tensors(x)

    def build(config):
        qspec = config.Int8PerTensorSpec(observer_method=method, symmetric=True).to_quantization_spec()

        def run() -> torch.Tensor:
            scales = []
            for t in tensors:
                obs = qspec.observer_cls(qspec)
                obs(t)
                scales.append(obs._calculate_qparams()[0].flatten())
            return torch.cat(scales)

        return run

    return ref_or_missing(
        f"Quark Int8PerTensorSpec({method})", "quark.torch.quantization.config.config", build, agree_scales
    )


def _span(values: list[float]) -> str:
    return f"{values[0]:.3f}" if len(values) == 1 else f"{min(values):.3f}..{max(values):.3f}"


def tao_histogram_ref(groups: list[list[torch.Tensor]]) -> Ref:
    """torch.ao's ``HistogramObserver`` (quint8, affine), one per group of batches: observe each
    batch of the group, then ``calculate_qparams``. Agreement: the scale ratio and, because the two
    searches may legitimately pick different ranges, the quantization MSE of each choice on the
    same data (both through ``torch.fake_quantize_per_tensor_affine``, so the rounding is the same)."""

    def run() -> list[tuple[float, int]]:
        out = []
        for batches in groups:
            tao = TaoHistogramObserver().to(batches[0].device)
            for b in batches:
                tao(b)
            scale, zero_point = tao.calculate_qparams()
            out.append((float(scale), int(zero_point)))
        return out

    def mse(x: torch.Tensor, scale: float, zero_point: int) -> float:
        return float((torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, 255) - x).double().square().mean())

    def agree(ours: ob.QParams | list[ob.QParams], theirs: list[tuple[float, int]]) -> str:
        mine = [ours] if isinstance(ours, ob.QParams) else ours
        ratios, errors = [], []
        for qp, (scale, zero_point), batches in zip(mine, theirs, groups, strict=True):
            x = torch.cat([b.flatten() for b in batches])
            ratios.append(float(qp.scale) / scale)
            errors.append(mse(x, float(qp.scale), int(qp.zero_point)) / mse(x, scale, zero_point))
        return f"scale ratio ours/torch.ao {_span(ratios)}; quantization MSE ours/torch.ao {_span(errors)}"

    return Ref("torch.ao HistogramObserver", run, agree)
