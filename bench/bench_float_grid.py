"""Float-element searches through the native float-grid kernel (issue 26) on a synthetic
2048x2048 LLM weight.

Each search is timed in this process on the same tensor, interleaved with: ``mse_grid`` int4 g128
(the goal's yardstick: the issue asks <= 3x of it for ``nvfp4_expanded_mse`` and ``nvfp4_fp8_sweep``,
<= 2x for ``modelopt_mse`` NVFP4, ``mse_grid`` NVFP4 and ``mse_grid`` FP8 per channel), our own eager
path (``kernels.disabled()``, the kernel's reference, scales compared exactly) and the reference
that runs on CPU: llm-compressor's observer of the same name (``nvfp4_expanded_mse``,
``nvfp4_expanded_imatrix``), ModelOpt's calibrator on the first 128 rows (``modelopt_mse``, ``nvfp4_fp8_sweep``,
``local_hessian``; see ``bench.refs.modelopt_nvfp4_ref`` for why its Triton fake quantization is
replaced by the same arithmetic on CPU). On the yardstick row the goal's ratio (ours / mse_grid int4
g128) is 1 / the speed-up column.

The input-weighted searches take the inputs of one calibration batch (256 tokens): the imatrix
search collects its importance with ``observe_inputs`` (llm-compressor with its own forward hook),
``local_hessian`` takes the ``hessian`` knob from ``observers.local_hessian`` (what the lab passes;
ModelOpt accumulates it with ``_LocalHessianAccumulator`` inside its timed run).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import observers as ob
from bench.common import Ref, activation_batches, llm_weight, measure, observe, rows_for, scales_agree
from bench.refs import LC_NVFP4_ARGS, lc_observer_ref, modelopt_nvfp4_ref
from observers import kernels

INT4_G128 = ob.QuantSpec("int4", strategy="group", group_size=128)
NVFP4 = ob.QuantSpec("nvfp4")
FP8_CHANNEL = ob.QuantSpec("fp8_e4m3", strategy="channel")
SEARCHES = [
    ("mse_grid", NVFP4),
    ("mse_grid", FP8_CHANNEL),
    ("nvfp4_expanded_mse", NVFP4),
    ("nvfp4_expanded_imatrix", NVFP4),
    ("nvfp4_fp8_sweep", NVFP4),
    ("modelopt_mse", NVFP4),
    ("local_hessian", NVFP4),
]
MODELOPT_SEARCH = {"modelopt_mse": "mse", "nvfp4_fp8_sweep": "fp8_sweep", "local_hessian": "local_hessian"}


def _same_scales(ours: ob.QParams, theirs: ob.QParams) -> str:
    """Exact comparison with the eager path: the share of identical scales."""
    same = float((ours.scale == theirs.scale).float().mean())
    return "identical scales" if same == 1.0 else f"{same:.4%} identical scales (near-tie groups)"


def _yardstick(w: torch.Tensor) -> Ref:
    return Ref("ours, mse_grid int4 g128 (goal yardstick)", lambda: observe("mse_grid", w, INT4_G128).scale)


def _eager(ours: Callable[[], ob.QParams]) -> Ref:
    def run() -> ob.QParams:
        with kernels.disabled():
            return ours()

    return Ref("ours, eager path (kernels.disabled())", run, _same_scales)


def _lc(name: str, w: torch.Tensor, inputs: torch.Tensor | None) -> Ref:
    def agree(ours: ob.QParams, theirs: torch.Tensor) -> str:
        return scales_agree(ours.scale.flatten(), theirs)

    return lc_observer_ref(name, w, LC_NVFP4_ARGS, agree, inputs=inputs)


def user_search(name: str, spec: ob.QuantSpec, w: torch.Tensor, x: torch.Tensor) -> Callable[[], ob.QParams]:
    """Our search as a user calls it: create, inputs (``observe_inputs``, the imatrix searches) or
    Hessian (``local_hessian``'s knob, what the lab passes) where it takes them, observe, qparams.
    ``tests/test_cuda.py`` runs the same calls on both devices."""
    if name == "local_hessian":
        hessian = ob.local_hessian(x)
        return lambda: observe(name, w, spec, hessian=hessian)

    def run() -> ob.QParams:
        obs = ob.create(name, spec)
        if hasattr(obs, "observe_inputs"):
            obs.observe_inputs(x)
        obs.observe(w)
        return obs.qparams()

    return run


def _modelopt_rows(name: str, spec: ob.QuantSpec, w: torch.Tensor, x: torch.Tensor, device: str) -> list[dict]:
    """ModelOpt's calibrator against ours on the weight's first 128 rows: its Python candidate
    loop takes about 25 s per call (the Hessian one about a minute) on the whole 2048x2048 weight."""
    part = w[: rows_for(128)]
    shape = "x".join(map(str, part.shape))
    ref = modelopt_nvfp4_ref(MODELOPT_SEARCH[name], part, x)
    ours = user_search(name, spec, part, x)
    return measure(f"{name} {spec.dtype} {shape} (first rows)", ours, part.sum, device, [ref])


def cases(device: str = "cpu") -> list[dict]:
    w = llm_weight(rows_for(2048), 2048, device)
    x = activation_batches(1, 256, w.shape[1], device)[0] * 0.1
    shape = "x".join(map(str, w.shape))
    rows = []
    for name, spec in SEARCHES:
        ours = user_search(name, spec, w, x)
        refs = [_yardstick(w)]
        if device == "cpu":
            refs.append(_eager(ours))
        if name.startswith("nvfp4_expanded"):
            refs.append(_lc(name, w, x if name == "nvfp4_expanded_imatrix" else None))
        label = f"{spec.dtype} channel" if spec.strategy == "channel" else spec.dtype
        path = "float-grid kernel" if device == "cpu" else f"eager torch on {device}"  # the kernels serve the CPU
        rows += measure(f"{name} {label} {shape} ({path})", ours, w.sum, device, refs)
        if name in MODELOPT_SEARCH:
            rows += _modelopt_rows(name, spec, w, x, device)
    return rows
