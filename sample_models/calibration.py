"""Calibration data: the built-in texts, tokenization into padded batches, and the choice of
which real tokens to keep when a capture would exceed its memory budget."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

TEXTS_FILE = Path(__file__).with_name("calibration_texts.json")
SUBSAMPLE_SEED = 0


class CaptureSubsampledWarning(UserWarning):
    """A capture kept only a random subset of tokens to stay within ``max_bytes``."""


@cache
def _builtin_texts() -> tuple[str, ...]:
    return tuple(json.loads(TEXTS_FILE.read_text(encoding="utf-8")))


def builtin_texts() -> list[str]:
    """The shipped calibration paragraphs: prose, code, numbers, dialogue, lists, in a mixed order
    so that any prefix of the list is varied."""
    return list(_builtin_texts())


@dataclass(frozen=True)
class Batch:
    """One padded batch; ``valid`` marks real (non-padding) tokens, ``keep`` those captured."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.attention_mask.bool()


def check_knobs(samples: int, seq_len: int, batch_size: int, max_positions: int | None) -> None:
    """Reject calibration settings that cannot work, before any model is run."""
    for knob, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{knob} must be a positive integer, got {value!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"seq_len={seq_len} exceeds the model's {max_positions} positions")


def token_windows(
    tokenizer: PreTrainedTokenizerBase, texts: list[str] | str | None, samples: int, seq_len: int
) -> list[list[int]]:
    """Token windows of at most ``seq_len`` tokens, long texts split into several windows, first
    ``samples`` windows kept. ``texts=None`` uses the built-in paragraphs."""
    if texts is None:
        texts = builtin_texts()
    elif isinstance(texts, str):
        texts = [texts]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError("calibration texts are empty")
    encoded = tokenizer(texts, truncation=True, max_length=seq_len, return_overflowing_tokens=True)
    return [list(ids) for ids in encoded["input_ids"][:samples]]


def make_batches(
    tokenizer: PreTrainedTokenizerBase, windows: list[list[int]], batch_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask) batches on ``device``."""
    batches = []
    for start in range(0, len(windows), batch_size):
        padded = tokenizer.pad({"input_ids": windows[start : start + batch_size]}, return_tensors="pt")
        batches.append((padded["input_ids"].to(device), padded["attention_mask"].to(device)))
    return batches


def plan_batches(
    batches: list[tuple[torch.Tensor, torch.Tensor]], bytes_per_token: int, max_bytes: int
) -> tuple[list[Batch], float]:
    """Decide which real tokens to capture so that the capture fits in ``max_bytes``.

    When everything fits every real token is kept. Otherwise a seeded random subset of real
    tokens is kept (the same positions for every layer, so inputs and outputs stay aligned) and
    a CaptureSubsampledWarning says so: subsampling beats running out of memory.
    Returns the batches and the kept fraction.
    """
    valid = [mask.bool() for _, mask in batches]
    total = int(sum(int(v.sum()) for v in valid))
    needed = total * bytes_per_token
    if needed <= max_bytes:
        return [Batch(ids, mask, v) for (ids, mask), v in zip(batches, valid, strict=True)], 1.0
    budget_tokens = max_bytes // bytes_per_token
    if budget_tokens < 1:
        raise ValueError(f"max_bytes={max_bytes} is smaller than one token's activations ({bytes_per_token} bytes)")
    warnings.warn(
        f"capturing {total} tokens needs {needed / 2**20:.1f} MiB > max_bytes={max_bytes / 2**20:.1f} MiB; "
        f"keeping a random {budget_tokens} of {total} tokens",
        CaptureSubsampledWarning,
        stacklevel=3,
    )
    keeps = _random_keep(valid, budget_tokens)
    return [Batch(ids, mask, keep) for (ids, mask), keep in zip(batches, keeps, strict=True)], budget_tokens / total


def _random_keep(valid: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    flat = torch.cat([v.reshape(-1).cpu() for v in valid])
    positions = flat.nonzero().squeeze(1)
    generator = torch.Generator().manual_seed(SUBSAMPLE_SEED)
    chosen = positions[torch.randperm(len(positions), generator=generator)[:count]]
    keep = torch.zeros_like(flat)
    keep[chosen] = True
    sizes = [v.numel() for v in valid]
    return [part.reshape(v.shape).to(v.device) for part, v in zip(keep.split(sizes), valid, strict=True)]


def share_of(batches: list[Batch], part: int, parts: int) -> list[Batch]:
    """Part ``part`` of ``parts``: batches ``part``, ``part + parts``, ``part + 2·parts``, … .

    Whole batches, planned before the split, keep every token's activations bit for bit those of
    an unsplit run (a batch's padding, and so its kernels' shapes, do not change) and the sampled
    tokens the same. Dealt out in turn, round ``r`` of the ranks holds batches ``r·parts`` to
    ``r·parts + parts - 1``: the ranks together observe what one process with ``parts`` times the
    batch size observes in its batch ``r`` (``rounds`` says how many rounds there are)."""
    if not (isinstance(parts, int) and isinstance(part, int) and 0 <= part < parts):
        raise ValueError(f"share must be (part, parts) with 0 <= part < parts, got ({part!r}, {parts!r})")
    if len(batches) < parts:
        raise ValueError(
            f"the calibration set makes {len(batches)} batch(es), fewer than the {parts} ranks that split it: "
            "use more samples (or a smaller batch size) or fewer ranks"
        )
    return batches[part::parts]


def rounds(batches: int, parts: int) -> int:
    """Calls of the capture stream on each of ``parts`` ranks that share ``batches`` batches."""
    return -(-batches // parts)
