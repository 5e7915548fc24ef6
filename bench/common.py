"""Timing, reference loading and test-tensor helpers shared by the benchmark modules.

Every case times ours, its memory-bandwidth floor and each reference interleaved in one process on
the very same tensor objects (so a change in machine load hits them alike), and checks that the
answers agree. A reference that is not installed gives a ``missing: <package> not installed`` row.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch


@dataclass
class Settings:
    """Run-wide settings: ``--quick`` shrinks the tensors and takes 2 repeats instead of 5."""

    quick: bool = False

    @property
    def repeats(self) -> int:
        return 2 if self.quick else 5


SETTINGS = Settings()

# The pip distribution behind each importable reference, for "missing: <package> not installed".
PACKAGES = {"llmcompressor": "llmcompressor", "modelopt": "nvidia-modelopt", "quark": "amd-quark"}


def rows_for(rows: int) -> int:
    """Rows of a benchmark weight: the full size, or 1/16 of it with ``--quick`` (columns are kept,
    so group and block sizes still divide them)."""
    return max(16, rows // 16) if SETTINGS.quick else rows


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], object], device: str | torch.device = "cpu", repeats: int | None = None, warmup: int = 1
) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs, synchronized on CUDA."""
    return interleaved_medians({"fn": fn}, device, repeats, warmup)["fn"]


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    device: str | torch.device = "cpu",
    repeats: int | None = None,
    warmup: int = 1,
    slow_s: float = 3.0,
) -> dict[str, float]:
    """Median wall time of each function, the runs interleaved (ours, floor, reference, ours, ...)
    so that load from other processes affects all alike. A function whose warm-up took longer than
    ``slow_s`` gets 3 timed runs instead of ``repeats`` (a 10 s reference needs no 5 runs to be
    told apart from a 1 s one). CUDA is synchronized before every clock read."""
    repeats = SETTINGS.repeats if repeats is None else repeats

    def timed(fn: Callable[[], object]) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    wanted = {}
    for name, fn in fns.items():
        first = max((timed(fn) for _ in range(warmup)), default=0.0)
        wanted[name] = min(repeats, 3) if first > slow_s else repeats
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(max(wanted.values(), default=0)):
        for name, fn in fns.items():
            if i < wanted[name]:
                samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


@functools.cache
def reference(module: str) -> ModuleType | str:
    """Import a reference package's ``module`` in this process, or say why not: ``missing:
    <package> not installed`` or ``missing: <package> failed to import (<error>)``. Whatever the
    reference prints while importing (Quark logs its kernel build) goes to stderr, not the table."""
    top = module.split(".")[0]
    package = PACKAGES.get(top, top)
    if importlib.util.find_spec(top) is None:
        return f"missing: {package} not installed"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure means the reference cannot run here
        return f"missing: {package} failed to import ({type(error).__name__}: {str(error)[:100]})"


def version(distribution: str) -> str:
    """Installed version of a pip distribution, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True)
class Ref:
    """One reference for a case: what it is, how to run it on the case's tensors, and how to
    compare its answer with ours. ``run=None`` (with ``missing`` saying why) when it cannot run."""

    label: str
    run: Callable[[], object] | None
    agree: Callable[[object, object], str] = lambda ours, theirs: ""
    missing: str = ""


def ref_or_missing(label: str, module: str, build: Callable[[ModuleType], Callable[[], object]], agree=None) -> Ref:
    """A Ref whose runner is built from the imported reference ``module``, or a missing one."""
    loaded = reference(module)
    if isinstance(loaded, str):
        return Ref(label, None, missing=loaded)
    return Ref(label, build(loaded), agree or (lambda ours, theirs: ""))


def measure(
    name: str,
    ours: Callable[[], object],
    floor: Callable[[], object] | None,
    device: str,
    refs: Sequence[Ref] = (),
    note: Callable[[object], str] | None = None,
) -> list[dict]:
    """Rows for one case: ``ours``, its ``floor`` and every runnable reference timed interleaved;
    one row per reference (ours' time repeated), or a single row when there is none. A reference
    that raises is reported as failed with its error, never timed."""
    ours_out = ours()
    fns: dict[str, Callable[[], object]] = {"ours": ours}
    if floor is not None:
        fns["floor"] = floor
    outcome: dict[int, tuple[object, str]] = {}
    for i, ref in enumerate(refs):
        if ref.run is None:
            continue
        try:
            theirs = ref.run()
            outcome[i] = (theirs, ref.agree(ours_out, theirs))
            fns[f"ref{i}"] = ref.run
        except Exception as error:  # noqa: BLE001 - a broken reference is a row, not a crash
            outcome[i] = (None, f"reference failed: {type(error).__name__}: {str(error)[:120]}")
    times = interleaved_medians(fns, device)
    floor_s = times.get("floor")
    own_note = note(ours_out) if note else ""
    if not refs:
        return [case(name, times["ours"], floor_s=floor_s, agreement=own_note)]
    rows = []
    for i, ref in enumerate(refs):
        if ref.run is None:
            rows.append(case(name, times["ours"], None, f"{ref.missing} ({ref.label})", floor_s, own_note))
            continue
        _, text = outcome[i]
        agreement = "; ".join(part for part in (text, own_note) if part)
        rows.append(case(name, times["ours"], times.get(f"ref{i}"), ref.label, floor_s, agreement))
    return rows


def observe(name: str, x: torch.Tensor, spec, kind: str = "weight", **knobs):
    """Our observer ``name`` on ``x``: create, observe once, qparams (what a user's call costs)."""
    import observers as ob

    obs = ob.create(name, spec, kind=kind, **knobs)
    obs.observe(x)
    return obs.qparams()


def max_rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest relative difference between two scale tensors of the same number of elements."""
    a, b = ours.detach().flatten().double().cpu(), theirs.detach().flatten().double().cpu()
    if a.numel() != b.numel():
        raise ValueError(f"cannot compare {a.numel()} scales with {b.numel()}")
    return float(((a - b).abs() / b.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())


def scales_agree(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    """Agreement text for two scale tensors: share identical and the largest relative difference."""
    a, b = ours.detach().flatten().cpu().float(), theirs.detach().flatten().cpu().float()
    if a.numel() == 1:
        return f"scale {float(a):.6g} vs {float(b):.6g} (rel diff {max_rel_diff(a, b):.1e})"
    same = float((a == b).double().mean())
    return f"identical scales {same:.4%}, max rel diff {max_rel_diff(a, b):.1e}"


def elements_agree(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    """Agreement text for two fake-quantized tensors: how many elements differ."""
    differing = int((ours != theirs.to(ours.dtype)).sum())
    return "identical" if differing == 0 else f"{differing} of {ours.numel()} elements differ"


def llm_weight(rows: int, cols: int, device: str = "cpu", seed: int = 0, outlier_channels: int = 8) -> torch.Tensor:
    """A synthetic LLM-shaped weight: Gaussian, a few input channels ×20 (outlier channels) and
    heavy-tailed rows (Student-t), like the weights of real decoder layers. Deterministic: the
    Student-t draw (which takes no generator) runs under a forked, seeded global RNG."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    channels = torch.randperm(cols, generator=g)[:outlier_channels]
    w[:, channels] *= 20
    heavy_rows = torch.randperm(rows, generator=g)[: max(1, rows // 64)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        w[heavy_rows] = torch.distributions.StudentT(3.0).sample((len(heavy_rows), cols)) * 0.02
    return w.to(device)


def activation_batches(
    batches: int, tokens: int, hidden: int, device: str = "cpu", seed: int = 0, growth: float = 1.0
) -> list[torch.Tensor]:
    """Calibration-like activations with massive-activation channels; ``growth`` > 1 makes each
    batch's range larger than the last (the case where running histograms must re-bin)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batches):
        x = torch.randn(tokens, hidden, generator=g)
        x[:, :4] *= 30
        out.append((x * growth**i).to(device))
    return out


def case(
    name: str,
    ours_s: float,
    reference_s: float | None = None,
    reference: str = "",
    floor_s: float | None = None,
    agreement: str = "",
) -> dict:
    """One row of the benchmark table."""
    return {
        "case": name,
        "ours_s": ours_s,
        "reference_s": reference_s,
        "reference": reference,
        "floor_s": floor_s,
        "agreement": agreement,
    }


# A fresh process running ``python -m observers ARGS...`` (this script's arguments), watched for its peak
# RSS: prints ``{"peak": bytes, "code": exit code}``.
PEAK_CLI = """
import json, subprocess, sys, threading, time
import psutil
process = subprocess.Popen([sys.executable, "-m", "observers", *sys.argv[1:]])
watched, peak = psutil.Process(process.pid), 0
while process.poll() is None:
    try:
        peak = max(peak, watched.memory_info().rss)
    except psutil.Error:
        break
    time.sleep(0.02)
print(json.dumps({"peak": peak, "code": process.returncode}))
"""


def import_rss(env: dict) -> int:
    """The RSS of a process that has imported what the CLI imports (the baseline of its peak)."""
    code = "import psutil, lab.cli, sample_models, transformers; print(psutil.Process().memory_info().rss)"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.strip())
