"""AWQ over a whole decoder, block by block, as llm-compressor's sequential pipeline runs it: each
block's calibration batches once through the block with hooks (each mapping's input statistics and
its parent's calls), each mapping searched (``search``) and smoothed in turn with the scales
llm-compressor would pick, then the batches through the smoothed block to feed the next one.

The model as loaded is never changed: each block is smoothed in a copy (its fused MoE experts as
linear layers, ``lab.awq.experts``), the copy feeds the next block and is dropped. Propagation is
float (llm-compressor's pipeline runs its calibration with quantization disabled), so every block
sees what llm-compressor's sees. A model the capture would take block by block (larger than the
memory budget, or ``sequential=True``) is walked the same way with one block's weights loaded at a
time (``sample_models.replay``): the copy is made while its block is loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import observers as ob
from lab.awq.experts import linearize
from lab.awq.fold import fold_mapping
from lab.awq.mappings import Mapping, Mappings, resolve
from lab.awq.parent import ParentCalls
from lab.awq.search import MappingInputs, MappingResult, search
from sample_models import Model
from sample_models.effect import held_out_texts
from sample_models.replay import Replay, blocks_name, calibration_batches, replay_of, structure

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``: called after each mapping."""


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
    sequential: bool | None = None,
    max_memory: int | None = None,
) -> AWQRun:
    """Every mapping of ``model`` with a balance layer among ``layers`` (None: every mapping)
    searched for every weight observer (``{name: knobs}``) under every ``Variant``, on the
    calibration set (``texts``, ``samples``, ``seq_len`` as a run's), and the picks measured on
    ``held_out`` text (default: the built-in held-out paragraphs, windowed the same way). The
    blocks are walked whole or one loaded at a time by ``sequential`` and ``max_memory``, as
    ``Model.capture`` takes them."""
    awq = awq or ob.AWQSpec()
    if not model.supports_activations:
        raise ValueError(f"AWQ needs calibration activations: {model.weights_only_reason}")
    if not observers:
        raise ValueError("AWQ needs at least one weight observer")
    searched = searched_mappings(model, layers)
    wanted = list(searched.found)
    _check_shapes(model, wanted, spec)
    held_texts = list(held_out_texts() if held_out is None else held_out)
    results: list[MappingResult] = []
    left_out = list(searched.left_out)
    last = max(m.block for m in wanted)
    with replay_of(model, sequential, max_memory) as replay:
        calibration = _Pass(replay, calibration_batches(model, texts, samples, seq_len, batch_size))
        checking = _Pass(replay, calibration_batches(model, held_texts, samples, seq_len, batch_size))
        for index in range(last + 1):
            with replay.block(index) as original:
                block = linearize(copy.deepcopy(original))
            prefix = f"{replay.blocks_name}.{index}."
            own = [m for m in wanted if m.block == index]
            seen = calibration.observe(block, own, prefix, index)
            checked = checking.observe(block, own, prefix, index)
            for mapping in own:
                if mapping.smooth not in seen:
                    left_out.append(f"{mapping.name}: no calibration token reached it: not smoothed")
                    continue
                inputs = seen[mapping.smooth]
                result = search(mapping, inputs, spec, awq, observers, gptq, checked.get(mapping.smooth))
                results.append(result)
                _smooth(block, mapping, prefix, result.searched)
                if progress is not None:
                    progress(len(results), len(wanted), mapping.name)
            calibration.advance(index, block)
            checking.advance(index, block)
    return AWQRun(spec, awq, dict(observers), results, tuple(left_out), calibration.tokens, checking.tokens)


def searched_mappings(model: Model, layers: Collection[str] | None) -> Mappings:
    """The mappings of ``model`` with a balance layer among ``layers`` (None: every mapping), in
    order, and what ``resolve`` left out; none is one ``ValueError`` line (an encoder's own line
    from ``resolve``)."""
    found = resolve(structure(model), blocks_name(model), model.name)
    wanted = tuple(m for m in found.found if layers is None or set(m.balance) & set(layers))
    if not wanted:
        raise ValueError(
            "AWQ: none of the chosen layers is a balance layer of a smoothing mapping (q/k/v, gate/up, o, down)"
        )
    return Mappings(wanted, found.left_out)


def run_of_config(
    model: Model, layers: Collection[str], config: Any, awq: ob.AWQSpec, progress: Progress | None = None
) -> AWQRun:
    """``run_awq`` beside a run: its layers, and its ``RunConfig``'s weight spec, weight observers
    (with their knobs), calibration set and how it holds the model (whole, or a block at a time)
    (the CLI's ``run --awq`` and the app's Run page)."""
    observers = {name: dict(config.knobs.get(name, {})) for name in config.observers_for("weight")}
    texts = config.dataset if config.dataset is not None else (list(config.texts) if config.texts else None)
    return run_awq(
        model,
        config.specs["weight"],
        observers,
        awq,
        layers=layers,
        texts=texts,
        samples=config.samples,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        progress=progress,
        gptq=config.gptq,
        sequential=config.sequential,
        max_memory=config.max_memory,
    )


class _Pass:
    """One set of batches walked through the blocks: the float model's block calls, each block's
    hidden states as the smoothed blocks before it hand them on."""

    def __init__(self, replay: Replay, batches: list) -> None:
        self.replay = replay.record(batches)
        self.valid = [b.valid for b in batches]
        self.hidden = self.replay.first
        self.tokens = int(sum(int(v.sum()) for v in self.valid))

    def observe(self, block: nn.Module, own: list[Mapping], prefix: str, index: int) -> dict[str, MappingInputs]:
        if not own:
            return {}
        return _observe_block(block, own, prefix, self.replay, index, self.hidden, self.valid)

    def advance(self, index: int, block: nn.Module) -> None:
        self.hidden = self.replay.run(index, block, self.hidden)


def _check_shapes(model: Model, mappings: list[Mapping], spec: ob.QuantSpec) -> None:
    """Refuse, in one line before any search, a group size that does not divide a balance layer."""
    if spec.strategy != "group":
        return
    columns_of = {info.name: info.shape[-1] for info in model.layers()}
    for mapping in mappings:
        for name in mapping.balance:
            columns = columns_of[name]
            if columns % spec.group_size:
                raise ValueError(
                    f"AWQ with groups of {spec.group_size}: {name} has {columns} input columns, which groups of "
                    f"{spec.group_size} do not divide; choose a group size that divides every balance layer's inputs"
                )


class _Inputs:
    """A mapping's input statistics as the batches pass: llm-compressor's float32 sum of ``|x|``
    and token count, and the float64 sum of ``x xᵀ``."""

    def __init__(self) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.outer: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        rows = x[valid] if x.dim() == 3 and tuple(x.shape[:2]) == tuple(valid.shape) else x.reshape(-1, x.shape[-1])
        rows = rows.detach()
        batch_sum = rows.abs().float().sum(dim=0)
        self.abs_sum = batch_sum if self.abs_sum is None else self.abs_sum + batch_sum
        wide = rows.double()
        self.outer = wide.T @ wide if self.outer is None else self.outer + wide.T @ wide
        self.count += rows.shape[0]


def _observe_block(
    block, own: list[Mapping], prefix: str, replay, index: int, hidden, valid
) -> dict[str, MappingInputs]:
    """One pass of the block over every batch with hooks: each mapping's input statistics (where
    ``_hooked`` says) and its parent's calls."""
    stats = {m.smooth: _Inputs() for m in own}
    parents = {m.parent: [] for m in own}
    current: list[torch.Tensor] = []

    def on_input(smooth: str):
        def hook(module, args, output):
            stats[smooth].add(args[0], current[0])

        return hook

    def on_parent(parent: str):
        def hook(module, args, kwargs):
            parents[parent].append((args, dict(kwargs)))

        return hook

    handles = [block.get_submodule(_hooked(m)[len(prefix) :]).register_forward_hook(on_input(m.smooth)) for m in own]
    handles += [
        block.get_submodule(name[len(prefix) :]).register_forward_pre_hook(on_parent(name), with_kwargs=True)
        for name in parents
    ]
    try:
        with torch.no_grad():
            for call, h, mask in zip(replay.calls[index], hidden, valid, strict=True):
                current[:] = [mask]
                call.invoke(block, h, {})
    finally:
        for handle in handles:
            handle.remove()
    seen = {}
    for m in own:
        found = stats[m.smooth]
        if found.count == 0:
            continue
        parent = block.get_submodule(m.parent[len(prefix) :])
        x_mean = found.abs_sum / torch.tensor(found.count)
        seen[m.smooth] = MappingInputs(
            ParentCalls(parent, parents[m.parent], valid),
            {name: block.get_submodule(name[len(prefix) :]) for name in m.balance},
            x_mean,
            found.outer / found.count,
            _widest(parent),
        )
    return seen


def _hooked(mapping: Mapping) -> str:
    """Where a mapping's input statistics are taken: its first balance layer, or an MoE's router,
    which sees every token (an expert sees only those routed to it), as llm-compressor hooks the
    first of its MoE balance layers, the router."""
    return (mapping.scaled or mapping.balance)[0]


def _widest(module: nn.Module) -> int:
    """The widest activation per token inside ``module`` (its linears' widths)."""
    widths = [max(m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)


def _smooth(block: nn.Module, mapping: Mapping, prefix: str, scales: torch.Tensor) -> None:
    """Fold ``scales`` into the block's copy (``fold.fold_mapping`` on its parameters)."""
    parameters = dict(block.named_parameters())
    fold_mapping(lambda key: parameters.get(key[len(prefix) :]), mapping, scales)
