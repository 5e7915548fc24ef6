"""Weight stores: list a model's layers and hand out one layer's weight.

Two kinds, one interface (``infos``, ``weight``, ``bias``):
- ``ModuleWeights`` reads a model built in memory (the synthetic built-ins).
- ``CheckpointWeights`` reads files lazily: the listing comes from safetensors headers, and a
  weight read touches only that tensor, so a multi-GB checkpoint opens in milliseconds and never
  has to fit in memory. ``.bin`` files go through ``torch.load(weights_only=True, mmap=True)``;
  nothing is ever unpickled with arbitrary code.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .errors import LayerNotFoundError, ModelSourceError
from .layers import LayerInfo, LayerRef, module_layer_refs

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


class WeightStore(Protocol):
    """What a model source provides for weights: layers and their weights for the analysis, and
    every stored tensor by its state-dict key for sequential calibration, which loads a model one
    block at a time."""

    def infos(self) -> list[LayerInfo]: ...

    def weight(self, name: str) -> torch.Tensor: ...

    def bias(self, name: str) -> torch.Tensor | None: ...

    def tensor_keys(self) -> set[str]: ...

    def tensor(self, key: str) -> torch.Tensor: ...

    def total_bytes(self) -> int: ...

    def stored_keys(self) -> list[str]: ...

    def stored(self, key: str) -> torch.Tensor: ...

    def stored_bytes(self, key: str) -> int: ...


class ModuleWeights:
    """Layers and weights of a module built in memory. Weights are returned as copies, because
    the module is shared read-only between callers."""

    def __init__(self, get_module: Callable[[], nn.Module], source: str) -> None:
        self._get_module = get_module
        self._source = source

    @cached_property
    def _refs(self) -> dict[str, LayerRef]:
        return module_layer_refs(self._get_module())

    @cached_property
    def _infos(self) -> list[LayerInfo]:
        return [ref.info(name) for name, ref in self._refs.items()]

    def infos(self) -> list[LayerInfo]:
        return list(self._infos)

    def _ref(self, name: str) -> LayerRef:
        ref = self._refs.get(name)
        if ref is None:
            raise LayerNotFoundError(f"no layer named {name!r} in {self._source}")
        return ref

    def weight(self, name: str) -> torch.Tensor:
        return self._ref(name).weight().detach().clone()

    def bias(self, name: str) -> torch.Tensor | None:
        bias = self._ref(name).bias()
        return None if bias is None else bias.detach().clone()

    @cached_property
    def _state(self) -> dict[str, torch.Tensor]:
        module = self._get_module()
        return dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())

    def tensor_keys(self) -> set[str]:
        return set(self._state)

    def tensor(self, key: str) -> torch.Tensor:
        """A copy, as a checkpoint read would give: whoever loads it may free or change it."""
        return self._state[key].detach().clone()

    def total_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._get_module().parameters())

    @cached_property
    def _saved(self) -> dict[str, torch.Tensor]:
        return self._get_module().state_dict()

    def stored_keys(self) -> list[str]:
        """What ``save_pretrained`` saves: parameters and persistent buffers, in module order."""
        return list(self._saved)

    def stored(self, key: str) -> torch.Tensor:
        """A copy of one saved tensor, on the CPU."""
        return self._saved[key].detach().to("cpu", copy=True)

    def stored_bytes(self, key: str) -> int:
        tensor = self._saved[key]
        return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one stored tensor lives, read from the file header only."""

    file: Path
    shape: tuple[int, ...]
    element_bytes: int


class CheckpointWeights:
    """Lazy reader over safetensors (or weights-only .bin) files.

    ``module_types`` maps module names to class names when a config lets us build the model on
    the meta device (no memory, milliseconds); without it types are inferred from names and
    shapes. Conv1D weights are stored (in, out) and are transposed on the way out.
    """

    def __init__(
        self,
        files: list[Path],
        *,
        dtype: torch.dtype,
        device: torch.device,
        module_types: dict[str, str] | None = None,
    ) -> None:
        self._dtype = dtype
        self._device = device
        self._types = module_types or {}
        self._bin: dict[str, torch.Tensor] = {}
        self._entries: dict[str, TensorEntry] = {}
        for file in files:
            if file.suffix == ".safetensors":
                self._entries.update(_safetensors_header(file))
            else:
                self._add_bin(file)
        self._source = str(files[0]) if len(files) == 1 else str(files[0].parent)

    def _add_bin(self, file: Path) -> None:
        state = load_bin(file)
        self._bin.update(state)
        self._entries.update({key: TensorEntry(file, tuple(t.shape), t.element_size()) for key, t in state.items()})

    @cached_property
    def _layers(self) -> dict[str, LayerInfo]:
        """Layers in model order when module types are known, else in natural name order
        (``layers.2`` before ``layers.10``)."""
        layers = {}
        for key, entry in sorted(self._entries.items(), key=lambda item: self._order(item[0])):
            if not key.endswith(".weight") or len(entry.shape) < 2:
                continue
            name = key[: -len(".weight")]
            kind = self._types.get(name) or _infer_type(name, entry.shape)
            if kind is None:
                continue
            shape = entry.shape[::-1] if kind == "Conv1D" else entry.shape
            bias = self._entries.get(f"{name}.bias")
            params = _numel(entry.shape) + (0 if bias is None else _numel(bias.shape))
            layers[name] = LayerInfo(name, kind, tuple(shape), params)
        return layers

    def _order(self, key: str) -> tuple:
        name = key.removesuffix(".weight")
        position = self._positions.get(name, len(self._positions))
        return position, [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    @cached_property
    def _positions(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self._types)}

    def infos(self) -> list[LayerInfo]:
        return list(self._layers.values())

    def _check(self, name: str) -> None:
        if name not in self._layers:
            raise LayerNotFoundError(f"no layer named {name!r} in {self._source}")

    def weight(self, name: str) -> torch.Tensor:
        self._check(name)
        weight = self._read(f"{name}.weight")
        return weight.t().contiguous() if self._layers[name].type == "Conv1D" else weight

    def bias(self, name: str) -> torch.Tensor | None:
        self._check(name)
        return self._read(f"{name}.bias") if f"{name}.bias" in self._entries else None

    def tensor_keys(self) -> set[str]:
        return set(self._entries)

    def tensor(self, key: str) -> torch.Tensor:
        """One stored tensor by its state-dict key, in the model dtype on the model device."""
        return self._read(key)

    def total_bytes(self) -> int:
        """Bytes of every stored tensor once read in the model dtype: what loading it all would take."""
        size = torch.empty((), dtype=self._dtype).element_size()
        return size * sum(_numel(entry.shape) for entry in self._entries.values())

    def stored_keys(self) -> list[str]:
        """Every stored key, file by file in file order: a rewrite reads the files in turn."""
        files = {file: index for index, file in enumerate(dict.fromkeys(e.file for e in self._entries.values()))}
        return sorted(self._entries, key=lambda key: files[self._entries[key].file])

    def stored(self, key: str) -> torch.Tensor:
        """One tensor as stored (its own dtype, on the CPU), read alone: a rewrite of the
        checkpoint holds what it is writing, never a whole file."""
        entry = self._entries[key]
        if key in self._bin:
            return self._bin[key].to("cpu", copy=True)
        try:
            with safe_open(str(entry.file), framework="pt", device="cpu") as handle:
                return handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise ModelSourceError(f"cannot read tensor {key!r} from {entry.file}: {err}") from err

    def stored_bytes(self, key: str) -> int:
        """Bytes of one stored tensor as stored, from the file header: nothing is read."""
        entry = self._entries[key]
        return _numel(entry.shape) * entry.element_bytes

    def _read(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        if key in self._bin:
            return self._bin[key].to(device=self._device, dtype=self._dtype, copy=True)
        try:
            with safe_open(str(entry.file), framework="pt", device="cpu") as handle:
                tensor = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise ModelSourceError(f"cannot read tensor {key!r} from {entry.file}: {err}") from err
        return tensor.to(device=self._device, dtype=self._dtype)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _infer_type(name: str, shape: tuple[int, ...]) -> str | None:
    """Best guess of a layer type from a bare weights file, where no config says."""
    if len(shape) == 4:
        return "Conv2d"
    if len(shape) != 2:
        return None
    leaf = name.rsplit(".", 1)[-1]
    if "embed" in name or leaf in {"wte", "wpe", "word_embeddings", "position_embeddings"}:
        return "Embedding"
    return "Linear"


def _safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """Read and validate a safetensors header; the tensor data is not read."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            slices = {key: handle.get_slice(key) for key in handle.keys()}
            return {
                k: TensorEntry(file, tuple(s.get_shape()), _element_bytes(s.get_dtype())) for k, s in slices.items()
            }
    except SafetensorError as err:
        raise ModelSourceError(f"corrupt or truncated safetensors file {file}: {err}") from err
    except OSError as err:
        raise ModelSourceError(f"cannot read safetensors file {file}: {err}") from err


def _element_bytes(dtype: str) -> int:
    """Bytes of one element of a safetensors dtype (``F32``, ``BF16``, ``F8_E4M3``, ``BOOL``, …)."""
    bits = re.search(r"\d+", dtype)
    return max(int(bits.group()) // 8, 1) if bits else 1


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """Load a PyTorch checkpoint with the weights-only unpickler (no code can run), memory-mapped
    when the file is in the zip format so tensors stay on disk until used."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as err:
        raise ModelSourceError(f"cannot load {file} as a weights-only PyTorch checkpoint: {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelSourceError(f"{file} is not a state dict of tensors")
    return state


def checkpoint_files(directory: Path) -> list[Path]:
    """The weight files of a model directory: safetensors (sharded via the index or not),
    otherwise .bin files."""
    for index_name, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (BIN_INDEX, "*.bin")):
        index = directory / index_name
        if index.is_file():
            return _indexed_files(index)
        files = sorted(directory.glob(pattern))
        if files:
            return files
    raise ModelSourceError(f"no *.safetensors or *.bin weight files in {directory}")


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelSourceError(f"unreadable shard index {index}: {err}") from err
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [str(file) for file in files if not file.is_file()]
    if missing:
        raise ModelSourceError(f"shard index {index} names missing files: {', '.join(missing)}")
    return files
