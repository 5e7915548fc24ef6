"""Distribution-based observers: mse_grid, entropy, histogram, percentile and histogram-mse.

References, all in this process on the same tensors: llm-compressor ``memoryless_mse``, ModelOpt
``HistogramCalibrator`` (entropy, percentile, mse), Quark ``PerTensorPercentileObserver`` and
``PerTensorMSEObserver`` (with Quark's own bins and percentile, ours set to the same knobs), and
torch.ao ``HistogramObserver``.
"""

from __future__ import annotations

import math

import torch

import observers as ob
from bench.common import SETTINGS, activation_batches, case, llm_weight, measure, median_seconds, observe, rows_for
from bench.refs import INT4_G128, lc_observer_ref, modelopt_ref, quark_histogram_ref, tao_histogram_ref
from observers.hist_search import kl_divergences

INT8 = ob.QuantSpec("int8")


def _observe_all(name: str, tensors: list[torch.Tensor], spec: ob.QuantSpec, **knobs) -> ob.QParams:
    obs = ob.create(name, spec, kind="activation", **knobs)
    for t in tensors:
        obs.observe(t)
    return obs.qparams()


def _mse_grid_cases(device: str) -> list[dict]:
    spec = ob.QuantSpec("int4", strategy="group", group_size=128)
    rows = []
    for cols, seed in ((4096, 0), (11008, 1)):
        w = llm_weight(rows_for(4096), cols, device, seed=seed)
        rows += measure(
            f"mse_grid int4 g128 {rows_for(4096)}x{cols}",
            lambda w=w: observe("mse_grid", w, spec),
            w.clone,
            device,
            [lc_observer_ref("memoryless_mse", w, INT4_G128)],
        )
    return rows


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


def _entropy_cases(x: torch.Tensor, device: str) -> list[dict]:
    tokens, hidden = x.shape
    rows = measure(
        f"entropy int8 {tokens}x{hidden} activation",
        lambda: observe("entropy", x, INT8, kind="activation"),
        x.sum,
        device,
        [modelopt_ref("entropy", x)],
    )
    obs = ob.create("entropy", INT8, kind="activation")
    obs.observe(x)
    counts = obs.hist.counts[:1].cpu()
    kl_s = median_seconds(lambda: kl_divergences(counts, 128, 128, 1), "cpu")
    naive_s = median_seconds(lambda: _naive_entropy_loop(counts[0]), "cpu", repeats=min(3, SETTINGS.repeats))
    cand, kl = kl_divergences(torch.cat([counts[:, 1:2], counts[:, 1:]], dim=1), 128, 128, 1)
    agree = int(cand[kl.argmin()]) == _naive_entropy_loop(counts[0])
    rows.append(
        case(
            "entropy KL search only (2048 bins)",
            kl_s,
            naive_s,
            "naive Python loop (our reimplementation of ModelOpt's rule)",
            agreement=f"same end bin: {agree}",
        )
    )
    return rows


def _histogram_case(device: str) -> list[dict]:
    batches = activation_batches(8, rows_for(1024), 4096, device, growth=1.3)
    spec = ob.QuantSpec("uint8", symmetric=False)
    return measure(
        f"histogram observe+qparams 8x{rows_for(1024)}x4096 growing range",
        lambda: _observe_all("histogram", batches, spec),
        lambda: [b.sum() for b in batches],
        device,
        [tao_histogram_ref([batches])],
    )


def _percentile_mse_cases(x: torch.Tensor, device: str) -> list[dict]:
    tokens, hidden = x.shape
    shape = f"{tokens}x{hidden}"
    qmax = ob.QuantSpec("int8", scale_rule="qmax")
    rows = measure(
        f"percentile 99.99 int8 {shape} activation",
        lambda: observe("percentile", x, INT8, kind="activation"),
        x.sum,
        device,
        [modelopt_ref("percentile", x, percentile=99.99)],
    )
    rows += measure(
        f"percentile 99.99999999, 4200 bins (Quark's) int8 {shape}",
        lambda: observe("percentile", x, INT8, kind="activation", percentile=99.99999999, bins=4200),
        x.sum,
        device,
        [quark_histogram_ref("percentile", x)],
    )
    rows += measure(
        f"mse (histogram) start_bin 128, qmax rule (ModelOpt's) int8 {shape}",
        lambda: observe("mse", x, qmax, kind="activation"),
        x.sum,
        device,
        [modelopt_ref("mse", x)],
    )
    rows += measure(
        f"mse (histogram) start_bin 2045 (Quark's) int8 {shape}",
        lambda: observe("mse", x, INT8, kind="activation", start_bin=2045),
        x.sum,
        device,
        [quark_histogram_ref("MSE", x)],
    )
    return rows


def cases(device: str = "cpu") -> list[dict]:
    x = activation_batches(1, rows_for(1024), 4096, device)[0]
    return [
        *_mse_grid_cases(device),
        *_entropy_cases(x, device),
        *_histogram_case(device),
        *_percentile_mse_cases(x, device),
    ]
