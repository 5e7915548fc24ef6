"""Distribution-based observers: mse_grid, entropy and histogram against their references.

References that are not in the project's venv (llm-compressor, ModelOpt) are timed in a separate
interpreter, ``$OBSERVER_LAB_REF_PYTHON`` (default ``.bench-venv/bin/python``, made by
``bench/setup_refs.sh``), that has them installed; the tensor travels through a temporary
file and only the timed call is measured there.
Where that interpreter or package is missing the case says "missing: ..." and times a naive
Python-loop reimplementation instead, labelled as such (never as the reference).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.ao.quantization.observer import HistogramObserver as TaoHistogramObserver

import observers as ob
from bench.common import activation_batches, case, llm_weight, median_seconds
from observers.granularity import flatten, reduce_min_max
from observers.hist_search import kl_divergences

REF_PYTHON = os.environ.get(
    "OBSERVER_LAB_REF_PYTHON", str(Path(__file__).resolve().parent.parent / ".bench-venv" / "bin" / "python")
)

_LC_SCRIPT = """
import sys, time, statistics, torch
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer
w = torch.load(sys.argv[1], weights_only=True)
args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
def run():
    obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=args)
    obs(w)
    return obs.get_qparams()["scale"]
run()
times = []
for _ in range(5):
    t = time.perf_counter(); scale = run(); times.append(time.perf_counter() - t)
torch.save(scale, sys.argv[2])
print(statistics.median(times))
"""

_MO_SCRIPT = """
import sys, time, statistics, torch
from modelopt.torch.quantization.calib.histogram import HistogramCalibrator
x = torch.load(sys.argv[1], weights_only=True)
def run():
    calib = HistogramCalibrator(num_bits=8, axis=None, unsigned=False, num_bins=2048)
    calib.collect(x)
    return float(calib.compute_amax("entropy"))
run()
times = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); amax = run(); times.append(time.perf_counter() - t)
print(statistics.median(times), amax)
"""


def _run_reference(script: str, tensor: torch.Tensor, *extra: str) -> tuple[list[str], Path] | str:
    """Run ``script`` in the reference interpreter; its stdout words and output path, or why not."""
    if not Path(REF_PYTHON).exists():
        return f"missing: no reference interpreter at {REF_PYTHON}"
    workdir = Path(tempfile.mkdtemp(prefix="obslab_bench_"))
    inp, out = workdir / "in.pt", workdir / "out.pt"
    torch.save(tensor.cpu(), inp)
    # Same thread count as ours, so the comparison is fair on a shared machine.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [REF_PYTHON, "-c", script, str(inp), str(out), *extra], capture_output=True, text=True, timeout=1800, env=env
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        return f"missing: reference failed ({last[:120]})"
    return proc.stdout.split(), out


def _naive_lc_loop(w: torch.Tensor, spec: ob.QuantSpec) -> torch.Tensor:
    """llm-compressor's memoryless_mse algorithm as a plain loop over candidates (our qparams/quantize)."""
    flat = flatten(w, spec, "weight")
    low, high = reduce_min_max(flat)
    best = torch.full_like(low, torch.finfo(torch.float32).max)
    best_min, best_max = low.clone(), high.clone()
    stale = 0
    for i in range(20):
        p = 1 - i / 100
        qp = ob.calculate_qparams(low * p, high * p, spec)
        err = (ob.fake_quantize(w, qp, spec) - w).abs().pow(2.4)
        err = flatten(err, spec, "weight").data.sum(dim=(0, -1))
        improved = err < best
        if bool(improved.any()):
            best[improved] = err[improved]
            best_min[improved] = (low * p)[improved]
            best_max[improved] = (high * p)[improved]
            stale = 0
        else:
            stale += 1
            if stale >= 5:
                break
    return ob.calculate_qparams(best_min, best_max, spec).scale


def _mse_grid_case(device: str) -> dict:
    w = llm_weight(4096, 4096, device)
    spec = ob.QuantSpec("int4", strategy="group", group_size=128)

    def ours() -> torch.Tensor:
        obs = ob.create("mse_grid", spec)
        obs.observe(w)
        return obs.qparams().scale

    ours_s = median_seconds(ours, device)
    scale = ours()
    floor = median_seconds(lambda: w.clone(), device)
    name = "mse_grid int4 g128 4096x4096"
    ref = _run_reference(_LC_SCRIPT, w)
    if isinstance(ref, str):
        naive_s = median_seconds(lambda: _naive_lc_loop(w, spec), device)
        same = float((_naive_lc_loop(w, spec) == scale).double().mean())
        return case(name, ours_s, naive_s, f"{ref}; timed naive Python loop (ours)", floor, f"identical {same:.4%}")
    words, out = ref
    lc_scale = torch.load(out, weights_only=True).to(scale.device).reshape(scale.shape)
    same = float((lc_scale == scale).double().mean())
    rel = float(((lc_scale - scale).abs() / scale).max())
    return case(
        name,
        ours_s,
        float(words[-1]),
        "llm-compressor memoryless_mse (CPU eager)",
        floor,
        f"identical scales in {same:.4%} of groups, max rel diff {rel:.2e}",
    )


def _naive_entropy_loop(counts: torch.Tensor, quant_bins: int = 128, start_bin: int = 128) -> int:
    """ModelOpt's entropy rule written as a loop over candidates and bins (our reimplementation)."""
    bins = counts.double().tolist()
    bins[0] = bins[1]
    best, best_i = math.inf, start_bin
    for i in range(start_bin, len(bins) + 1):
        merged, members = [0.0] * quant_bins, [0] * quant_bins
        for b in range(i):
            if bins[b] > 0:
                merged[b * quant_bins // i] += bins[b]
                members[b * quant_bins // i] += 1
        p = bins[:i]
        p[-1] += sum(bins[i:])
        total_p, total_q = sum(p), sum(merged)
        kl = 0.0
        for b in range(i):
            if p[b] > 0:
                run = b * quant_bins // i
                q = merged[run] / members[run] / total_q if members[run] else 0.0
                kl = math.inf if q == 0 else kl + p[b] / total_p * math.log(p[b] / total_p / q)
        if kl < best:
            best, best_i = kl, i
    return best_i


def _entropy_case(device: str) -> list[dict]:
    x = activation_batches(1, 1024, 4096, device)[0]
    spec = ob.QuantSpec("int8")

    def ours() -> float:
        obs = ob.create("entropy", spec, kind="activation")
        obs.observe(x)
        qp = obs.qparams()
        return max(-float(qp.min_val), float(qp.max_val))

    ours_s = median_seconds(ours, device)
    amax = ours()
    floor = median_seconds(lambda: x.sum(), device)
    rows = []
    ref = _run_reference(_MO_SCRIPT, x, "5")
    name = "entropy int8 4M activation"
    if isinstance(ref, str):
        rows.append(case(name, ours_s, None, ref, floor, ""))
    else:
        words, _ = ref
        mo_s, mo_amax = float(words[-2]), float(words[-1])
        rows.append(
            case(name, ours_s, mo_s, "ModelOpt HistogramCalibrator entropy", floor, f"amax {amax:.5g} vs {mo_amax:.5g}")
        )
    obs = ob.create("entropy", spec, kind="activation")
    obs.observe(x)
    counts = obs.hist.counts[:1].cpu()
    kl_s = median_seconds(lambda: kl_divergences(counts, 128, 128, 1), "cpu")
    naive_s = median_seconds(lambda: _naive_entropy_loop(counts[0]), "cpu", repeats=5)
    cand, kl = kl_divergences(torch.cat([counts[:, 1:2], counts[:, 1:]], dim=1), 128, 128, 1)
    agree = int(cand[kl.argmin()]) == _naive_entropy_loop(counts[0])
    rows.append(
        case(
            "entropy KL search only (2048 bins)",
            kl_s,
            naive_s,
            "naive Python loop (our reimplementation of ModelOpt's rule)",
            None,
            f"same end bin: {agree}",
        )
    )
    return rows


def _histogram_case(device: str) -> dict:
    batches = activation_batches(8, 1024, 4096, device, growth=1.3)
    spec = ob.QuantSpec("uint8", symmetric=False)

    def ours() -> ob.QParams:
        obs = ob.create("histogram", spec, kind="activation")
        for b in batches:
            obs.observe(b)
        return obs.qparams()

    def torch_ao():
        tao = TaoHistogramObserver().to(device)
        for b in batches:
            tao(b)
        return tao.calculate_qparams()

    ours_s = median_seconds(ours, device)
    tao_s = median_seconds(torch_ao, device)
    floor = median_seconds(lambda: [b.sum() for b in batches], device)
    qp = ours()
    tao_scale, _ = torch_ao()
    return case(
        "histogram observe+qparams 8x4M growing range",
        ours_s,
        tao_s,
        "torch.ao HistogramObserver",
        floor,
        f"scale ratio ours/torch.ao {float(qp.scale) / float(tao_scale):.3f}",
    )


def cases(device: str = "cpu") -> list[dict]:
    return [_mse_grid_case(device), *_entropy_case(device), _histogram_case(device)]


if __name__ == "__main__":
    for row in cases("cuda" if torch.cuda.is_available() else "cpu"):
        print(json.dumps(row))
