"""What a mapping's search reads, taken from one pass of a block's copy over what it received
(``observe_block``): the parent's recorded calls, the balance layers, llm-compressor's mean
``|x|`` per channel and the inputs' second moment (``InputMoment``), hooked where llm-compressor
hooks them (``hooked``: the first balance layer, or an MoE's router, which sees every token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lab.awq.mappings import Mapping
from lab.awq.moment import InputMoment
from lab.awq.parent import ParentCalls
from sample_models.replay import BlockInputs


@dataclass(frozen=True)
class MappingInputs:
    """What a mapping's search reads: the parent's calls, the quantized balance layers, the mean
    absolute input per channel ``x_mean`` (llm-compressor's statistic) and the mean ``x xᵀ`` of
    the balance layers' input (``moment``, float64, ``(in, in)``)."""

    parent: ParentCalls
    balance: dict[str, nn.Linear]
    x_mean: torch.Tensor
    moment: InputMoment
    width: int


class _Statistics:
    """A mapping's input statistics as the batches pass: llm-compressor's float32 sum of ``|x|``
    and token count, and the second moment of ``x`` (``InputMoment``)."""

    def __init__(self) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.moment: InputMoment | None = None
        self.count = 0

    def add(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        """One batch's input ``x``: its real tokens' rows, a view of ``x`` itself where every token is
        real (the parent's recorded call holds the same tensor, so the moment holds no second copy)."""
        padded = x.dim() == 3 and tuple(x.shape[:2]) == tuple(valid.shape) and not bool(valid.all())
        rows = (x[valid] if padded else x.reshape(-1, x.shape[-1])).detach()
        batch_sum = rows.abs().float().sum(dim=0)
        self.abs_sum = batch_sum if self.abs_sum is None else self.abs_sum + batch_sum
        if self.moment is None:
            self.moment = InputMoment(rows.shape[-1])
        self.moment.add(rows)
        self.count += rows.shape[0]


def observe_block(
    block: nn.Module, own: list[Mapping], prefix: str, inputs: BlockInputs, valid: list[torch.Tensor]
) -> dict[str, MappingInputs]:
    """One pass of the block (a copy, its experts linear) over what it received for every batch,
    with hooks: each mapping's input statistics (where ``hooked`` says) and its parent's calls."""
    stats = {m.smooth: _Statistics() for m in own}
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

    handles = [block.get_submodule(hooked(m)[len(prefix) :]).register_forward_hook(on_input(m.smooth)) for m in own]
    handles += [
        block.get_submodule(name[len(prefix) :]).register_forward_pre_hook(on_parent(name), with_kwargs=True)
        for name in parents
    ]
    try:
        with torch.no_grad():
            for call, h, mask in zip(inputs.calls, inputs.hidden, valid, strict=True):
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
            found.moment,
            _widest(parent),
        )
    return seen


def hooked(mapping: Mapping) -> str:
    """Where a mapping's input statistics are taken: its first balance layer, or an MoE's router,
    which sees every token (an expert sees only those routed to it), as llm-compressor hooks the
    first of its MoE balance layers, the router."""
    return (mapping.scaled or mapping.balance)[0]


def _widest(module: nn.Module) -> int:
    """The widest activation per token inside ``module`` (its linears' widths)."""
    widths = [max(m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=1)
