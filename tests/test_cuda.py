"""The streamed calibration on a GPU: the model, the hooks' rows, the observers' state and the
kept sample all stay on the device, and the qparams are those of the CPU run (min-max exactly up
to the float differences of the two devices' kernels). Runs where torch sees a CUDA device."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from bench.bench_float_grid import user_search
from bench.common import llm_weight
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from sample_models import open_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LAYERS = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]


@pytest.mark.parametrize("sequential", [False, True])
def test_streamed_calibration_on_cuda_matches_the_cpu(sequential):
    spec = ob.QuantSpec("int8")
    config = RunConfig(
        specs={"weight": spec, "input": spec, "kv": ob.QuantSpec("fp8_e4m3")},
        observers=("minmax", "moving_average_minmax", "percentile", "mse_grid"),
        samples=16,
        seq_len=32,
        sequential=sequential,
    )
    block = ["model.layers.1.self_attn"]
    on_gpu = analyse(open_model("tiny-llama", device="cuda"), LAYERS, config, attention=block)
    on_cpu = analyse(open_model("tiny-llama"), LAYERS, config, attention=block)
    for gpu, cpu in zip(on_gpu.entries, on_cpu.entries, strict=True):
        assert gpu.data.device.type == "cuda" and gpu.shape == cpu.shape
        for a, b in zip(gpu.results, cpu.results, strict=True):
            assert a.error is None, (gpu.layer, gpu.tensor, a.name, a.error)
            assert a.qparams.scale.device.type == "cuda"
            torch.testing.assert_close(a.qparams.scale.cpu(), b.qparams.scale, rtol=2e-3, atol=1e-6)


FLOAT_SEARCHES = [
    ("mse_grid", ob.QuantSpec("nvfp4")),
    ("mse_grid", ob.QuantSpec("fp8_e4m3", strategy="channel")),
    ("mse_grid", ob.QuantSpec("mxfp4")),
    ("nvfp4_expanded_mse", ob.QuantSpec("nvfp4")),
    ("nvfp4_expanded_imatrix", ob.QuantSpec("nvfp4")),
    ("imatrix_mse", ob.QuantSpec("fp8_e4m3", strategy="channel")),
    ("nvfp4_fp8_sweep", ob.QuantSpec("nvfp4")),
    ("modelopt_mse", ob.QuantSpec("nvfp4")),
    ("local_hessian", ob.QuantSpec("nvfp4")),
]


@pytest.mark.parametrize(("name", "spec"), FLOAT_SEARCHES, ids=lambda v: getattr(v, "dtype", v))
def test_float_searches_on_cuda_pick_what_the_cpu_kernels_pick(name, spec):
    """Issue 26: on a GPU every float search runs its eager torch path on the device (the native
    kernels serve the CPU); it must pick the CPU kernels' scales, up to groups whose two best
    candidates tie to float noise, and keep its results on the device."""
    w = llm_weight(256, 1024)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)) * 0.1
    on_cpu = user_search(name, spec, w, x)()
    on_gpu = user_search(name, spec, w.cuda(), x.cuda())()
    assert on_gpu.scale.device.type == "cuda"
    same = on_gpu.scale.cpu() == on_cpu.scale
    assert same.float().mean() >= 0.999, (name, float(same.float().mean()))
    if on_cpu.global_scale is not None:
        torch.testing.assert_close(on_gpu.global_scale.cpu(), on_cpu.global_scale)
