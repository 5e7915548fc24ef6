"""A decoder's blocks called again, one at a time, on what they received: the batches' hidden
states at the first block and each block's other arguments (masks, rotary embeddings), from one
forward pass of the float model (``replay_of``, ``Replay.record``), or what a block receives during
a capture's pass (``recording``, for a stage riding it). A stage that changes a block's weights
(AWQ's smoothing) runs the batches through the changed block and hands the outputs to the next
one, as llm-compressor's sequential pipeline does.

``replay_of`` takes the model as the layer-by-layer capture does, a skeleton whose blocks stand
aside while the pass records (``sample_models.effect``'s streamed backend): nothing is loaded whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .calibration import Batch, make_batches
from .capture import eager_attention
from .effect import _Streamed
from .model import Model
from .sequential import _Call, _find_blocks, _split_call


@dataclass
class BlockInputs:
    """What one block received per batch: its hidden states and its other arguments (masks, rotary
    embeddings), to call it, or a changed copy of it, again the same way."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)

    def run(self, block: nn.Module) -> list[torch.Tensor]:
        """``block`` (the block or a changed copy of it) on each batch."""
        with torch.no_grad():
            return [call.invoke(block, h, {}) for call, h in zip(self.calls, self.hidden, strict=True)]


@contextmanager
def recording(block: nn.Module, into: BlockInputs) -> Iterator[BlockInputs]:
    """``block``'s calls while the ``with`` runs, appended to ``into`` (a stage riding a capture
    keeps what the capture's pass hands each block)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden, call = _split_call(args, kwargs)
        into.hidden.append(hidden)
        into.calls.append(call)

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield into
    finally:
        handle.remove()


@dataclass
class BlockCalls:
    """Each block's call per batch and the first block's input hidden states per batch."""

    calls: list[list[_Call]]
    first: list[torch.Tensor]

    def inputs(self, index: int, hidden: list[torch.Tensor]) -> BlockInputs:
        """Block ``index``'s calls with ``hidden`` states (what the blocks before it handed on)."""
        return BlockInputs(hidden, self.calls[index])


class Replay:
    """A model's blocks for a stage that walks them: where they live, and each set of batches'
    block calls (``record``)."""

    def __init__(self, backend: _Streamed) -> None:
        self._backend = backend
        self.blocks_name = backend.blocks_name

    def record(self, batches: list[Batch]) -> BlockCalls:
        """One float pass over ``batches`` recording what each block was called with (streamed: the
        blocks replaced by stand-ins, so no block is loaded), attention computed eagerly as in a
        capture's pass (``eager_attention``), so the calls carry the masks a block copy made during
        that pass is replayed with."""
        with eager_attention(self._backend.module):
            calls, first, _ = self._backend.record(batches, threading.get_ident())
        return BlockCalls(calls, first)


@contextmanager
def replay_of(model: Model, max_memory: int | None = None) -> Iterator[Replay]:
    """The model's blocks to walk as the layer-by-layer capture walks them, under ``max_memory``
    (``Model.capture``'s budget); the model's capture lock is held for the walk, since the skeleton
    is shared by every sequential run of the model."""
    with model._capture_lock:
        yield Replay(_Streamed(model, model._sequential_budget(True, max_memory)))


def calibration_batches(model: Model, texts, samples: int, seq_len: int, batch_size: int) -> list[Batch]:
    """The calibration set's windows (``Model.calibration_set``) as padded batches on the model's device."""
    windows = model.calibration_set(texts, samples, seq_len).windows
    padded = make_batches(model.tokenizer(), [list(w) for w in windows], batch_size, model.device)
    return [Batch(ids, mask, mask.bool()) for ids, mask in padded]


def structure(model: Model) -> nn.Module:
    """The model's modules, names and shapes, for structural questions: the loaded module when it
    is loaded, else its skeleton (nothing is loaded to answer them)."""
    runtime = model._require_runtime()
    return runtime.module.get() if runtime.module.ready else model._structure()


def blocks_name(model: Model) -> str:
    """Where the model's blocks live (``model.layers``), found without running anything."""
    return _find_blocks(structure(model), model.source, model.config.num_hidden_layers)[0]
