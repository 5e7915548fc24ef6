"""GPTQ's Hessians kept beside a run's Observer Lab file, so that a saved choice can be deployed
under GPTQ later (``export``, ``run --checkpoint``): the checkpoint runs each chosen observer's GPTQ
again from the layer's Hessian, and the JSON itself stays small.

``x.json`` gets the folder ``x.gptq-hessians/`` with one safetensors file per layer (the tensor
``hessian``, fp32 ``(in, in)``), written whole and renamed into place, read one layer at a time
when the checkpoint reaches that layer. A Hessian is what ``2/n Σ xxᵀ`` over the calibration tokens
gave (``observers.HessianAccumulator``): no token is kept.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".gptq-hessians"
KEY = "hessian"


def write_file(path: str | os.PathLike, hessian: torch.Tensor) -> None:
    """One Hessian as a safetensors file (the tensor ``hessian``, fp32 on the CPU): the one form
    every Hessian file of the lab has (beside a run's JSON, in a kept run, waiting on disk)."""
    from safetensors.torch import save_file

    save_file({KEY: hessian.detach().float().cpu().contiguous()}, str(path))


def read_file(path: str | os.PathLike, device: torch.device | str = "cpu") -> torch.Tensor:
    """The Hessian ``write_file`` wrote at ``path``, on ``device``; a file without one is one
    ``ValueError`` naming it."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        if KEY not in handle.keys():
            raise ValueError(f"{path} holds no {KEY!r} tensor")
        return handle.get_tensor(KEY).float()


class SpilledHessians:
    """Hessians waiting on disk until a layer needs its own: written to a temporary folder as they
    are made (one file per tensor: q, k and v, fed one input, share theirs) and read back whole
    when asked. A run's every layer's Hessian in memory at once would be ``(in, in)`` floats each
    for the whole model (a 4096-wide decoder block's seven layers: 0.9 GB, 28 GB for 32 blocks).
    ``close`` (or leaving its ``with``) removes the folder, as does the last reader (``put``'s)
    going; a store never written to makes none."""

    def __init__(self, prefix: str = "gptq-hessians-") -> None:
        self._prefix = prefix
        self._folder: tempfile.TemporaryDirectory | None = None
        self._files: dict[str, Path] = {}
        self._first: dict[int, tuple[weakref.ref, str]] = {}
        """By the tensor put (while it lives: a weak reference keeps no Hessian in memory), the first
        layer whose file holds it: layers fed one input share the tensor, and so its file."""
        self._readers: weakref.WeakValueDictionary[str, partial] = weakref.WeakValueDictionary()
        """Each file's reader by its first layer, while an entry holds it (the reader keeps this
        store alive, so the store keeps it weakly)."""

    def put(self, layers: Sequence[str], hessian: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """Keep ``hessian`` as the Hessian of every one of ``layers``, written once (a tensor put
        before and still alive is named again); returns what reads it back (on the CPU), the same
        reader for the same file, which keeps the folder alive while it lives."""
        found = self._first.get(id(hessian))
        if found is None or found[0]() is not hessian:
            if self._folder is None:
                self._folder = tempfile.TemporaryDirectory(prefix=self._prefix)
            path = Path(self._folder.name) / f"{len(set(self._files.values()))}.safetensors"
            write_file(path, hessian)
            self._files[layers[0]] = path
            found = self._first[id(hessian)] = (weakref.ref(hessian), layers[0])
        first = found[1]
        self._files |= dict.fromkeys(layers, self._files[first])
        reader = self._readers.get(first) or partial(self.get, first)
        self._readers[first] = reader
        return reader

    def get(self, layer: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """``layer``'s Hessian on ``device``, read from its file; None when none was put for it."""
        path = self._files.get(layer)
        return None if path is None else read_file(path, device)

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._files, self._first = {}, {}

    def __enter__(self) -> SpilledHessians:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HessianOf = Callable[[str], torch.Tensor | None]
"""A layer's Hessian by name, or None when none was kept for it; an empty tensor (``unreached``)
when the run recorded that no calibration token reached the layer (an expert the router never
chose), which GPTQ leaves round-to-nearest, as llm-compressor leaves a module its GPTQ never saw."""


def unreached() -> torch.Tensor:
    """The Hessian kept for a layer no calibration token reached: an empty tensor, so that it is
    recorded (a missing file is not taken for it)."""
    return torch.empty(0)


def _kept(entry: Any) -> torch.Tensor | None:
    """What is kept of an entry: its Hessian, ``unreached()`` for a weight whose GPTQ had none
    because no token reached it (``lab.gptq.layer.NO_HESSIAN``), else None."""
    from lab.gptq.layer import NO_HESSIAN

    if getattr(entry, "hessian_source", None) is not None:
        return entry.hessian
    rows = getattr(entry, "gptq", None) or []
    return unreached() if any(row.error == NO_HESSIAN for row in rows) else None


def directory_for(lab_path: str | os.PathLike) -> Path:
    """Where the Hessians of the run saved as ``lab_path`` live: ``x.json`` → ``x.gptq-hessians``."""
    path = Path(lab_path)
    return path.with_name(path.stem + SUFFIX)


def _file(directory: Path, layer: str) -> Path:
    if not layer or layer.startswith(".") or "/" in layer or os.sep in layer:
        raise ValueError(f"{layer!r} is not a layer name a Hessian file can be named after")
    return directory / f"{layer}.safetensors"


def save(directory: str | os.PathLike, entries: Iterable[Any]) -> int:
    """Write what is kept of every entry (``_kept``: its ``TensorAnalysis.hessian``, or that no
    token reached it) into ``directory``; returns how many. Each file goes in whole (written beside
    it, then renamed)."""
    folder = Path(directory)
    count = 0
    for entry in entries:
        kept = _kept(entry)
        if kept is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        target = _file(folder, entry.layer)
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        write_file(staging, kept)
        staging.replace(target)
        count += 1
    return count


def of_analysis(entries: Iterable[Any]) -> HessianOf:
    """The Hessians an analysis holds (the app's session, a run before it is saved), each read
    from where it waits when asked for."""
    kept = {e.layer: e for e in entries if getattr(e, "hessian_source", None) is not None or _kept(e) is not None}

    def hessian(layer: str) -> torch.Tensor | None:
        entry = kept.get(layer)
        return None if entry is None else _kept(entry)

    return hessian


def read(directory: str | os.PathLike) -> HessianOf:
    """The Hessians saved in ``directory``, each read when asked for (a missing folder: one
    ``ValueError`` saying the run's Hessians are needed)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(
            f"{folder} is missing: a GPTQ choice is deployed from the Hessians its run kept there "
            "(written beside the run's JSON); run again with --gptq to make them"
        )

    def hessian(layer: str) -> torch.Tensor | None:
        path = _file(folder, layer)
        return read_file(path) if path.is_file() else None

    return hessian
