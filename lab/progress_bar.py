"""The CLI's progress bar: one terminal line a long run redraws, with the time left."""

from __future__ import annotations

import time
from typing import IO, Any

BAR_WIDTH = 30


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class ProgressBar:
    """A plain-text progress bar on one terminal line:
    ``[#####.....] 12/40 layers 0:01:05 ETA 0:03:10 label``. The ETA extrapolates the rate since
    the first call, so a resumed sweep's already-done layers do not make it look fast."""

    def __init__(self, stream: IO[str], unit: str = "", clock: Any = time.monotonic) -> None:
        self.stream = stream
        self.unit = f" {unit}" if unit else ""
        self.clock = clock
        self.start: tuple[float, int] | None = None

    def __call__(self, done: int, total: int, label: str) -> None:
        now = self.clock()
        if self.start is None:
            self.start = (now, done)
        began, first = self.start
        elapsed = now - began
        eta = _clock(elapsed / (done - first) * (total - done)) if done > first else "-:--:--"
        filled = BAR_WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        end = "\n" if done >= total else ""
        timing = f"{_clock(elapsed)} ETA {eta}"
        self.stream.write(f"\r[{bar}] {done}/{total}{self.unit} {timing} {label[:60]:<60}{end}")
        self.stream.flush()
