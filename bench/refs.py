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


LC_NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor_group",
    "group_size": 16,
    "scale_dtype": torch.float8_e4m3fn,
}
"""compressed-tensors ``QuantizationArgs`` of an NVFP4 weight (E4M3 block scales), as llm-compressor's
NVFP4 scheme sets them: what its NVFP4 observers are compared under."""


def _tensors(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return x if isinstance(x, list) else [x]


def _linear_over(w: torch.Tensor) -> torch.nn.Linear:
    """A bias-free ``Linear`` whose weight is ``w`` itself (no copy, no random init): the module
    an input-collecting reference hooks, as it would hook the real layer."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def lc_observer_ref(
    name: str,
    x: torch.Tensor | list[torch.Tensor],
    args: dict,
    agree=None,
    inputs: torch.Tensor | None = None,
) -> Ref:
    """llm-compressor's observer ``name`` on each weight in ``x`` with compressed-tensors
    ``QuantizationArgs(**args)`` (a fresh observer per weight, as llm-compressor calibrates);
    returns the scales, flattened and concatenated. With ``inputs`` (one weight), the observer
    collects its importance as in a calibration: attached to the layer, one forward of
    ``inputs`` through its own hook, detached, then the weight observed."""
    tensors = _tensors(x)

    def build(lc):
        from compressed_tensors.quantization import QuantizationArgs

        quant_args = QuantizationArgs(**args)
        layers = [_linear_over(t) for t in tensors] if inputs is not None else []

        def run() -> torch.Tensor:
            scales = []
            for i, t in enumerate(tensors):
                obs = lc.Observer.load_from_registry(name, base_name="weight", args=quant_args)
                if layers:
                    obs.attach(layers[i])
                    layers[i](inputs)
                    obs.detach(layers[i])
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


def _fp4_round_magnitude(a: torch.Tensor) -> torch.Tensor:
    """ModelOpt 0.47's ``fp4_round_magnitude`` (``kernels/quantization/common/nvfp4_quant.py``, a
    Triton function) transcribed: ``|x| / scale`` to the nearest E2M1 magnitude, ties to the even
    code, with its exact ``<`` / ``<=`` boundaries."""
    q = torch.where(a <= 5.0, 4.0, 6.0)
    q = torch.where(a < 3.5, 3.0, q)
    q = torch.where(a <= 2.5, 2.0, q)
    q = torch.where(a < 1.75, 1.5, q)
    q = torch.where(a <= 1.25, 1.0, q)
    q = torch.where(a < 0.75, 0.5, q)
    return torch.where(a <= 0.25, 0.0, q)


def modelopt_static_nvfp4(global_amax: torch.Tensor):
    """``quant_func(blocks, amax)`` of ModelOpt's static NVFP4 weight quantizer on CPU.

    Why: the quantizer's fake quantization (``static_blockwise_fp4_fake_quant``) is a Triton
    kernel and refuses to run without it (tensor_quant.py: "static_blockwise_fp4_fake_quant requires
    triton"), and the dynamic NVFP4 path asserts "amax must be a CUDA tensor". This is that
    kernel's arithmetic on CPU: the block scales from ModelOpt's own ``compute_fp4_scales`` steps
    (``scaled_e4m3_impl(amax / 6, global_amax / 6)``, its eager FP8 path) and each element rounded
    by ``nvfp4_scalar_quant`` (a zero scale zeroes the block)."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

    def quant(blocks: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        scale = scaled_e4m3_impl(amax.float() / 6.0, global_amax.float() / 6.0).reshape(-1, 1)
        safe = torch.where((scale == 0) | scale.isnan() | scale.isinf(), 1.0, scale)
        q = _fp4_round_magnitude(blocks.abs() / safe) * safe
        return torch.where(scale == 0, 0.0, torch.where(blocks >= 0, q, -q))

    return quant


def _block_amax_agree(blocks: torch.Tensor):
    """Our per-block amax (``max_val``) against ModelOpt's calibrated ``amax``; the blocks where they
    differ are checked for exact ties: ModelOpt's own quantization of the block gives the same
    values at both amaxes (so any error metric ties, and the pick is a rounding matter)."""

    def agree(ours: ob.QParams, theirs: torch.Tensor) -> str:
        mine = ours.max_val.flatten()
        text = scales_agree(mine, theirs).replace("scales", "block amax")
        differ = (mine != theirs).nonzero().flatten()
        if differ.numel():
            quant = modelopt_static_nvfp4(blocks.abs().max())
            picked = blocks[differ]
            same = (quant(picked, mine[differ]) == quant(picked, theirs[differ])).all(dim=1)
            text += f"; {int(same.sum())} of the {differ.numel()} other blocks are exact ties in ModelOpt's arithmetic"
        return text

    return agree


def modelopt_nvfp4_ref(search: str, w: torch.Tensor, inputs: torch.Tensor | None = None) -> Ref:
    """ModelOpt 0.47's weight search for a static NVFP4 weight quantizer (block 16, E4M3 scales), as
    ``mse_calibrate`` / ``local_hessian_calibrate`` build it (``_make_weight_mse_calibrator``): the
    max-calibrated block amax ``(blocks, 1)`` on axis 0 and ``global_amax = max|w|``, the weight in
    blocks of 16, ``collect`` then ``compute_amax``. ``search``: "mse" (``MseCalibrator``, 39
    multipliers), "fp8_sweep" (``NVFP4MSECalibrator``, 126 E4M3 values; on CPU its Python reference
    sweep), "local_hessian" (the sweep with ``_LocalHessianAccumulator``'s error on ``inputs``).
    Returns the chosen block amax."""
    blocks = w.reshape(-1, 16)

    def error():
        if search != "local_hessian":
            return None
        from modelopt.torch.quantization.model_calib import _LocalHessianAccumulator

        accumulator = _LocalHessianAccumulator(w.shape[0], w.shape[1], 16)
        accumulator.accumulate(inputs)
        return accumulator.build_error_func()

    def build(calib):
        def run() -> torch.Tensor:
            amax, global_amax = blocks.abs().amax(1, keepdim=True), blocks.abs().max()
            quant = modelopt_static_nvfp4(global_amax)
            if search == "mse":
                cal = calib.MseCalibrator(amax, axis=(0,), quant_func=quant)
            else:
                cal = calib.NVFP4MSECalibrator(amax, global_amax, axis=(0,), quant_func=quant, error_func=error())
            cal.collect(blocks)
            return cal.compute_amax().flatten()

        return run

    label = {
        "mse": "ModelOpt MseCalibrator (static NVFP4 quant_func on CPU)",
        "fp8_sweep": "ModelOpt NVFP4MSECalibrator reference sweep",
        "local_hessian": "ModelOpt NVFP4MSECalibrator + _LocalHessianAccumulator error",
    }[search]
    return ref_or_missing(label, "modelopt.torch.quantization.calib", build, _block_amax_agree(blocks))
