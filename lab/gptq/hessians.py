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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".gptq-hessians"
KEY = "hessian"

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

    if getattr(entry, "hessian", None) is not None:
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
    """The Hessians an analysis holds in memory (the app's session, a run before it is saved)."""
    kept = {e.layer: found for e in entries if (found := _kept(e)) is not None}
    return kept.get


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
