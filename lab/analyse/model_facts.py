"""What an analysis must remember about the model it came from.

Results stay tied to their model: ``analyse`` records a ``ModelFacts`` on the ``Analysis`` when it
is built (where the weights came from with a sha256 per file, each layer's type and weight shape,
the key/value shape of analysed attention blocks), so exporters take ``(analysis, choices)`` and
never look at whatever model happens to be open later, and an import is checked against the
analysis it is applied to.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from lab.vocab import LINEAR_TYPES


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so a multi-GB shard never sits in memory; memoized
    per (path, size, mtime), so re-running on the same checkpoint hashes it once."""
    stat = Path(path).stat()
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, chunk)


@lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int, chunk: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    try:
        from sample_models.stores import checkpoint_files

        return list(checkpoint_files(path))
    except (ImportError, ValueError):
        return sorted([*path.glob("*.safetensors"), *path.glob("*.bin")])


def source_stamp(model: Any) -> dict[str, Any]:
    """What identifies an opened model's weights without reading them: its name and source, and
    each weight file's resolved path, size and modification time (the same assumption the sha256
    memo makes). Cheap enough to ask on every Run, where ``describe_source`` reads every file once."""
    source = Path(str(getattr(model, "source", "") or getattr(model, "name", "")))
    files = _weight_files(source) if source.exists() else []
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return {"name": str(getattr(model, "name", "")), "source": str(source), "files": stats}


def describe_source(model: Any) -> dict[str, Any]:
    """``{"kind", "name", "path", "id", "files": [{"name", "sha256"}]}`` of an opened model.

    ``sample_models`` models expose ``name`` and ``source`` (a path, or a phrase for the synthetic
    built-ins) but no file list, so the weight files under an existing path are found here and
    hashed. ``kind`` is ``builtin`` (MiniLM and the synthetic decoders), ``hub``, ``directory`` or
    ``file``.
    """
    from sample_models import BUILTIN_NAMES

    name = str(getattr(model, "name", "") or "")
    source = str(getattr(model, "source", "") or name)
    path = Path(source)
    builtin = name in BUILTIN_NAMES
    if not path.exists():
        kind = "builtin" if builtin else "hub"
        return {"kind": kind, "name": name or source, "path": None, "id": name or source, "files": []}
    files = _weight_files(path)
    root = path if path.is_dir() else path.parent
    if builtin:
        kind = "builtin"
    elif "/" in name and name != source:
        kind = "hub"
    else:
        kind = "directory" if path.is_dir() else "file"
    return {
        "kind": kind,
        "name": name or path.name,
        "path": str(path.resolve()),
        "id": name if kind in ("builtin", "hub") else None,
        "files": [{"name": str(f.relative_to(root)), "sha256": sha256_file(f)} for f in files],
    }


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when two ``describe_source`` records name the same weights: equal file hashes when
    both list files, else the same name/id."""
    files_a = {f["name"]: f["sha256"] for f in a.get("files") or []}
    files_b = {f["name"]: f["sha256"] for f in b.get("files") or []}
    if files_a and files_b:
        return files_a == files_b
    return (a.get("id") or a.get("name")) == (b.get("id") or b.get("name"))


@dataclass(frozen=True)
class ModelFacts:
    """The facts about a model that exports and imports need, taken once when it is analysed.

    - ``source``: ``describe_source`` (kind, name, path or id, sha256 per weight file);
    - ``layer_types`` / ``layer_shapes``: ``{layer: module type}`` and ``{layer: weight shape}``
      of every layer with a weight (compressed-tensors' ``Linear`` target and ``ignore`` list,
      qparam shapes on import);
    - ``attention_blocks`` / ``kv_shapes``: the model's attention blocks and ``(kv_heads,
      head_dim)`` of each, recorded only when key/value states were analysed (listing them
      builds the model).
    """

    source: dict[str, Any]
    layer_types: dict[str, str] = field(default_factory=dict)
    layer_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    attention_blocks: tuple[str, ...] | None = None
    kv_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: Any, with_kv: bool = False) -> ModelFacts:
        """The facts of an opened ``sample_models`` model; ``with_kv`` adds its attention blocks."""
        infos = model.layers()
        blocks: tuple[str, ...] | None = None
        kv_shapes: dict[str, tuple[int, int]] = {}
        if with_kv:
            blocks = tuple(model.attention_blocks())
            kv_shapes = {block: tuple(model.kv_shape(block)) for block in blocks}
        return cls(
            source=describe_source(model),
            layer_types={i.name: i.type for i in infos},
            layer_shapes={i.name: tuple(i.shape) for i in infos},
            attention_blocks=blocks,
            kv_shapes=kv_shapes,
        )

    @property
    def name(self) -> str:
        return str(self.source.get("name") or self.source.get("id") or "")

    @property
    def linear_layers(self) -> list[str]:
        return [name for name, kind in self.layer_types.items() if kind in LINEAR_TYPES]
