"""A decoder's blocks called again, one at a time, on what they received: the calibration batches'
hidden states at the first block and each block's other arguments (masks, rotary embeddings), from
one forward pass of the float model. A stage that changes a block's weights (AWQ's smoothing) runs
its batches through the changed block and hands the outputs to the next one, as llm-compressor's
sequential pipeline does.

The model is either loaded whole or, where ``Model.capture`` would capture it block by block (a
model larger than the memory budget, or ``sequential=True``), built as a skeleton with one block's
weights loaded at a time from its files (``sample_models.effect``'s two backends): a stage asks for
each block in turn and works on what it is handed while the block is loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .calibration import Batch, make_batches
from .effect import _Resident, _Streamed
from .model import Model
from .sequential import _Call, _find_blocks


@dataclass
class BlockCalls:
    """Each block's call per batch and the first block's input hidden states per batch."""

    calls: list[list[_Call]]
    first: list[torch.Tensor]

    def run(self, index: int, block: nn.Module, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """``block`` (block ``index`` or a changed copy of it) on each batch's ``hidden`` states."""
        with torch.no_grad():
            return [call.invoke(block, h, {}) for call, h in zip(self.calls[index], hidden, strict=True)]


class Replay:
    """A model's blocks for a stage that walks them: where they live, how many, each set of batches'
    block calls (``record``) and each block loaded while the stage holds it (``block``)."""

    def __init__(self, backend: _Resident | _Streamed) -> None:
        self._backend = backend
        self.blocks_name = backend.blocks_name
        self.num_blocks = len(backend.blocks)
        self.streamed = isinstance(backend, _Streamed)

    def record(self, batches: list[Batch]) -> BlockCalls:
        """One float pass over ``batches`` recording what each block was called with (streamed: the
        blocks replaced by stand-ins, so no block is loaded)."""
        calls, first, _ = self._backend.record(batches, threading.get_ident())
        return BlockCalls(calls, first)

    @contextmanager
    def block(self, index: int) -> Iterator[nn.Module]:
        """Block ``index`` with its weights, for the length of the ``with``: the model's own block
        (a stage changes a copy), loaded from the files and freed afterwards when streamed."""
        with self._backend.block(index) as block:
            yield block


@contextmanager
def replay_of(model: Model, sequential: bool | None = None, max_memory: int | None = None) -> Iterator[Replay]:
    """The model's blocks to walk, whole or streamed by ``Model.capture``'s rule (``sequential``,
    ``max_memory``); the model's capture lock is held for the walk, since a streamed skeleton is
    shared by every sequential run of the model."""
    with model._capture_lock:
        budget = model._sequential_budget(sequential, max_memory)
        yield Replay(_Resident(model) if budget is None else _Streamed(model, budget))


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
