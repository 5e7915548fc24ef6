"""What an AWQ search may hold at once (issue 54): one budget in bytes for everything a mapping's
search stacks, races and keeps beside the block it searches, so that a 7B-wide block searches in
the memory its weights leave (a gate/up candidate is 360 MB of effective weights there, and the
search makes hundreds).

The budget is shared out in fixed parts: the candidates raced together (``batch``: their effective
weights, and the stacked copy the race reads), the candidates made in one stacked step (``elements``:
their smoothed, quantized and divided weights, float64 quotients included) and the activations of
one stacked replay (``activations``). Each part is also capped by what makes a search fast, so a
large budget does not make it hold more than it needs. A budget that cannot hold one candidate of a
mapping is refused before the walk starts (``check``): one line, not a process killed for memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab.awq.mappings import Mapping
from sample_models import Model
from sample_models.replay import blocks_name
from sample_models.sequential import default_max_memory, human_bytes

BATCH_BYTES = 256 << 20
"""The most effective weights raced in one batch, whatever the budget: beyond it a stacked replay
is no faster per candidate, and the race keeps a stacked copy of them as large again."""

STACKED_ELEMENTS = 16 << 20
"""The most weight elements (candidates × clip ratios × a layer) one stacked step of making
candidates holds, whatever the budget (its float64 quotients take 24 bytes an element at the
peak)."""

ACTIVATION_BYTES = 256 << 20
"""The most bytes of a parent's widest activation one stacked replay call holds, whatever the
budget."""

BATCH_SHARE, ELEMENTS_SHARE, ACTIVATIONS_SHARE = 4, 4, 8
"""The budget's parts: a quarter for the raced batch's weights (and as much again for the race's
stacked copy), a quarter for a making step, an eighth for a replay's activations, the rest for
what the search keeps (input moments, the parent's recorded calls, picks' qparams)."""

RETURNED_CANDIDATE_BYTES = 16 << 20
"""A candidate whose weights take more than this has the memory its batch freed handed back to the
system after each batch (``sample_models.sequential.return_freed_memory``): the CLI keeps freed
memory for the next tensors (``lab.allocator``), which saves page faults on small models but, with
tensors of hundreds of megabytes in many sizes, fragments the heap to twice the live peak."""

BYTES_PER_MADE_ELEMENT = 24
"""A making step's peak per weight element: the smoothed float32 weight, its fake-quantized copy
and the float64 quotient ``Q(W·s)/s``."""


@dataclass(frozen=True)
class SearchBudget:
    """Bytes a mapping's search may hold beside its block (None: only the caps above bound it)."""

    bytes: int | None = None

    def batch(self, candidate_bytes: int) -> int:
        """Candidates raced in one batch: their effective weights (``candidate_bytes`` each, the
        balance layers' weights) within ``BATCH_BYTES`` and the budget's share."""
        return max(1, self._part(BATCH_BYTES, BATCH_SHARE) // max(candidate_bytes, 1))

    def elements(self) -> int:
        """Weight elements one stacked step of making candidates holds."""
        return max(1, self._part(STACKED_ELEMENTS * BYTES_PER_MADE_ELEMENT, ELEMENTS_SHARE) // BYTES_PER_MADE_ELEMENT)

    def activations(self) -> int:
        """Bytes of a parent's widest activation one stacked replay call holds."""
        return self._part(ACTIVATION_BYTES, ACTIVATIONS_SHARE)

    def returns_freed(self, candidate_bytes: int) -> bool:
        """Whether a search of candidates this large hands freed memory back after each batch."""
        return candidate_bytes > RETURNED_CANDIDATE_BYTES

    def _part(self, cap: int, share: int) -> int:
        return cap if self.bytes is None else min(cap, self.bytes // share)

    def check(self, mapping: str, candidate_bytes: int) -> None:
        """Refuse, in one line, a budget whose batch share cannot hold one candidate of ``mapping``
        (``candidate_bytes``: its balance layers' weights) with the race's copy of it."""
        if self.bytes is None:
            return
        needed = BATCH_SHARE * candidate_bytes
        if self.bytes < needed:
            raise ValueError(
                f"AWQ: a memory budget of {human_bytes(self.bytes)} holds no candidate of {mapping} (its balance "
                f"layers' weights take {human_bytes(candidate_bytes)}, a search needs about "
                f"{human_bytes(needed)} beside the block): raise --max-memory"
            )


def search_budget(max_memory: int | None, block_bytes: int, device) -> SearchBudget:
    """The search's budget under ``max_memory`` (None: half the free memory, as a capture's): what
    is left once the block being searched and the copy it is smoothed in (``block_bytes`` each) are
    held; a budget they leave nothing of is one line."""
    total = default_max_memory(device) if max_memory is None else max_memory
    left = total - 2 * block_bytes
    if left <= 0:
        raise ValueError(
            f"AWQ: a memory budget of {human_bytes(total)} does not hold a block and its smoothed copy "
            f"({human_bytes(2 * block_bytes)}): raise --max-memory"
        )
    return SearchBudget(left)


def walk_budget(model: Model, mappings: list[Mapping], listed: dict[str, str], max_memory: int | None) -> SearchBudget:
    """The searches' budget under ``max_memory`` (``lab.awq.budget.search_budget``: less the largest
    searched block's listed layers and its copy), checked against every mapping's candidate (its
    balance layers' weights) before the walk starts."""
    infos = {info.name: info for info in model.layers()}
    size = torch.empty((), dtype=model.dtype).element_size()
    prefix = f"{blocks_name(model)}."
    blocks: dict[int, int] = {}
    for name, info in infos.items():
        index = name[len(prefix) :].split(".", 1)[0]
        if name.startswith(prefix) and index.isdigit():
            blocks[int(index)] = blocks.get(int(index), 0) + info.params * size
    budget = search_budget(max_memory, max(blocks.get(m.block, 0) for m in mappings), model.device)
    for mapping in mappings:
        budget.check(mapping.name, sum(math.prod(infos[listed[name]].shape) * size for name in mapping.balance))
    return budget
