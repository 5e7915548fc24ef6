"""Fused MoE experts as linear layers, for AWQ's search.

transformers 5 stores an MoE's experts as 3-D weights (``MixtralExperts``: ``gate_up_proj``
``(experts, 2·intermediate, hidden)``, ``down_proj`` ``(experts, hidden, intermediate)``), which have
no linear layers to balance. llm-compressor 0.14 linearizes them for calibration
(``modeling/moe/linear_experts``); so does the AWQ stage, in the block copy it smooths:
``LinearExperts`` holds each expert's ``gate_proj``, ``up_proj`` and ``down_proj`` as ``nn.Linear``
named as the lab lists them (``sample_models.layers``' ``ExpertLinear``: ``experts.3.up_proj``) and
computes what the fused module computes. Each expert takes its tokens in token order, so the
replicas of a batch a stacked replay repeats along the batch reach every expert as equal,
contiguous shares (``lab.awq.parent``)."""

from __future__ import annotations

import torch
from torch import nn

from sample_models.layers import is_fused_experts


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) · up(x))``."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate, up, down, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    layer.to(weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class LinearExperts(nn.ModuleList):
    """A fused experts module's experts as ``ExpertMLP``s, with its forward: each token's top-k
    experts' outputs, weighted by the router, summed."""

    def __init__(self, fused: nn.Module) -> None:
        gate_up, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        half = gate_up.shape[1] // 2
        gate_up_bias = getattr(fused, "gate_up_proj_bias", None)
        down_bias = getattr(fused, "down_proj_bias", None)

        def bias(tensor: torch.Tensor | None, index: int, part: slice = slice(None)) -> torch.Tensor | None:
            return None if tensor is None else tensor.detach()[index, part]

        super().__init__(
            ExpertMLP(
                _linear(gate_up[e, :half], bias(gate_up_bias, e, slice(None, half))),
                _linear(gate_up[e, half:], bias(gate_up_bias, e, slice(half, None))),
                _linear(down[e], bias(down_bias, e)),
                fused.act_fn,
            )
            for e in range(gate_up.shape[0])
        )

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        found = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self):
            tokens, position = torch.where(top_k_index == index)  # in token order
            if tokens.numel() == 0:
                continue
            y = expert(hidden_states[tokens])
            found.index_add_(0, tokens, (y * top_k_weights[tokens, position, None]).to(found.dtype))
        return found


def linearize(block: nn.Module) -> nn.Module:
    """``block`` with every fused experts module in it replaced by its ``LinearExperts`` (in place)."""
    fused = [name for name, module in block.named_modules() if name and is_fused_experts(module)]
    for name in fused:
        parent, _, leaf = name.rpartition(".")
        owner = block.get_submodule(parent) if parent else block
        setattr(owner, leaf, LinearExperts(owner.get_submodule(leaf)))
    return block


def expert_count(module: nn.Module | None) -> int:
    """How many experts an experts module holds: a list of linear experts or a fused module (0: neither)."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    if module is not None and is_fused_experts(module):
        return int(module.gate_up_proj.shape[0])
    return 0
