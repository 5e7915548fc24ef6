"""Where AWQ smooths a decoder: llm-compressor 0.14's default mappings for Llama-, Qwen-, Mistral- and
Mixtral-style decoders, found by module names.

Each block has up to four: ``input_layernorm`` → q/k/v (judged on the attention's output),
``v_proj`` → ``o_proj`` where ``o_proj`` takes ``v_proj``'s width (grouped-query attention's
narrower ``v_proj`` does not), ``post_attention_layernorm`` → gate/up (the MLP's output; an MoE's
router and every expert's gate/up, as llm-compressor's MoE mappings), and ``up_proj`` →
``down_proj`` (``down_proj``'s output; per expert). The parent, whose output a candidate is judged
on, is the balance layers' lowest common ancestor that is not a ``ModuleList``. Experts stored as
one fused 3-D weight (transformers' ``MixtralExperts``) are named as the lab lists them
(``experts.3.up_proj``), as the AWQ stage's block copies hold them (``lab.awq.experts``); an MoE's
router, a linear or not (``MixtralTopKRouter``), takes the scales along with its 2-D weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lab.awq.experts import expert_count

NOT_A_DECODER = (
    "AWQ smooths a decoder's norms into the layers after them (input_layernorm → q/k/v, "
    "post_attention_layernorm → gate/up); {model} has no such layers: run it without --awq"
)


@dataclass(frozen=True)
class Mapping:
    """One smoothing: ``smooth``'s output channels divided by the scales, the ``balance`` layers'
    input columns multiplied by them, candidates judged on ``parent``'s output."""

    smooth: str
    balance: tuple[str, ...]
    parent: str
    block: int
    scaled: tuple[str, ...] = ()
    """Layers that take the scales without being quantized (an MoE's router)."""

    @property
    def name(self) -> str:
        """The smooth layer and its balance layers' last names (an MoE's: how many experts)."""
        leaves = list(dict.fromkeys(b.rsplit(".", 1)[-1] for b in self.balance))
        experts = len(self.balance) // len(leaves)
        return f"{self.smooth} → {', '.join(leaves)}" + (f" of {experts} experts" if experts > 1 else "")


@dataclass(frozen=True)
class Mappings:
    """A model's mappings in the order llm-compressor smooths them (block by block; in a block:
    q/k/v, v → o, gate/up, up → down), and the ones left out, one line each."""

    found: tuple[Mapping, ...]
    left_out: tuple[str, ...]

    def of_block(self, block: int) -> list[Mapping]:
        return [m for m in self.found if m.block == block]


def _linear(modules: dict[str, nn.Module], name: str) -> nn.Linear | None:
    module = modules.get(name)
    return module if isinstance(module, nn.Linear) else None


def _ancestor(names: list[str], modules: dict[str, nn.Module]) -> str:
    """The balance layers' lowest common ancestor, skipping ``ModuleList``s (whose forward is never
    called: an MoE's experts list)."""
    parts = [n.split(".") for n in names]
    common = []
    for column in zip(*parts, strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    if len(names) == 1:
        common = parts[0]
    while common and isinstance(modules.get(".".join(common)), nn.ModuleList):
        common = common[:-1]
    return ".".join(common)


def _experts(modules: dict[str, nn.Module], mlp: str) -> list[tuple[str, str, str] | None]:
    """``(gate, up, down)`` of each expert of an MoE MLP, in order (None: an expert whose layers are
    not linear); a fused experts module's are named as the lab lists them."""
    experts = modules.get(f"{mlp}.experts")
    prefixes = [f"{mlp}.experts.{i}" for i in range(expert_count(experts))]
    if isinstance(experts, nn.ModuleList):
        return [_pair(modules, prefix) for prefix in prefixes]
    return [tuple(f"{prefix}.{leaf}" for leaf in ("gate_proj", "up_proj", "down_proj")) for prefix in prefixes]


def _pair(modules: dict[str, nn.Module], prefix: str) -> tuple[str, str, str] | None:
    """``(gate, up, down)`` of a gated MLP or expert: gate_proj/up_proj/down_proj or w1/w3/w2."""
    for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        names = tuple(f"{prefix}.{leaf}" for leaf in (gate, up, down))
        if all(_linear(modules, n) is not None for n in names):
            return names
    return None


def _router(modules: dict[str, nn.Module], mlp: str) -> tuple[str, ...]:
    """An MoE's router when it has a 2-D weight to scale (``nn.Linear`` or transformers' own)."""
    weight = getattr(modules.get(f"{mlp}.gate"), "weight", None)
    return (f"{mlp}.gate",) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else ()


def resolve(root: nn.Module, blocks_name: str, model_name: str) -> Mappings:
    """The mappings of ``root``'s blocks (``blocks_name``: the ModuleList of decoder blocks); a
    model with none (an encoder) is one ``ValueError`` line."""
    modules = dict(root.named_modules())
    blocks = modules.get(blocks_name)
    count = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
    found: list[Mapping] = []
    left_out: list[str] = []
    for index in range(count):
        prefix = f"{blocks_name}.{index}"
        found += _attention(modules, prefix, index)
        mlp_found, mlp_left = _mlp(modules, prefix, index)
        found += mlp_found
        left_out += mlp_left
    if not found:
        raise ValueError(NOT_A_DECODER.format(model=model_name))
    return Mappings(tuple(found), tuple(left_out))


def _attention(modules: dict[str, nn.Module], prefix: str, index: int) -> list[Mapping]:
    norm, attn = f"{prefix}.input_layernorm", f"{prefix}.self_attn"
    qkv = [f"{attn}.{leaf}_proj" for leaf in ("q", "k", "v")]
    if norm not in modules or any(_linear(modules, n) is None for n in qkv):
        return []
    found = [Mapping(norm, tuple(qkv), _ancestor(qkv, modules), index)]
    v, o = _linear(modules, qkv[2]), _linear(modules, f"{attn}.o_proj")
    if o is not None and v.out_features == o.in_features:
        found.append(Mapping(qkv[2], (f"{attn}.o_proj",), f"{attn}.o_proj", index))
    return found


def _mlp(modules: dict[str, nn.Module], prefix: str, index: int) -> tuple[list[Mapping], list[str]]:
    norm, mlp = f"{prefix}.post_attention_layernorm", f"{prefix}.mlp"
    if norm not in modules or mlp not in modules:
        return [], []
    dense = _pair(modules, mlp)
    if dense is not None:
        gate, up, down = dense
        return [Mapping(norm, (gate, up), mlp, index), Mapping(up, (down,), down, index)], []
    experts = _experts(modules, mlp)
    if not experts or any(triple is None for triple in experts):
        return [], [f"{norm} → the experts: {mlp}'s experts are not gated linear layers: not smoothed"]
    balance = tuple(name for gate, up, _ in experts for name in (gate, up))
    found = [Mapping(norm, balance, mlp, index, scaled=_router(modules, mlp))]
    found += [Mapping(up, (down,), down, index) for _, up, down in experts]
    return found, []
