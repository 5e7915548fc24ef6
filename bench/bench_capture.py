"""Benchmark: capturing the inputs of every Linear layer of MiniLM costs how much more than a plain
forward pass over the same batch? Target: ratio <= 2.

    python -m bench.bench_capture [--device cpu|cuda|auto] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench.common import SETTINGS, case
from lab.vocab import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from sample_models import builtin_texts, open_model
from sample_models.calibration import make_batches, token_windows

SAMPLES = DEFAULT_SAMPLES
SEQ_LEN = DEFAULT_SEQ_LEN
BATCH_SIZE = 8


def _median_seconds(runs: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median wall time of each run after one untimed warm-up, the runs interleaved so that a
    change in machine load affects them alike; CUDA is synchronized before each clock read."""

    def timed(run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for run in runs.values():
        timed(run)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(timed(run))
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_capture(device: str = "cpu", repeats: int = 5) -> dict[str, float]:
    """Time ``capture`` of all Linear inputs of MiniLM over 32 x 128 tokens against one plain
    forward pass over the same batches; returns capture_s, forward_s, ratio (medians)."""
    model = open_model("minilm", device=device)
    names = [info.name for info in model.layers() if info.type == "Linear"]
    texts = [" ".join(builtin_texts())]  # one long text: every window is a full SEQ_LEN tokens
    module = model.module()
    tokenizer = model.tokenizer()
    batches = make_batches(tokenizer, token_windows(tokenizer, texts, SAMPLES, SEQ_LEN), BATCH_SIZE, model.device)

    def forward() -> None:
        with torch.no_grad():
            for input_ids, attention_mask in batches:
                module(input_ids=input_ids, attention_mask=attention_mask)

    def capture() -> None:
        model.capture(names, texts=texts, samples=SAMPLES, seq_len=SEQ_LEN, batch_size=BATCH_SIZE)

    medians = _median_seconds({"forward_s": forward, "capture_s": capture}, model.device, repeats)
    return {**medians, "ratio": medians["capture_s"] / medians["forward_s"]}


def cases(device: str = "cpu") -> list[dict]:
    """The capture case as a row of the ``python -m bench`` table (floor: the plain forward)."""
    result = bench_capture(device, SETTINGS.repeats)
    return [
        case(
            f"capture all Linear inputs, MiniLM {SAMPLES}x{SEQ_LEN} tokens",
            result["capture_s"],
            None,
            "",
            result["forward_s"],
            f"floor = one plain forward; target <= 2x: {'met' if result['ratio'] <= 2 else 'not met'}",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = bench_capture(args.device, args.repeats)
    print(
        f"MiniLM, {SAMPLES} samples x {SEQ_LEN} tokens, all Linear inputs on {args.device}: "
        f"capture {result['capture_s']:.3f} s, forward {result['forward_s']:.3f} s, ratio {result['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
