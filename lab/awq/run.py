"""AWQ over a whole decoder, block by block, as llm-compressor's sequential pipeline runs it: each
block's calibration batches once through the block with hooks (each mapping's input statistics
and its parent's calls), each mapping searched (``search``) and smoothed in turn with the scales
llm-compressor would pick, then the batches through the smoothed block to feed the next one.

The model as loaded is never changed: each block is smoothed in a copy, the copy feeds the next
block and is dropped. Propagation is float (llm-compressor's pipeline runs its calibration with
quantization disabled), so every block sees what llm-compressor's sees.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import observers as ob
from lab.awq.fold import fold_mapping
from lab.awq.mappings import Mapping, Mappings, resolve
from lab.awq.parent import ParentCalls
from lab.awq.search import SEARCH_OBSERVER, MappingInputs, MappingResult, Variant, search
from sample_models import Model
from sample_models.replay import calibration_batches, record_blocks

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``: called after each mapping."""


@dataclass
class AWQRun:
    """What AWQ made of a model: its mappings (and those left out), each mapping's rows and scales,
    and the calibration it saw."""

    spec: ob.QuantSpec
    awq: ob.AWQSpec
    observers: dict[str, dict[str, Any]]
    mappings: Mappings
    results: list[MappingResult]
    tokens: int

    def result(self, mapping: str) -> MappingResult:
        """A mapping's result by its smooth layer's name."""
        return next(r for r in self.results if r.mapping.smooth == mapping)


def run_awq(
    model: Model,
    spec: ob.QuantSpec,
    observers: dict[str, dict[str, Any]],
    awq: ob.AWQSpec | None = None,
    *,
    texts=None,
    samples: int = 32,
    seq_len: int = 128,
    batch_size: int = 1,
    progress: Progress | None = None,
) -> AWQRun:
    """Every mapping of ``model`` searched for every weight observer (``{name: knobs}``) under every
    ``Variant``, on the calibration set (``texts``, ``samples``, ``seq_len`` as a run's)."""
    awq = awq or ob.AWQSpec()
    if not model.supports_activations:
        raise ValueError(f"AWQ needs calibration activations: {model.weights_only_reason}")
    if not observers:
        raise ValueError("AWQ needs at least one weight observer")
    batches = calibration_batches(model, texts, samples, seq_len, batch_size)
    replay = record_blocks(model, batches)
    mappings = resolve(model.module(), replay.blocks_name, model.name)
    _check_shapes(model.module(), mappings, spec)
    valid = [b.valid for b in batches]
    results: list[MappingResult] = []
    hidden = replay.first
    total = len(mappings.found)
    for index, original in enumerate(replay.blocks):
        block = copy.deepcopy(original)
        prefix = f"{replay.blocks_name}.{index}."
        own = mappings.of_block(index)
        if own:
            seen = _observe_block(block, own, prefix, replay, index, hidden, valid)
            for mapping in own:
                result = search(mapping, seen[mapping.smooth], spec, awq, observers)
                results.append(result)
                _smooth(block, mapping, prefix, result.scales[(Variant.LLM_COMPRESSOR, _any(result))])
                if progress is not None:
                    progress(len(results), total, mapping.name)
        hidden = replay.run(index, block, hidden)
    tokens = int(sum(int(v.sum()) for v in valid))
    return AWQRun(spec, awq, dict(observers), mappings, results, tokens)


def _any(result: MappingResult) -> str:
    """An observer with llm-compressor's scales (they do not depend on the observer)."""
    found = [observer for variant, observer in result.scales if variant == Variant.LLM_COMPRESSOR]
    if not found:
        reasons = {r.error for r in result.rows if r.error}
        raise ValueError(f"{result.mapping.name}: no observer gave qparams: {'; '.join(sorted(reasons))}")
    return found[0]


def _check_shapes(root: nn.Module, mappings: Mappings, spec: ob.QuantSpec) -> None:
    """Refuse, in one line before any search, a group size that does not divide a balance layer."""
    if spec.strategy != "group":
        return
    for mapping in mappings.found:
        for name in mapping.balance:
            columns = root.get_submodule(name).in_features
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
    """One pass of the block over every batch with hooks: each mapping's input statistics (on its
    first balance layer's input) and its parent's calls."""
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

    handles = [block.get_submodule(m.balance[0][len(prefix) :]).register_forward_hook(on_input(m.smooth)) for m in own]
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


def _widest(module: nn.Module) -> int:
    """The widest activation per token inside ``module`` (its linears' widths)."""
    widths = [max(m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)


def _smooth(block: nn.Module, mapping: Mapping, prefix: str, scales: torch.Tensor) -> None:
    """Fold ``scales`` into the block's copy (``fold.fold_mapping`` on its parameters)."""
    parameters = dict(block.named_parameters())
    fold_mapping(lambda key: parameters.get(key[len(prefix) :]), mapping, scales)


__all__ = ["SEARCH_OBSERVER", "AWQRun", "run_awq"]
