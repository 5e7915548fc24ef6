"""Benchmark: sequential (block-by-block) calibration against a whole-model capture of the same layers
over the same batches. Targets: time <= 1.3x the whole-model capture where the model fits, and peak
RSS growth <= 1.5x (largest unit of weights + hidden states), the unit being a block or a module
outside the blocks (the embedding, for the small models here).

The large case writes a 4.4 GB Llama-shaped fp32 checkpoint (TinyLlama-1.1B shapes, random
weights) once under ``OBSERVER_LAB_BENCH_CACHE`` (default ``~/.cache/observer-lab``; about a
minute, then reused) and times a cold open-and-capture both ways, with peak RSS. It needs about
9 GB of free disk and memory, so ``--quick`` or ``OBSERVER_LAB_BENCH_LARGE=0`` skip it.

    python -m bench --only sequential [--quick]
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from transformers import LlamaConfig

from bench.common import SETTINGS, case, interleaved_medians
from lab.vocab import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from sample_models import builtin_texts, open_model
from sample_models.synthetic import write_llama_checkpoint

SOURCES = ("tiny-llama", "minilm")
TIME_TARGET = 1.3
RSS_TARGET = 1.5
LARGE_FLAG = "OBSERVER_LAB_BENCH_LARGE"
CACHE_FLAG = "OBSERVER_LAB_BENCH_CACHE"
LARGE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    pad_token_id=0,
)
LARGE_CASE = "sequential capture, 4.4 GB Llama-shaped checkpoint (cold open + capture)"
LARGE_MAX_MEMORY = 1 << 30
MiB = 2**20


class PeakRss(threading.Thread):
    """Samples this process's resident memory every 2 ms until ``growth()`` stops it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process()
        self.start_rss = self.peak = self.process.memory_info().rss
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def growth(self) -> int:
        """Peak RSS minus RSS at the start, in bytes."""
        self.done.set()
        self.join()
        return self.peak - self.start_rss


def _calibration() -> dict:
    samples, seq_len = (8, 64) if SETTINGS.quick else (DEFAULT_SAMPLES, DEFAULT_SEQ_LEN)
    return {"texts": [" ".join(builtin_texts())], "samples": samples, "seq_len": seq_len}


def _linear_layers(model) -> list[str]:
    return [info.name for info in model.layers() if info.type == "Linear"]


def _max_difference(whole, sequential) -> float:
    return max(float((whole[name] - sequential[name]).abs().max()) for name in whole)


def _time_row(source: str, device: str) -> dict:
    """Sequential vs whole-model capture of every Linear input, timed interleaved (the whole model
    is loaded by its first run and stays loaded, as in the app)."""
    model = open_model(source, device=device)
    names, calibration = _linear_layers(model), _calibration()
    runs: dict[str, Callable[[], object]] = {
        "sequential": lambda: model.capture(names, sequential=True, **calibration),
        "whole": lambda: model.capture(names, sequential=False, **calibration),
    }
    difference = _max_difference(runs["whole"](), runs["sequential"]())
    times = interleaved_medians(runs, device)
    ratio = times["sequential"] / times["whole"]
    met = "met" if ratio <= TIME_TARGET else "not met"
    tokens = f"{calibration['samples']}x{calibration['seq_len']}"
    return case(
        f"sequential capture, {len(names)} Linear inputs, {source} {tokens} tokens",
        times["sequential"],
        floor_s=times["whole"],
        agreement=f"floor = whole-model capture; time target <= {TIME_TARGET}x: {met}; max abs diff {difference:.1e}",
    )


def _rss_row(source: str, device: str) -> dict:
    """Peak RSS growth of a sequential capture of one layer (so that the result is negligible)
    against the target, for the first run and a warm one; the target is judged on the warm run,
    because the first also pays one-off costs (the skeleton, the allocator's heap growing: glibc
    keeps freed memory for reuse). Run before the timing rows so that the first run is first."""
    model = open_model(source, device=device)
    name = _linear_layers(model)[-2]
    growths, seconds = [], 0.0
    for _ in range(2):
        sampler = PeakRss()
        start = time.perf_counter()
        model.capture([name], sequential=True, **_calibration())
        seconds = time.perf_counter() - start
        growths.append(sampler.growth())
    stats = model.last_sequential
    target = RSS_TARGET * (stats.largest_unit[1] + 2 * stats.hidden_bytes)
    met = "met" if growths[1] <= target else "not met"
    return case(
        f"sequential peak RSS, {source}, one layer",
        seconds,
        agreement=f"RSS +{growths[0] / MiB:.1f} MiB first run, +{growths[1] / MiB:.1f} MiB warm; target "
        f"{target / MiB:.1f} MiB = 1.5x (largest unit {stats.largest_unit[0]} {stats.largest_unit[1] / MiB:.1f} "
        f"MiB + hidden states in and out {2 * stats.hidden_bytes / MiB:.1f} MiB), warm run: {met}; weights peak "
        f"{stats.peak_weight_bytes / MiB:.1f} MiB",
    )


def large_checkpoint() -> Path:
    """The large checkpoint, written on first use; a marker file tells a finished one from a torn one."""
    directory = Path(os.environ.get(CACHE_FLAG, "~/.cache/observer-lab")).expanduser() / "bench-llama-4g"
    marker = directory / "complete"
    if not marker.is_file():
        write_llama_checkpoint(directory, LlamaConfig(**LARGE))
        marker.write_text("ok\n")
    return directory


def _cold_capture(directory: Path, device: str, names: list[str], **knobs) -> tuple[float, int, object]:
    """Open the checkpoint and capture: seconds, peak RSS growth and the model."""
    sampler = PeakRss()
    start = time.perf_counter()
    model = open_model(directory, device=device)
    model.capture(names, samples=4, seq_len=128, **knobs)
    return time.perf_counter() - start, sampler.growth(), model


def _large_rows(device: str) -> list[dict]:
    if SETTINGS.quick or os.environ.get(LARGE_FLAG) == "0":
        return [case(LARGE_CASE, 0.0, agreement=f"skipped (--quick or {LARGE_FLAG}=0)")]
    directory = large_checkpoint()
    names = [f"model.layers.{i}.mlp.down_proj" for i in (0, 10, 21)]
    seconds, growth, model = _cold_capture(directory, device, names, sequential=True, max_memory=LARGE_MAX_MEMORY)
    stats = model.last_sequential
    whole_s, whole_growth, _ = _cold_capture(directory, device, names, sequential=False)
    ratio = seconds / whole_s
    return [
        case(
            LARGE_CASE,
            seconds,
            floor_s=whole_s,
            agreement=f"floor = whole-model open + capture; time target <= {TIME_TARGET}x: "
            f"{'met' if ratio <= TIME_TARGET else 'not met'}; RSS +{growth / MiB:.0f} MiB vs +{whole_growth / MiB:.0f} "
            f"MiB whole; weights peak {stats.peak_weight_bytes / MiB:.0f} MiB",
        )
    ]


def cases(device: str = "cpu") -> list[dict]:
    rows = [_rss_row(source, device) for source in SOURCES]
    rows += [_time_row(source, device) for source in SOURCES]
    return rows + _large_rows(device)
