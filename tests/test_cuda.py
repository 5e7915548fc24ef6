"""The streamed calibration on a GPU: the model, the hooks' rows, the observers' state and the
kept sample all stay on the device, and the qparams are those of the CPU run (min-max exactly up
to the float differences of the two devices' kernels). Runs where torch sees a CUDA device."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from lab.analyse.pipeline import RunConfig, analyse
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
