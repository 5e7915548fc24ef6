"""Observers as of today (issue 18): llm-compressor 0.14's NVFP4 and imatrix searches, ModelOpt
0.47's MSE calibrators and NVFP4 headroom, compressed-tensors' MX rounding, Quark's BFP16, AIMET's
SQNR analyzer and Quark's layer-wise percentile, each against its reference in this process on the
same tensors (AIMET and Quark ONNX are reported missing where they cannot be imported)."""

from __future__ import annotations

import torch

import observers as ob
from bench.common import (
    Ref,
    activation_batches,
    elements_agree,
    llm_weight,
    measure,
    observe,
    ref_or_missing,
    rows_for,
    scales_agree,
)
from bench.refs import agree_scales

NVFP4 = ob.QuantSpec("nvfp4")
NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
INT4_G128 = ob.QuantSpec("int4", strategy="group", group_size=128)
E4M3_MAX = 448.0


def _amax_agree(ours: ob.QParams, theirs: torch.Tensor) -> str:
    return scales_agree(ours.max_val.flatten(), theirs.flatten())


def _with_inputs(name: str, w: torch.Tensor, x: torch.Tensor, spec: ob.QuantSpec) -> ob.QParams:
    obs = ob.create(name, spec)
    obs.observe_inputs(x)
    obs.observe(w)
    return obs.qparams()


def _lc_ref(name: str, w: torch.Tensor, args: dict, inputs: torch.Tensor | None = None) -> Ref:
    """llm-compressor's observer ``name`` (importance collected by its own forward hook)."""

    def build(lc):
        from compressed_tensors.quantization import QuantizationArgs

        def run() -> torch.Tensor:
            quant_args = dict(args)
            if quant_args["strategy"] == "tensor_group":
                quant_args["scale_dtype"] = torch.float8_e4m3fn
            obs = lc.Observer.load_from_registry(name, base_name="weight", args=QuantizationArgs(**quant_args))
            if inputs is not None:
                layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                obs.attach(layer)
                layer(inputs)
                obs.detach(layer)
            obs(w)
            return obs.get_qparams()["scale"].flatten()

        return run

    return ref_or_missing(f"llm-compressor {name}", "llmcompressor.observers", build, agree_scales)


def _lc_cases(device: str) -> list[dict]:
    w = llm_weight(rows_for(128), 2048, device)  # llm-compressor's loops take seconds per call
    x = activation_batches(1, 256, 2048, device)[0] * 0.1
    shape = "x".join(map(str, w.shape))
    int4_args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    rows = measure(
        f"imatrix_mse int4 g128 (0.95/20/norm 3, own inputs) {shape}",
        lambda: _with_inputs("imatrix_mse", w, x, INT4_G128),
        w.sum,
        device,
        [_lc_ref("imatrix_mse", w, int4_args, x)],
    )
    rows += measure(
        f"nvfp4_expanded_mse nvfp4 {shape}",
        lambda: observe("nvfp4_expanded_mse", w, NVFP4),
        w.sum,
        device,
        [_lc_ref("nvfp4_expanded_mse", w, NVFP4_ARGS), _lc_ref("fouroversix", w, NVFP4_ARGS)],
    )
    rows += measure(
        f"nvfp4_expanded_imatrix nvfp4 {shape}",
        lambda: _with_inputs("nvfp4_expanded_imatrix", w, x, NVFP4),
        w.sum,
        device,
        [_lc_ref("nvfp4_expanded_imatrix", w, NVFP4_ARGS, x)],
    )
    channel_args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    rows += measure(
        f"static_minmax (alias of minmax) int8 channel {shape}",
        lambda: observe("static_minmax", w, ob.QuantSpec("int8", strategy="channel")),
        w.sum,
        device,
        [_lc_ref("static_minmax", w, channel_args)],
    )
    return rows


def _convention_cases(device: str) -> list[dict]:
    w = llm_weight(rows_for(1024), 4096, device)
    shape = "x".join(map(str, w.shape))
    spec = ob.QuantSpec("mxfp8_e4m3", scale_rounding="compressed-tensors")

    def build_ct(mxfp):
        return lambda: mxfp.generate_mx_scales(w.abs().reshape(w.shape[0], -1, 32).amax(-1), 8).clamp(0, 255)

    def agree_codes(ours: ob.QParams, theirs: torch.Tensor) -> str:
        even = observe("memoryless_minmax", w, ob.QuantSpec("mxfp8_e4m3", scale_rounding="even"))
        differ = int((even.extras["scale_exponent"].float().flatten() != theirs.flatten()).sum())
        return f"{elements_agree(ours.extras['scale_exponent'].float().flatten(), theirs.flatten())} E8M0 codes; even rule differs in {differ} of {theirs.numel()} blocks"  # noqa: E501

    rows = measure(
        f"memoryless_minmax mxfp8_e4m3 qparams, compressed-tensors rounding {shape}",
        lambda: observe("memoryless_minmax", w, spec),
        w.sum,
        device,
        [
            ref_or_missing(
                "compressed-tensors generate_mx_scales",
                "compressed_tensors.quantization.utils.mxfp_utils",
                build_ct,
                agree_codes,
            )
        ],
    )
    bfp = ob.QuantSpec("bfp16_quark")

    def build_quark(kernel):
        return lambda: kernel.fake_quantize_bfp16(w, axis=-1, block_size=8)

    rows += measure(
        f"observe + fake_quantize bfp16_quark (codes -128..127) {shape}",
        lambda: ob.fake_quantize(w, observe("minmax", w, bfp), bfp),
        w.clone,
        device,
        [
            ref_or_missing(
                "Quark fake_quantize_bfp16",
                "quark.torch.kernel.hw_emulation.hw_emulation_interface",
                build_quark,
                elements_agree,
            )
        ],
    )
    return rows


def _nvfp4_qdq(global_amax: torch.Tensor):
    """ModelOpt's own CPU NVFP4 arithmetic (``NVFP4QTensor`` quantize/dequantize) for a candidate amax."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    second = global_amax / (6 * E4M3_MAX)

    def qdq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        per_block = (amax.reshape(*x.shape[:-1], x.shape[-1] // 16).float() / 6.0) / second
        block = NVFP4QTensor._cast_per_block_scale_to_fp8(per_block)
        q, s1, s2 = NVFP4QTensor.quantize(x, 16, block, second)
        return q.dequantize(dtype=torch.float32, scale=s1, double_scale=s2, block_sizes={-1: 16}).reshape(x.shape)

    return qdq


def _modelopt_cases(device: str) -> list[dict]:
    w = llm_weight(rows_for(512), 2048, device)
    small = llm_weight(rows_for(64), 1024, device, seed=1)  # ModelOpt's reference sweep: ~10 s at 256 rows
    x = activation_batches(1, 256, 1024, device)[0] * 0.1
    shape, small_shape = "x".join(map(str, w.shape)), "x".join(map(str, small.shape))
    int8_qmax = ob.QuantSpec("int8", strategy="channel", scale_rule="qmax")

    def build_mse(calib):
        from modelopt.torch.quantization.tensor_quant import _tensor_quant

        def run() -> torch.Tensor:
            cal = calib.MseCalibrator(
                w.abs().amax(1, keepdim=True), axis=0, quant_func=lambda t, a: _tensor_quant(t, a, 8, False, False)
            )
            cal.collect(w)
            return cal.compute_amax()

        return run

    rows = measure(
        f"modelopt_mse int8 channel (39 multipliers) {shape}",
        lambda: observe("modelopt_mse", w, int8_qmax),
        w.sum,
        device,
        [ref_or_missing("ModelOpt MseCalibrator", "modelopt.torch.quantization.calib", build_mse, _amax_agree)],
    )
    blocks, global_amax = small.reshape(-1, 16), small.abs().max()

    def build_sweep(calib, hessian: bool = False):
        def run() -> torch.Tensor:
            error = None
            if hessian:
                from modelopt.torch.quantization.model_calib import _LocalHessianAccumulator

                accumulator = _LocalHessianAccumulator(small.shape[0], small.shape[1], 16)
                accumulator.accumulate(x)
                error = accumulator.build_error_func()
            cal = calib.NVFP4MSECalibrator(
                blocks.abs().amax(1), global_amax, axis=0, quant_func=_nvfp4_qdq(global_amax), error_func=error
            )
            cal.collect(blocks)
            return cal.compute_amax()

        return run

    rows += measure(
        f"nvfp4_fp8_sweep (126 E4M3 scales per block) {small_shape}",
        lambda: observe("nvfp4_fp8_sweep", small, NVFP4),
        small.sum,
        device,
        [
            ref_or_missing(
                "ModelOpt NVFP4MSECalibrator (reference sweep, NVFP4QTensor on CPU)",
                "modelopt.torch.quantization.calib",
                build_sweep,
                _amax_agree,
            )
        ],
    )
    rows += measure(
        f"local_hessian nvfp4 (H from 256 tokens) {small_shape}",
        lambda: _with_inputs("local_hessian", small, x, NVFP4),
        small.sum,
        device,
        [
            ref_or_missing(
                "ModelOpt NVFP4MSECalibrator + local Hessian error",
                "modelopt.torch.quantization.calib",
                lambda calib: build_sweep(calib, hessian=True),
                _amax_agree,
            )
        ],
    )
    batches = [
        b * torch.exp(torch.linspace(-6, 3, b.shape[-1], device=device))
        for b in activation_batches(4, 512, 2048, device)
    ]

    def ours_headroom() -> torch.Tensor:
        obs = ob.create("nvfp4_act_headroom", NVFP4, kind="activation")
        for batch in batches:
            obs.observe(batch)
        return obs.global_amax()

    def build_headroom(calib):
        def run() -> torch.Tensor:
            cal = calib.NVFP4ActHeadroomCalibrator(block_size=16)
            for batch in batches:
                cal.collect(batch)
            return cal.compute_amax()

        return run

    rows += measure(
        "nvfp4_act_headroom global amax, 4 batches 512x2048",
        ours_headroom,
        None,
        device,
        [
            ref_or_missing(
                "ModelOpt NVFP4ActHeadroomCalibrator",
                "modelopt.torch.quantization.calib",
                build_headroom,
                lambda ours, theirs: scales_agree(ours.reshape(1), theirs.reshape(1)),
            )
        ],
    )
    return rows


def _search_cases(device: str) -> list[dict]:
    w = llm_weight(rows_for(1024), 2048, device)
    shape = "x".join(map(str, w.shape))
    rows = measure(
        f"sqnr int8 channel (101 deltas x 2048 bins) {shape}",
        lambda: observe("sqnr", w, ob.QuantSpec("int8", strategy="channel")),
        w.sum,
        device,
        [ref_or_missing("AIMET SqnrEncodingAnalyzer", "aimet_torch.v2.quantization.encoding_analyzer", lambda m: None)],
    )
    rows += measure(
        f"layerwise_percentile int8 tensor {shape}",
        lambda: observe("layerwise_percentile", w, ob.QuantSpec("int8")),
        w.sum,
        device,
        [
            ref_or_missing(
                "Quark ONNX LayerWisePercentileCalibrater", "quark.onnx.calibration.calibrators", lambda m: None
            )
        ],
    )
    return rows


def cases(device: str) -> list[dict]:
    return [*_lc_cases(device), *_convention_cases(device), *_modelopt_cases(device), *_search_cases(device)]
