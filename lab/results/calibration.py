"""A run's calibration set in words: where it came from, how many samples and tokens, its
fingerprint. One sentence that the Run and Overview pages and the team's run history say alike."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def calibration_text(calibration: Mapping[str, Any] | None, uploads: Mapping[str, str] | None = None) -> str | None:
    """``512 samples, 65,536 tokens from records.jsonl (fingerprint 1a2b3c4d…)`` for an analysis's
    ``calibration`` record (``CalibrationSamples.to_dict``); ``uploads`` names an uploaded file's
    saved path by the name the person's file had. None when nothing was calibrated."""
    if not calibration:
        return None
    source = calibration.get("source") or {}
    kind, location = source.get("kind"), str(source.get("location", ""))
    if kind == "builtin":
        where = "the built-in texts"
    elif kind == "pasted":
        where = "the pasted text"
    elif kind == "hub":
        where = f"hub dataset {location} (split {source.get('split')})"
    elif location and location in (uploads or {}):
        where = f"the uploaded {uploads[location]}"
    else:
        where = Path(location).name or location
    if source.get("shuffle_seed") is not None:
        where += f", shuffled with seed {source['shuffle_seed']}"
    samples, tokens = calibration.get("samples", 0), calibration.get("tokens", 0)
    return (
        f"{samples:,} sample{'' if samples == 1 else 's'}, {tokens:,} tokens from {where} "
        f"(fingerprint {str(calibration.get('fingerprint', ''))[:8]}…)"
    )
