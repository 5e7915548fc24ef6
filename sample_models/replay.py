"""A decoder's blocks called again, one at a time, on what they received: the calibration batches'
hidden states at the first block and each block's other arguments (masks, rotary embeddings), from
one forward pass of the float model. A stage that changes a block's weights (AWQ's smoothing) runs
its batches through the changed block and hands the outputs to the next one, as llm-compressor's
sequential pipeline does."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from .calibration import Batch, make_batches
from .effect import _Resident
from .model import Model
from .sequential import _Call, _find_blocks


@dataclass
class BlockReplay:
    """The model's blocks (``blocks_name``: where they live), each block's call per batch, and the
    first block's input hidden states per batch."""

    blocks_name: str
    blocks: nn.ModuleList
    calls: list[list[_Call]]
    first: list[torch.Tensor]

    def run(self, index: int, block: nn.Module, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """``block`` (block ``index`` or a changed copy of it) on each batch's ``hidden`` states."""
        with torch.no_grad():
            return [call.invoke(block, h, {}) for call, h in zip(self.calls[index], hidden, strict=True)]


def calibration_batches(model: Model, texts, samples: int, seq_len: int, batch_size: int) -> list[Batch]:
    """The calibration set's windows (``Model.calibration_set``) as padded batches on the model's device."""
    windows = model.calibration_set(texts, samples, seq_len).windows
    padded = make_batches(model.tokenizer(), [list(w) for w in windows], batch_size, model.device)
    return [Batch(ids, mask, mask.bool()) for ids, mask in padded]


def record_blocks(model: Model, batches: list[Batch]) -> BlockReplay:
    """One float forward pass over ``batches`` with the model loaded whole, recording what each block
    was called with."""
    resident = _Resident(model)
    calls, first, _ = resident.record(batches, threading.get_ident())
    return BlockReplay(resident.blocks_name, resident.blocks, calls, first)


def blocks_name(model: Model) -> str:
    """Where the model's blocks live (``model.layers``), found without running anything."""
    return _find_blocks(model.module(), model.source, model.config.num_hidden_layers)[0]
