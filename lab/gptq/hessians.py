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
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".gptq-hessians"
KEY = "hessian"


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

    def put(self, layers: Sequence[str], hessian: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """Keep ``hessian`` as the Hessian of every one of ``layers``; returns what reads it back
        (on the CPU), which keeps the folder alive while it lives."""
        from safetensors.torch import save_file

        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix=self._prefix)
        path = Path(self._folder.name) / f"{len(set(self._files.values()))}.safetensors"
        save_file({KEY: hessian.detach().float().cpu().contiguous()}, str(path))
        self._files |= dict.fromkeys(layers, path)
        return partial(self.get, layers[0])

    def get(self, layer: str, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """``layer``'s Hessian on ``device``, read from its file; None when none was put for it."""
        from safetensors.torch import load_file

        path = self._files.get(layer)
        return None if path is None else load_file(str(path), device=str(device))[KEY]

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._files = {}

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
    from safetensors.torch import save_file

    folder = Path(directory)
    count = 0
    for entry in entries:
        kept = _kept(entry)
        if kept is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        target = _file(folder, entry.layer)
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        save_file({KEY: kept.detach().float().cpu().contiguous()}, str(staging))
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
        from safetensors import safe_open

        path = _file(folder, layer)
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as handle:
            if KEY not in handle.keys():
                raise ValueError(f"{path} holds no {KEY!r} tensor")
            return handle.get_tensor(KEY).float()

    return hessian
