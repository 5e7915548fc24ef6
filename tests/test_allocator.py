"""The CLI process keeps the memory its tensors free (``lab.allocator``): a tensor the size of one
just freed reuses its pages instead of faulting in fresh ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lab.allocator
import lab.cli
from observers import __main__ as entry

ROOT = Path(__file__).resolve().parents[1]

REFAULTS = """
import resource, sys, torch
from lab.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = torch.ones(16 << 20)  # 64 MiB, over glibc's largest own mmap threshold (32 MiB)
del first
before = faults()
second = torch.ones(12 << 20)  # 48 MiB: fits in what the first left (the same size may not, memalign's padding)
print(kept, faults() - before)
"""


def _refaults(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run(
        [sys.executable, "-c", REFAULTS, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


def test_freed_tensor_memory_is_reused_without_faulting_pages_in_again():
    pages = (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    kept, faults = _refaults("kept")
    if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        assert kept == "False"  # mallopt is glibc's: elsewhere nothing is changed
        return
    assert kept == "True"
    assert faults < pages // 16
    default, faults = _refaults("default")
    assert default == "None"
    assert faults > pages // 2  # glibc's own default maps a block this size afresh: what the setting saves


def test_the_cli_entry_keeps_freed_memory_before_the_lab_is_imported(monkeypatch):
    calls = []
    monkeypatch.setattr(lab.allocator, "keep_freed_memory", lambda: calls.append("kept") or True)
    monkeypatch.setattr(lab.cli, "main", lambda: calls.append("main") or 0)
    assert entry._main() == 0
    assert calls == ["kept", "main"]


def test_keep_freed_memory_says_false_without_glibc(monkeypatch):
    monkeypatch.setattr(os, "confstr", lambda name: None)
    assert lab.allocator.keep_freed_memory() is False
