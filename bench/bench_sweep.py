"""Whole-model sweeps (``lab.scale.sweep``): what streaming every layer costs, and what a second rank buys.

Throughput: every Linear weight of all-MiniLM-L6-v2 (37 tensors, 10.8M parameters; the first 6
with ``--quick``) swept as ``python -m observers run minilm --layers all --kinds weight --format
int4 --strategy group --group-size 128`` does it (one layer per chunk, records built and fsynced
per layer, the final file assembled), once per observer that takes int4 g128 weights; the
agreement column gives weight elements per second. One timed run each, after the observer ran
once on one layer: a sweep is seconds to minutes, and the figure is a whole-model wall time.

Final write: a weights-only sweep (``run DIR --layers all --kinds weight --format int4 --strategy
group --group-size 128 --observers minmax``) of the generated 4.4 GB Llama checkpoint
(``bench_sequential.large_checkpoint``, TinyLlama-1.1B shapes, 156 weight matrices), and the same
sweep of its first half of blocks: the peak RSS growth (the kernel's high-water mark, reset once
every unit is in the partial file) and the time of turning the partial file into the Observer Lab
file. Skipped with ``--quick`` or ``OBSERVER_LAB_BENCH_LARGE=0``, as the sequential bench's large case.

Ranks: a tiny-llama sweep (weights and inputs, minmax and percentile, 32 samples of 64 tokens)
through ``torchrun --nproc-per-node 1`` and ``2``, the two ranks splitting the layers or the
calibration batches (``--split``), wall time including the launcher and each rank's start (after
one untimed start), on one core budget: each rank gets the torch threads of this process divided
by the ranks (torchrun would give 1 rank all threads, 2 ranks one each). Every file must hold the
qparams of one rank bit for bit (both observers merge exactly). On CPU (gloo) unless the machine
has two GPUs.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import observers as ob
from bench.bench_sequential import LARGE_FLAG, large_checkpoint
from bench.common import SETTINGS, case, median_seconds
from lab.analyse.run_config import RunConfig
from lab.scale.plan import Plan
from lab.scale.sweep import run_sweep
from sample_models import open_model

ROOT = Path(__file__).resolve().parents[1]
GROUP = ob.QuantSpec("int4", strategy="group", group_size=128)
WEIGHT_OBSERVERS = ("minmax", "memoryless_minmax", "moving_average_minmax", "mse_grid", "mse_grid_moving_average")
TINY_LLAMA = ["run", "tiny-llama", "--layers", "all", "--format", "int8", "--observers", "minmax,percentile"]
TINY_LLAMA += ["--kinds", "weight,input", "--samples", "32", "--seq-len", "64", "--quiet"]


def _weight_rows(device: str, folder: Path) -> list[dict]:
    model = open_model("minilm", device=device)
    names = [info.name for info in model.layers() if info.type == "Linear"]
    names = names[:6] if SETTINGS.quick else names
    elements = sum(math.prod(model.layer(name).shape) for name in names)
    rows = []
    for observer in WEIGHT_OBSERVERS:
        plan = Plan(model, tuple(names), RunConfig(specs={"weight": GROUP}, observers=(observer,)))
        out = folder / f"{observer}.json"
        ob.run_one(observer, model.weight(names[0]), GROUP, "weight")  # one-off set-up costs are not the sweep's
        seconds = median_seconds(lambda plan=plan, out=out: run_sweep(plan, out), device, repeats=1, warmup=0)
        label = f"sweep MiniLM {len(names)} Linear weights ({elements / 1e6:.1f}M): {observer} int4 g128"
        rows.append(case(label, seconds, agreement=f"{elements / seconds / 1e6:.2f}M elements/s"))
    return rows


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _final_write(plan: Plan, out: Path) -> tuple[float, int]:
    """Seconds and peak RSS growth of the sweep's final write: the high-water mark is reset when the
    progress says every unit is written (the last call before the final file), read when it is done."""
    mark: dict[str, float] = {}

    def progress(done: int, total: int, label: str) -> None:
        if done == total:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            mark.update(rss=_status_bytes("VmRSS"), start=time.perf_counter())

    run_sweep(plan, out, progress=progress)
    return time.perf_counter() - mark["start"], _status_bytes("VmHWM") - int(mark["rss"])


def _final_write_rows(device: str, folder: Path) -> list[dict]:
    """The final write over half the model's blocks and over all of them: streamed a unit at a
    time, its peak should not grow with the number of layers (issue 32)."""
    label = "final write of a weights-only sweep, generated 4.4 GB Llama, minmax int4 g128"
    if SETTINGS.quick or os.environ.get(LARGE_FLAG) == "0":
        return [case(label, 0.0, agreement=f"skipped (--quick or {LARGE_FLAG}=0)")]
    model = open_model(large_checkpoint(), device=device)
    names = [info.name for info in model.layers() if len(info.shape) >= 2]
    half = [name for name in names if not name.startswith("model.layers.") or int(name.split(".")[2]) < 11]
    rows = []
    for layers in (half, names):
        plan = Plan(model, tuple(layers), RunConfig(specs={"weight": GROUP}, observers=("minmax",)))
        out = folder / f"llama-{len(layers)}.json"
        seconds, growth = _final_write(plan, out)
        note = f"peak RSS +{growth / 2**20:.0f} MiB for a {out.stat().st_size / 1e6:.0f} MB file"
        rows.append(case(f"{label}: {len(layers)} weights", seconds, agreement=note))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(ranks: int, device: str, out: Path, split: str | None = None) -> float:
    """Wall time of the tiny-llama sweep under torchrun with ``ranks`` processes."""
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks)]
    command += ["--master-port", str(_free_port()), "-m", "observers", *TINY_LLAMA, "--device", device]
    command += ["--split", split] if split else []
    threads = str(max(1, torch.get_num_threads() // ranks))  # one core budget for both: ranks x threads
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    start = time.perf_counter()
    subprocess.run([*command, "--out", str(out)], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def _qparams(path: Path) -> list[dict]:
    return [entry["qparams"] for entry in json.loads(path.read_text())["entries"]]


def _rank_rows(device: str, folder: Path) -> list[dict]:
    device = device if device == "cuda" and torch.cuda.device_count() >= 2 else "cpu"
    repeats = 1 if SETTINGS.quick else 3
    _torchrun(1, device, folder / "warm-up.json")  # a cold first start (imports from disk) would skew 1 rank
    runs = {"1 rank": (1, None), "2 ranks, --split layers": (2, "layers"), "2 ranks, --split batches": (2, "batches")}
    times = {}
    for label, (ranks, split) in runs.items():
        files = [folder / f"{ranks}-{split}-{i}.json" for i in range(repeats)]
        times[label] = (sorted(_torchrun(ranks, device, path, split) for path in files)[repeats // 2], files[0])
    one, first_file = times["1 rank"]
    label = f"sweep tiny-llama weights+inputs minmax,percentile 32x64 tokens on {device}"
    rows = [case(f"{label}: torchrun 1 rank", one, agreement="median wall time, launcher included")]
    for name, (seconds, path) in list(times.items())[1:]:
        same = _qparams(first_file) == _qparams(path)
        note = f"{one / seconds:.2f}x vs 1 rank; qparams {'identical' if same else 'DIFFER'}"
        rows.append(case(f"{label}: torchrun {name}", seconds, agreement=note))
    return rows


def cases(device: str = "cpu") -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        return [*_weight_rows(device, folder), *_final_write_rows(device, folder), *_rank_rows(device, folder)]
