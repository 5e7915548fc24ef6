"""AWQ over a whole decoder, block by block, as llm-compressor's sequential pipeline runs it: AWQ
rides a calibration pass (a ``sample_models`` block tap), keeping what each block receives; once a
block has had every batch its mappings' input statistics and parents' calls are taken on a copy of
it, each mapping is searched (``search``) and smoothed in turn with the scales llm-compressor would
pick, and the next block receives the smoothed copy's outputs.

The pass is a run's own: ``run_awq`` makes one (a capture of no layers) and ``AWQWalk`` rides the
analysis's (``run --awq``), so the analysis's observers and AWQ see the same calibration
activations. The capture walks the blocks one loaded at a time (its sequential form: a big model
never loads whole). The model as loaded is never changed: each block is smoothed in a copy (its
fused MoE experts as linear layers, ``lab.awq.experts``), which feeds the next block and is
dropped. Propagation is float (llm-compressor's pipeline calibrates with quantization disabled).
The held-out batches, which no run's pass carries, are recorded once and walked through the same
copies.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import observers as ob
from lab.allocator import large_blocks_mapped
from lab.awq.budget import walk_budget
from lab.awq.experts import linearize
from lab.awq.fold import fold_mapping
from lab.awq.inputs import MappingInputs, observe_block
from lab.awq.mappings import Mapping, Mappings, resolve
from lab.awq.parent import forward_swapped
from lab.awq.search import MappingResult, search
from sample_models import Model
from sample_models.capture import Propagation
from sample_models.effect import held_out_texts
from sample_models.replay import (
    BlockCalls,
    BlockInputs,
    blocks_name,
    calibration_batches,
    recording,
    replay_of,
    structure,
)
from sample_models.sequential import return_freed_memory


@dataclass(frozen=True)
class Step:
    """Where a walk is: mapping ``number`` (from 1) of ``mappings``, ``name``d, with ``done`` of the
    ``total`` candidates its search judges judged (``done == total`` once the mapping is over)."""

    number: int
    mappings: int
    name: str
    done: int
    total: int


Progress = Callable[[Step], None]
"""``progress(step)``: called as each mapping's search goes (a bar per mapping)."""


@dataclass
class AWQRun:
    """What AWQ made of a model: its mappings, each mapping's rows and scales (held-out figures in
    the rows), what was left out (one line each), and the tokens it saw."""

    spec: ob.QuantSpec
    awq: ob.AWQSpec
    observers: dict[str, dict[str, Any]]
    results: list[MappingResult]
    left_out: tuple[str, ...]
    tokens: int
    held_out_tokens: int


class AWQWalk:
    """AWQ riding a calibration pass (``sample_models.capture.BlockTap``): every mapping of the
    model with a balance layer among ``layers`` (None: every mapping), searched for every weight
    observer (``{name: knobs}``) under every ``Variant`` as the pass reaches its block, its picks
    measured on ``held_out`` text (default: the built-in held-out paragraphs, windowed as the
    calibration set by ``samples``, ``seq_len`` and ``batch_size``); ``result`` once the pass is
    over, also handed to ``searched`` as soon as the last mapping's block is done. A group size
    that does not divide a balance layer, or a model without mappings, is one ``ValueError`` before
    anything runs. ``passed`` says whether a pass has walked its last mapping's block, ``seconds``
    how long the walk itself took (recording the held-out calls, searching), not the pass it rode;
    ``listed``: each balance layer's name in the model's list (``searched_mappings``). What a
    mapping's search holds at once is within ``max_memory`` (None: half the free memory) less the
    block it searches and its smoothed copy (``lab.awq.budget``): a budget too small for one
    candidate of a mapping is one ``ValueError`` before anything runs too."""

    def __init__(
        self,
        model: Model,
        spec: ob.QuantSpec,
        observers: dict[str, dict[str, Any]],
        awq: ob.AWQSpec | None = None,
        *,
        layers: Collection[str] | None = None,
        samples: int = 32,
        seq_len: int = 128,
        batch_size: int = 1,
        held_out: Sequence[str] | None = None,
        progress: Progress | None = None,
        gptq: ob.GPTQSpec | None = None,
        max_memory: int | None = None,
        searched: Callable[[AWQRun], None] | None = None,
    ) -> None:
        if not model.supports_activations:
            raise ValueError(f"AWQ needs calibration activations: {model.weights_only_reason}")
        if not observers:
            raise ValueError("AWQ needs at least one weight observer")
        start = time.perf_counter()
        mappings, self.listed = searched_mappings(model, layers)
        self.wanted = list(mappings.found)
        _check_shapes(model, self.wanted, spec, self.listed)
        self.budget = walk_budget(model, self.wanted, self.listed, max_memory)
        self.spec, self.awq, self.observers, self.gptq = spec, awq or ob.AWQSpec(), dict(observers), gptq
        self.progress, self.searched = progress, searched
        self.last = max(m.block for m in self.wanted)
        self.results: list[MappingResult] = []
        self.left_out = list(mappings.left_out)
        self.tokens, self.passed = 0, False
        # The blocks after the first smoothed one receive the smoothed copies' outputs: equal in float
        # up to rounding, yet not the plain pass's, so results made on this pass are keyed apart.
        chosen = {"spec": spec.to_dict(), "awq": self.awq.to_dict(), "observers": self.observers}
        self.key = json.dumps({**chosen, "mappings": [m.name for m in self.wanted]}, sort_keys=True, default=str)
        held_texts = list(held_out_texts() if held_out is None else held_out)
        held_batches = calibration_batches(model, held_texts, samples, seq_len, batch_size)
        with replay_of(model, max_memory) as replay:
            self.blocks_name = replay.blocks_name
            self.checking = _HeldOut(replay.record(held_batches), held_batches)
        self._inputs, self._valid = BlockInputs(), []
        self.seconds = time.perf_counter() - start

    def hooks(self, index: int, block: nn.Module) -> AbstractContextManager:
        """What block ``index`` receives for each batch, kept while it runs (blocks after the last
        mapping's are not kept)."""
        self._inputs, self._valid = BlockInputs(), []
        return recording(block, self._inputs) if index <= self.last else nullcontext()

    def start(self, batch: Any) -> None:
        self._valid.append(batch.valid)

    @torch.no_grad()
    def finished(self, index: int, block: nn.Module) -> Propagation | None:
        """Block ``index`` has had every batch: its mappings searched and smoothed in its copy, and
        the copy's outputs what the next block receives (``None``: the block's own)."""
        if index == 0:
            self.tokens = int(sum(int(v.sum()) for v in self._valid))
        if index > self.last:
            return None
        start = time.perf_counter()
        try:
            propagation = self._search_block(index, block)
        finally:
            self.seconds += time.perf_counter() - start
        self.passed = index == self.last
        return propagation

    def _search_block(self, index: int, block: nn.Module) -> Propagation | None:
        own = [m for m in self.wanted if m.block == index]
        if not own:
            self.checking.advance(index, block)
            return None
        changed = linearize(copy.deepcopy(block))
        prefix = f"{self.blocks_name}.{index}."
        seen = observe_block(changed, own, prefix, self._inputs, self._valid)
        checked = self.checking.observe(changed, own, prefix, index)
        for mapping in own:
            if mapping.smooth not in seen:
                self.left_out.append(f"{mapping.name}: no calibration token reached it: not smoothed")
                continue
            found = search(
                mapping,
                seen[mapping.smooth],
                self.spec,
                self.awq,
                self.observers,
                self.gptq,
                checked.get(mapping.smooth),
                self.budget,
                self._progress_of(mapping),
            )
            self.results.append(found)
            _smooth(changed, mapping, prefix, found.searched)
        # the block's recorded calls and moments go before the held-out batches run through the copy
        # (and, after the last block, before the deployment folds every balance layer)
        del seen, checked
        self._inputs = BlockInputs()
        return_freed_memory()
        self.checking.advance(index, changed)
        if index == self.last and self.searched is not None:
            self.searched(self.result())
        return lambda module: forward_swapped(block, changed.forward)

    def _progress_of(self, mapping: Mapping) -> Callable[[int, int], None] | None:
        """The search's ``progress(done, total)`` as this walk's steps of ``mapping``."""
        if self.progress is None:
            return None
        number = self.wanted.index(mapping) + 1
        return lambda done, total: self.progress(Step(number, len(self.wanted), mapping.name, done, total))

    def result(self) -> AWQRun:
        """What the walk found (after the pass)."""
        return AWQRun(
            self.spec,
            self.awq,
            self.observers,
            self.results,
            tuple(self.left_out),
            self.tokens,
            self.checking.tokens,
        )


@torch.no_grad()
def run_awq(
    model: Model,
    spec: ob.QuantSpec,
    observers: dict[str, dict[str, Any]],
    awq: ob.AWQSpec | None = None,
    *,
    layers: Collection[str] | None = None,
    texts=None,
    samples: int = 32,
    seq_len: int = 128,
    batch_size: int = 1,
    held_out: Sequence[str] | None = None,
    progress: Progress | None = None,
    gptq: ob.GPTQSpec | None = None,
    max_memory: int | None = None,
) -> AWQRun:
    """``AWQWalk`` on a calibration pass of its own over ``texts`` (as a run's: ``samples``,
    ``seq_len``, ``batch_size``), the blocks loaded one at a time under ``max_memory``."""
    walk = AWQWalk(
        model,
        spec,
        observers,
        awq,
        layers=layers,
        samples=samples,
        seq_len=seq_len,
        batch_size=batch_size,
        held_out=held_out,
        progress=progress,
        gptq=gptq,
        max_memory=max_memory,
    )
    model.capture([], texts, samples, seq_len, batch_size=batch_size, max_memory=max_memory, tap=walk)
    return walk.result()


def searched_mappings(model: Model, layers: Collection[str] | None) -> tuple[Mappings, dict[str, str]]:
    """The mappings of ``model`` with a balance layer among ``layers`` (None: every mapping), in
    order, and what ``resolve`` left out; none is one ``ValueError`` line (an encoder's own line
    from ``resolve``). A balance layer counts by the name the model lists it under: its module's,
    or where its checkpoint stores it (``listed_names``: a hub Mixtral's experts,
    ``block_sparse_moe.experts.<e>.w1``), which comes back beside the mappings; a mapping with a
    balance layer the model lists under neither is left out with a line saying so."""
    found = resolve(structure(model), blocks_name(model), model.name)
    listed = listed_names(model, [name for mapping in found.found for name in mapping.balance])
    chosen = None if layers is None else set(layers)
    wanted, left_out = [], list(found.left_out)
    for mapping in found.found:
        names = {listed.get(name, name) for name in mapping.balance}
        if chosen is not None and not names & chosen:
            continue
        unlisted = [name for name in mapping.balance if name not in listed]
        if unlisted:
            left_out.append(f"{mapping.name}: the model lists no layer {unlisted[0]} under any name: not smoothed")
            continue
        wanted.append(mapping)
    if not wanted:
        raise ValueError(
            "AWQ: none of the chosen layers is a balance layer of a smoothing mapping (q/k/v, gate/up, o, down)"
        )
    return Mappings(tuple(wanted), tuple(left_out)), listed


def listed_names(model: Model, names: Collection[str]) -> dict[str, str]:
    """Each of the module ``names`` the model lists as a layer, by the name it lists it under: the
    module's own, or the layer its checkpoint stores the weight as (``Model.stored_key``: a hub
    Mixtral's experts, stored one projection per expert, loaded fused). A name the model lists
    under neither is left out."""
    listed = {info.name for info in model.layers()}
    found = {}
    for name in names:
        if name in listed:
            found[name] = name
            continue
        stored = model.stored_key(f"{name}.weight")
        if stored is not None and stored.removesuffix(".weight") in listed:
            found[name] = stored.removesuffix(".weight")
    return found


def walk_of_config(
    model: Model,
    layers: Collection[str],
    config: Any,
    awq: ob.AWQSpec,
    progress: Progress | None = None,
    searched: Callable[[AWQRun], None] | None = None,
) -> AWQWalk:
    """``AWQWalk`` beside a run: its layers, and its ``RunConfig``'s weight spec, weight observers
    (with their knobs), calibration windows and memory budget (the CLI's ``run --awq``, which hands
    it to the analysis's pass, and the app's Run page, ``lab.awq.session``)."""
    observers = {name: dict(config.knobs.get(name, {})) for name in config.observers_for("weight")}
    return AWQWalk(
        model,
        config.specs["weight"],
        observers,
        awq,
        layers=layers,
        samples=config.samples,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        progress=progress,
        gptq=config.gptq,
        max_memory=config.max_memory,
        searched=searched,
    )


class _HeldOut:
    """The held-out batches walked through the blocks: the float model's block calls, recorded once,
    and each block's hidden states as the smoothed blocks before it hand them on."""

    def __init__(self, calls: BlockCalls, batches: list) -> None:
        self.calls = calls
        self.valid = [b.valid for b in batches]
        self.hidden = calls.first
        self.tokens = int(sum(int(v.sum()) for v in self.valid))

    def observe(self, block: nn.Module, own: list[Mapping], prefix: str, index: int) -> dict[str, MappingInputs]:
        return observe_block(block, own, prefix, self.calls.inputs(index, self.hidden), self.valid)

    def advance(self, index: int, block: nn.Module) -> None:
        self.hidden = self.calls.inputs(index, self.hidden).run(block)


def _check_shapes(model: Model, mappings: list[Mapping], spec: ob.QuantSpec, listed: dict[str, str]) -> None:
    """Refuse, in one line before any search, a group size that does not divide a balance layer
    (``listed``: each balance layer's name in the model's list, ``listed_names``)."""
    if spec.strategy != "group":
        return
    columns_of = {info.name: info.shape[-1] for info in model.layers()}
    for mapping in mappings:
        for name in mapping.balance:
            columns = columns_of[listed[name]]
            if columns % spec.group_size:
                raise ValueError(
                    f"AWQ with groups of {spec.group_size}: {name} has {columns} input columns, which groups of "
                    f"{spec.group_size} do not divide; choose a group size that divides every balance layer's inputs"
                )


@large_blocks_mapped()
def _smooth(block: nn.Module, mapping: Mapping, prefix: str, scales: torch.Tensor) -> None:
    """Fold ``scales`` into the block's copy (``fold.fold_mapping`` on its parameters); its float64
    products, a 7B-wide layer's 360 MB each, are mapped for themselves (``lab.allocator``)."""
    parameters = dict(block.named_parameters())
    fold_mapping(lambda key: parameters.get(key[len(prefix) :]), mapping, scales)
