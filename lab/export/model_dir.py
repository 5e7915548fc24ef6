"""A model directory as the lab writes one: staged beside its destination and moved into place
whole, its weight files named (and indexed) as transformers expects, and a notes file that lists
every file the lab wrote, so ``lab_written`` can tell a directory the lab made (and nothing else
put there) from any other: the app replaces only such a directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

NOTES_FILE = "observer_lab_checkpoint.txt"
FILES_HEADER = "files written:"
"""The last section of the notes file: every file the write made."""
INDEX_FILE = "model.safetensors.index.json"


def files_section(files: list[str]) -> list[str]:
    """The notes file's last lines: ``FILES_HEADER`` and every file the write made."""
    return ["", FILES_HEADER, *(f"  {name}" for name in files)]


def lab_written(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint this lab wrote and nothing else: its notes file is
    there and lists every entry of the directory, each a plain file. The app replaces only such a
    directory (a person's own files beside a checkpoint, or any other directory, are never deleted)."""
    notes = directory / NOTES_FILE
    if notes.is_symlink() or not notes.is_file():
        return False
    text = notes.read_text(encoding="utf-8", errors="replace")
    if f"\n{FILES_HEADER}\n" not in text:
        return False
    listed = {line.strip() for line in text.split(f"\n{FILES_HEADER}\n", 1)[1].splitlines() if line.strip()}
    listed.add(NOTES_FILE)
    return all(e.name in listed and e.is_file() and not e.is_symlink() for e in directory.iterdir())


def name_weight_files(staging: Path, parts: list[tuple[Path, list[str]]]) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with their index, from the
    written ``parts`` (each a file and the tensor names it holds)."""
    if len(parts) == 1:
        parts[0][0].rename(staging / "model.safetensors")
        return
    weight_map = {}
    for index, (part, keys) in enumerate(parts, start=1):
        name = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        part.rename(staging / name)
        weight_map |= dict.fromkeys(keys, name)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")


def move_into_place(staging: Path, out: Path) -> None:
    """Move the finished directory into place (an old one only goes once the new one is whole)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
