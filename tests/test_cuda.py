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
from observers.gptq import gptq_quantize, gptq_quantize_fixed, layer_output_error
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


def _observer_fn(spec: ob.QuantSpec, name: str):
    def qparams(w: torch.Tensor) -> ob.QParams:
        observer = ob.create(name, spec, kind="weight")
        observer.observe(w)
        return observer.qparams()

    return qparams


def _layer_and_hessian(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An LLM-shaped weight and a Hessian of correlated inputs, made on the CPU and moved."""
    generator = torch.Generator().manual_seed(0)
    weight = llm_weight(256, 1024)
    mixing = torch.randn(1024, 1024, generator=generator) / 32
    rows = torch.randn(4096, 1024, generator=generator) @ mixing
    return weight.to(device), ob.gptq.hessian_of_rows(rows).to(device)


@pytest.mark.parametrize("scales", ["fixed", "refit"])
def test_gptq_on_cuda_matches_the_cpu(scales):
    """GPTQ's sweep on the GPU (its Cholesky and updates in the GPU's float order) gives the CPU's
    codes up to rounding ties that the last bits decide, and the same layer-output error."""
    spec = ob.QuantSpec("int4", strategy="group", group_size=128)
    found = {}
    for device in ("cpu", "cuda"):
        weight, hessian = _layer_and_hessian(device)
        found[device] = (
            gptq_quantize(weight, hessian, spec, _observer_fn(spec, "minmax"), actorder="weight", scales=scales),
            weight,
            hessian,
        )
    (cpu, weight, hessian), (gpu, _, _) = found["cpu"], found["cuda"]
    assert gpu.weight.device.type == "cuda"
    same = (gpu.codes.cpu() == cpu.codes).float().mean().item()
    assert same >= 0.99, same
    errors = [layer_output_error(weight, r.weight.cpu(), hessian) for r in (cpu, gpu)]
    assert errors[1] == pytest.approx(errors[0], rel=0.02)


def test_stacked_gptq_on_cuda_is_each_observers_own():
    """``gptq_quantize_fixed`` sweeps several observers' copies at once on the GPU: each one's codes
    are those of its own ``gptq_quantize`` on the GPU."""
    spec = ob.QuantSpec("int4", strategy="group", group_size=128)
    weight, hessian = _layer_and_hessian("cuda")
    names = ("minmax", "mse_grid", "imatrix_mse")
    together = gptq_quantize_fixed(weight, hessian, spec, [_observer_fn(spec, n) for n in names], actorder="weight")
    for name, stacked in zip(names, together, strict=True):
        alone = gptq_quantize(weight, hessian, spec, _observer_fn(spec, name), actorder="weight")
        assert (stacked.codes == alone.codes).float().mean().item() >= 0.999, name


def test_allocation_on_cuda_matches_the_cpu(tmp_path):
    """``allocate --device cuda`` scores, solves and measures on the GPU: the same layers' scores
    as the CPU's within the devices' float differences, the budget kept, and the JSON written."""
    import json

    from lab.cli import main

    found = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.json"
        code = main(
            ["allocate", "tiny-llama", "--layers", "model.layers.1.*", "--schemes", "W4A16,FP8,none",
             "--budget", "7", "--budgets", "6,8", "--observers", "minmax,mse_grid", "--samples", "8",
             "--held-out-samples", "8", "--device", device, "--out", str(out), "--quiet"]
        )  # fmt: skip
        assert code == 0
        found[device] = json.loads(out.read_text())["config"]["allocation"]
    cpu, gpu = found["cpu"], found["cuda"]
    assert gpu["bits_per_weight"] <= 7
    for a, b in zip(cpu["frontier"]["uniform"], gpu["frontier"]["uniform"], strict=True):
        assert a["name"] == b["name"]
        assert b["measured"]["kl"] == pytest.approx(a["measured"]["kl"], rel=0.05, abs=1e-6)
        assert b["in_sample"]["kl"] == pytest.approx(a["in_sample"]["kl"], rel=0.05, abs=1e-6)
        assert b["predicted"] == pytest.approx(a["predicted"], rel=0.05, abs=1e-6)


def test_encoder_metrics_on_cuda_are_the_cpus():
    """An encoder's model-level metrics (cosine, the Spearman of pairwise similarities) computed
    from embeddings on the GPU: the CPU's figures."""
    from lab.effect.metrics import encoder_metrics

    generator = torch.Generator().manual_seed(0)
    clean = [torch.randn(8, 32, generator=generator) for _ in range(3)]
    noisy = [x + 0.1 * torch.randn(x.shape, generator=generator) for x in clean]
    on_cpu = encoder_metrics(clean, noisy)
    on_gpu = encoder_metrics([x.cuda() for x in clean], [x.cuda() for x in noisy])
    assert on_gpu["cosine"] == pytest.approx(on_cpu["cosine"], rel=1e-6)
    assert on_gpu["spearman"] == pytest.approx(on_cpu["spearman"], rel=1e-9)
