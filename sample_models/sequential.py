"""Sequential (block-by-block) calibration: capture activations of a model that does not fit in memory.

As llm-compressor's sequential onloading does, the model is built as a skeleton on the meta device
(no memory), and only one unit of weights is materialized at a time: first the modules that run
before the first block (the embeddings), then each decoder or encoder block in turn, then, only
when a layer after the blocks is asked for, the modules after them (final norm, head). Each
calibration batch goes through a block, the block's outputs become the next block's inputs, and the
block goes back to the meta device. Peak memory is about one block plus the calibration hidden
states; when the hidden states would not fit beside the largest block they are kept in files under
a temporary directory and read back one batch at a time.

What a block receives besides the hidden states (attention mask, rotary position embeddings,
position ids, the KV cache) is whatever the model's own forward pass computes before calling it.
To get it without running any block, every block is replaced by a stand-in for one pass: the
stand-ins record their arguments and hand the hidden states on, and the last one stops the pass.
Recording every block, not only the first, keeps models whose blocks get different masks (Qwen2's
sliding-window layers) exact.

Weights are read by state-dict key from the model's weight store: lazily from the checkpoint's
files, or copied from the module built in memory for the built-ins, so both take the same path.
"""

from __future__ import annotations

import copy
import ctypes
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import psutil
import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import load_file, save_file
from torch import nn

from .calibration import Batch
from .errors import SequentialUnsupportedError
from .layers import converted_rows
from .stores import WeightStore

MEMORY_FRACTION = 0.5
Progress = Callable[[int, int, str], None]
BLOCKS_NEEDED = "sequential calibration needs an nn.ModuleList of config.num_hidden_layers blocks run in order"


def default_max_memory(device: torch.device) -> int:
    """The default weights budget: half the free memory of the device that will hold the weights
    (available RAM on the CPU, free GPU memory on CUDA), leaving room for activations and the app."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * MEMORY_FRACTION)
    return int(psutil.virtual_memory().available * MEMORY_FRACTION)


def empty_model(build: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """The model ``build`` makes, with its parameters on the meta device and its buffers (rotary
    frequencies, position ids: computed, not stored in checkpoints) on ``device``. ``dtype`` casts
    parameters and floating buffers as ``module.to(dtype)`` does, for the built-ins that are built
    that way. Tied parameters (a head sharing the embedding) are tied as loading would tie them, so
    that a checkpoint which stores one of them serves both. Construction runs under a forked RNG so
    that it never changes the caller's random stream."""
    with torch.random.fork_rng(devices=[]), init_empty_weights():
        module = build()
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    if dtype is not None:
        module.to(dtype)
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = buffer.to(device)
    return module.eval()


def from_config(model_class: type[nn.Module], config, dtype: torch.dtype) -> Callable[[], nn.Module]:
    """A builder for ``empty_model`` as ``from_pretrained`` builds the class (same dtype handling);
    the config is copied because transformers writes the dtype into it."""
    return lambda: model_class._from_config(copy.deepcopy(config), dtype=dtype)


def human_bytes(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def return_freed_memory() -> None:
    """Give the memory of freed tensors back to the operating system (glibc only; elsewhere a no-op).

    glibc serves allocations below a threshold from its heap and keeps freed heap memory for reuse,
    and it raises that threshold (up to 32 MB) each time a large block is freed: after a few blocks'
    weights and activations come and go, the process holds hundreds of MB it no longer uses, and
    the memory budget of a layer-by-layer run would be a promise on paper only."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


@dataclass
class SequentialStats:
    """What the last sequential run held in memory.

    Attributes:
        blocks: blocks run.
        largest_unit: name and bytes of the largest set of weights ever loaded at once by design (a
            block, or a module outside the blocks).
        peak_weight_bytes: most parameter bytes materialized at the same time.
        hidden_bytes: bytes of the hidden states at one block boundary, all batches.
        offloaded: True when the hidden states were kept on disk.
    """

    blocks: int
    largest_unit: tuple[str, int]
    peak_weight_bytes: int = 0
    hidden_bytes: int = 0
    offloaded: bool = False


class SequentialModel:
    """A model skeleton prepared for sequential runs: its blocks, the checkpoint key of every
    parameter, and the weights each unit needs. Built once per model and reused by every run (runs
    hold the model's capture lock); every parameter is back on the meta device after a run."""

    def __init__(self, module: nn.Module, store: WeightStore, name: str, num_blocks: int) -> None:
        self.module = module
        self.name = name
        self.blocks_name, self.blocks = _find_blocks(module, name, num_blocks)
        self.key_of = _key_map(module, store.tensor_keys(), name)
        owners = {id(m): n for n, m in module.named_modules()}
        inside = {id(m) for m in self.blocks.modules()}
        self.outer = {m: owners[id(m)] for m in module.modules() if id(m) not in inside and _direct_params(m)}

    def block_name(self, index: int) -> str:
        return f"{self.blocks_name}.{index}"

    def block_of(self, name: str) -> int | None:
        """Index of the block that holds the module ``name``, None for one outside the blocks."""
        prefix = f"{self.blocks_name}."
        if not name.startswith(prefix):
            return None
        index = name[len(prefix) :].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    @cached_property
    def units(self) -> dict[str, int]:
        """Bytes of every unit of weights loaded as one: each block and each module outside them."""
        blocks = {self.block_name(i): _bytes(block.parameters()) for i, block in enumerate(self.blocks)}
        return blocks | {name: _bytes(_direct_params(m).values()) for m, name in self.outer.items()}

    def largest_unit(self) -> tuple[str, int]:
        return max(self.units.items(), key=lambda item: item[1])

    def check_budget(self, max_memory: int) -> None:
        """A budget that cannot hold the largest unit cannot work at all: say so before running."""
        name, size = self.largest_unit()
        if max_memory < size:
            raise ValueError(
                f"max_memory={human_bytes(max_memory)} is smaller than {name} of {self.name} "
                f"({human_bytes(size)}), the largest part sequential calibration loads at once"
            )


def _find_blocks(module: nn.Module, name: str, count: int) -> tuple[str, nn.ModuleList]:
    """The first ModuleList of ``count`` modules: the decoder or encoder blocks in transformers models."""
    for path, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) == count and count > 0:
            return path, child
    raise SequentialUnsupportedError(
        f"cannot find the decoder blocks of {name}: {BLOCKS_NEEDED} ({count} in its config), and "
        f"{type(module).__name__} has none"
    )


@dataclass(frozen=True)
class StoredRows:
    """A parameter transformers assembles from several stored tensors when it loads (Mixtral's fused
    ``experts.gate_up_proj`` from every expert's ``w1`` and ``w3``, a renamed router): each stored
    key with the parameter's rows it holds, in order (rows: every dimension but the last, flattened)."""

    parts: tuple[tuple[str, torch.Tensor], ...]

    def read(self, store: WeightStore, shape: torch.Size) -> torch.Tensor:
        """The parameter of ``shape`` put together from the stored tensors."""
        tensors = [(store.tensor(key), rows) for key, rows in self.parts]
        value = torch.empty(shape, dtype=tensors[0][0].dtype)
        flat = value.view(-1, shape[-1]) if value.dim() else value.view(1, 1)
        for tensor, rows in tensors:
            flat[rows] = tensor.reshape(len(rows), -1).to(value.dtype)
        return value


def _key_map(module: nn.Module, keys: set[str], name: str) -> dict[str, str | StoredRows]:
    """The stored key of every parameter, tied parameters included (a tied head reads the embedding
    when the checkpoint leaves it out), with or without the base model prefix as transformers allows;
    a parameter transformers converts from other stored tensors when it loads (``layers.converted_rows``),
    the stored tensors and the rows each holds."""
    prefix = getattr(module, "base_model_prefix", "")
    groups: dict[int, list[str]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    for param_name, param in module.named_parameters(remove_duplicate=False):
        groups[id(param)].append(param_name)
        params[id(param)] = param
    key_of: dict[str, str | StoredRows] = {}
    for identity, names in groups.items():
        candidates = [c for n in names for c in (n, f"{prefix}.{n}", n.removeprefix(f"{prefix}.")) if c in keys]
        parts = None if candidates else converted_rows(module, names[0], params[identity].shape, keys, prefix)
        found = candidates[0] if candidates else None if parts is None else StoredRows(tuple(parts))
        if found is None:
            raise SequentialUnsupportedError(
                f"cannot find tensor {names[0]!r} of {name} in its checkpoint: sequential calibration reads "
                "tensors by module name, or through the conversion transformers applies when loading, and "
                "neither places it"
            )
        key_of.update(dict.fromkeys(names, found))
    return key_of


def _direct_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module._parameters.items() if p is not None}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Loader:
    """Puts parameters in place from the weight store and back on the meta device, counting the
    bytes materialized: the figure sequential calibration promises to bound."""

    def __init__(self, model: SequentialModel, store: WeightStore, device: torch.device, budget: int) -> None:
        self._model = model
        self._store = store
        self._device = device
        self._budget = budget
        self._loaded: dict[nn.Module, list[tuple[str, str]]] = {}
        self.resident = 0
        self.peak = 0

    def load(self, module: nn.Module, prefix: str, recurse: bool) -> None:
        """Load ``module``'s parameters (its own only, or all under it), ``prefix`` naming it in the model."""
        named = module.named_parameters(recurse=recurse) if recurse else _direct_params(module).items()
        names = [(local, f"{prefix}.{local}" if prefix else local) for local, _ in named]
        self._loaded[module] = names
        for local, full in names:
            found = self._model.key_of[full]
            if isinstance(found, StoredRows):
                value = found.read(self._store, module.get_parameter(local).shape)
            else:
                value = self._store.tensor(found)
            self.resident += value.numel() * value.element_size()
            self.peak = max(self.peak, self.resident)
            set_module_tensor_to_device(module, local, self._device, value=value, clear_cache=False)

    def free(self, module: nn.Module) -> None:
        for local, _ in self._loaded.pop(module, []):
            self.resident -= _bytes([module.get_parameter(local)])
            set_module_tensor_to_device(module, local, "meta")

    def ensure_outer(self, module: nn.Module) -> None:
        """Load a module outside the blocks when it is first called; it stays for the pass unless the
        budget needs room, when the modules loaded before it go first (the head after the embedding)."""
        if module in self._loaded:
            return
        size = _bytes(_direct_params(module).values())
        for other in [m for m in self._loaded if m in self._model.outer]:
            if self.resident + size <= self._budget:
                break
            self.free(other)
        self.load(module, self._model.outer[module], recurse=False)

    def free_all(self) -> None:
        for module in list(self._loaded):
            self.free(module)


class _HiddenStates:
    """The hidden states at one block boundary, one tensor per batch: in memory, or in safetensors
    files under ``directory`` when they would not fit beside the weights."""

    def __init__(self, directory: Path | None, tag: str, device: torch.device) -> None:
        self._directory = directory
        self._tag = tag
        self._device = device
        self._tensors: list[torch.Tensor] = []
        self._files: list[Path] = []

    def __len__(self) -> int:
        return len(self._files) if self._directory else len(self._tensors)

    def append(self, hidden: torch.Tensor) -> None:
        if self._directory is None:
            self._tensors.append(hidden)
            return
        path = self._directory / f"{self._tag}-{len(self._files)}.safetensors"
        save_file({"hidden": hidden.detach().contiguous().cpu()}, str(path))
        self._files.append(path)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._directory is None:
            return self._tensors[index]
        return load_file(str(self._files[index]), device=str(self._device))["hidden"]

    def clear(self) -> None:
        self._tensors.clear()
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files.clear()


@dataclass
class _Call:
    """What a block received for one batch besides its hidden states, to call it again the same way."""

    args: tuple
    kwargs: dict
    by_keyword: bool

    def invoke(self, block: nn.Module, hidden: torch.Tensor, overrides: dict) -> torch.Tensor:
        kwargs = self.kwargs | overrides
        output = (
            block(*self.args, hidden_states=hidden, **kwargs)
            if self.by_keyword
            else block(hidden, *self.args, **kwargs)
        )
        return output[0] if isinstance(output, tuple) else output


def _split_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, _Call]:
    if args:
        return args[0], _Call(args[1:], kwargs, by_keyword=False)
    rest = dict(kwargs)
    return rest.pop("hidden_states"), _Call((), rest, by_keyword=True)


class _LastBlockReached(Exception):
    """Stops the recording pass: nothing after the blocks is needed to feed them."""


class StopPass(Exception):
    """Raised by a capture hook of the last pass once it has recorded everything asked of it: the
    rest of the forward pass (a head's logits, far larger than its input) is not run."""


class _StandIn(nn.Module):
    """Takes a block's place for one pass: hands its call to ``on_call`` and returns what that gives."""

    def __init__(self, index: int, on_call: Callable[[int, tuple, dict], torch.Tensor]) -> None:
        super().__init__()
        self.index = index
        self.on_call = on_call

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.on_call(self.index, args, kwargs)


class SequentialRunner:
    """One sequential run over fixed calibration batches. Use as a context manager: on exit every
    parameter is back on the meta device and offloaded hidden states are deleted, whatever happened.

    The caller drives it: ``head`` records what each block receives (with its capture hooks on the
    modules before the blocks), then for each index from ``blocks()`` it installs the hooks for that
    block and calls ``run`` once per batch, and ``tail`` runs the modules after the blocks if needed.
    """

    def __init__(
        self,
        model: SequentialModel,
        store: WeightStore,
        batches: list[Batch],
        *,
        device: torch.device,
        max_memory: int,
        hidden_bytes: int,
        progress: Progress | None = None,
    ) -> None:
        model.check_budget(max_memory)
        self._model = model
        self._batches = batches
        self.device = device
        self._loader = _Loader(model, store, device, max_memory)
        self._progress = progress
        self._calls: list[list[_Call]] = [[] for _ in model.blocks]
        largest = model.largest_unit()
        offload = 2 * hidden_bytes > max_memory - largest[1]
        self.stats = SequentialStats(len(model.blocks), largest, hidden_bytes=hidden_bytes, offloaded=offload)
        self._tmp = tempfile.TemporaryDirectory(prefix="observer-lab-hidden-") if offload else None
        self._hidden = self._new_hidden(0)
        self._next = self._hidden

    def __enter__(self) -> SequentialRunner:
        return self

    def __exit__(self, *exc) -> None:
        self._loader.free_all()
        self._hidden.clear()
        self._next.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
        self.stats.peak_weight_bytes = self._loader.peak

    def block_of(self, name: str) -> int | None:
        return self._model.block_of(name)

    def _new_hidden(self, boundary: int) -> _HiddenStates:
        directory = None if self._tmp is None else Path(self._tmp.name)
        return _HiddenStates(directory, f"block-{boundary}", self.device)

    def head(self, kwargs_for: Callable[[nn.Module, Batch], dict], start: Callable[[Batch], None]) -> None:
        """Run the model up to its last block for every batch, recording each block's call and the
        first block's hidden states. ``start(batch)`` runs before each batch (capture hooks' bookkeeping)."""
        module = self._model.module
        with self._stand_ins(self._record), self._outer_on_demand(), torch.no_grad():
            for batch in self._batches:
                start(batch)
                try:
                    module(**kwargs_for(module, batch))
                except _LastBlockReached:
                    continue
                raise SequentialUnsupportedError(
                    f"the forward pass of {self._model.name} did not call its last block: {BLOCKS_NEEDED}"
                )

    def _record(self, index: int, args: tuple, kwargs: dict) -> torch.Tensor:
        hidden, call = _split_call(args, kwargs)
        self._calls[index].append(call)
        if index == 0:
            if hidden.is_meta:
                raise SequentialUnsupportedError(
                    f"{self._model.name} computes its first block's input from weights it reads without calling "
                    f"their module: {BLOCKS_NEEDED}"
                )
            self._hidden.append(hidden)
        if index == len(self._calls) - 1:
            raise _LastBlockReached
        return hidden

    def blocks(self) -> Iterator[int]:
        """Each block's index in order, with its weights loaded while the caller runs the batches."""
        total = len(self._model.blocks)
        for index, block in enumerate(self._model.blocks):
            name = self._model.block_name(index)
            self._loader.load(block, name, recurse=True)
            self._next = self._new_hidden(index + 1)
            yield index
            self._loader.free(block)
            self._hidden.clear()
            self._hidden = self._next
            return_freed_memory()
            self._calls[index] = []
            if self._progress is not None:
                self._progress(index + 1, total, name)

    def block(self, index: int) -> nn.Module:
        """Block ``index`` (its weights loaded while ``blocks`` is on it)."""
        return self._model.blocks[index]

    def run(self, index: int, batch_index: int, **overrides) -> None:
        """Run one batch through the loaded block ``index`` (``overrides`` replace recorded keyword
        arguments, e.g. a fresh KV cache) and keep its output as the next block's input."""
        block = self._model.blocks[index]
        with torch.no_grad():
            output = self._calls[index][batch_index].invoke(block, self._hidden[batch_index], overrides)
        self._next.append(output)

    def propagate(self, index: int, hooks: Callable[[nn.Module], AbstractContextManager]) -> None:
        """Run every batch through block ``index`` again with ``hooks(module)`` installed (they
        fake-quantize the block's chosen tensors) and give the next block these outputs instead:
        llm-compressor's propagation pass, so later blocks calibrate on what a quantized model feeds
        them."""
        self._next.clear()
        self._next = self._new_hidden(index + 1)
        with hooks(self._model.module):
            for batch_index in range(len(self._batches)):
                self.run(index, batch_index)

    def recorded_kwargs(self, index: int, batch_index: int) -> dict:
        return self._calls[index][batch_index].kwargs

    def tail(self, kwargs_for: Callable[[nn.Module, Batch], dict], start: Callable[[Batch], None]) -> None:
        """Run the modules after the blocks (final norm, head, pooler) on the last block's outputs:
        the whole forward pass again, every stand-in returning those outputs instead of running."""
        module = self._model.module
        current: list[torch.Tensor] = []
        with self._stand_ins(lambda index, args, kwargs: current[0]), self._outer_on_demand(), torch.no_grad():
            for batch_index, batch in enumerate(self._batches):
                start(batch)
                current[:] = [self._hidden[batch_index]]
                try:
                    module(**kwargs_for(module, batch))
                except StopPass:
                    continue

    @contextmanager
    def _stand_ins(self, on_call: Callable[[int, tuple, dict], torch.Tensor]) -> Iterator[None]:
        blocks = self._model.blocks
        originals = list(blocks)
        try:
            for index in range(len(blocks)):
                blocks[index] = _StandIn(index, on_call)
            yield
        finally:
            for index, block in enumerate(originals):
                blocks[index] = block

    @contextmanager
    def _outer_on_demand(self) -> Iterator[None]:
        """Load each module outside the blocks when the pass first calls it; free them all after."""
        handles = [m.register_forward_pre_hook(lambda m, args: self._loader.ensure_outer(m)) for m in self._model.outer]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._loader.free_all()
