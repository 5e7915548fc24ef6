"""Where AWQ smooths a decoder: llm-compressor 0.14's default mappings for Llama-, Qwen-, Mistral- and
Mixtral-style decoders, found by module names.

Each block has up to four: ``input_layernorm`` → q/k/v (judged on the attention's output),
``v_proj`` → ``o_proj`` where ``o_proj`` takes ``v_proj``'s width (grouped-query attention's
narrower ``v_proj`` does not), ``post_attention_layernorm`` → gate/up (the MLP's output; an MoE's
router and every expert's gate/up, as llm-compressor's MoE mappings), and ``up_proj`` →
``down_proj`` (``down_proj``'s output; per expert). The parent, whose output a candidate is judged
on, is the balance layers' lowest common ancestor that is not a ``ModuleList``. Experts stored as
one fused 3-D weight (transformers' ``MixtralExperts``) have no linear layers to balance: their
mappings are left out, each with a line saying so.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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
        return f"{self.smooth} → {', '.join(b.rsplit('.', 1)[-1] for b in self.balance)}"


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


def _experts(modules: dict[str, nn.Module], mlp: str) -> list[str]:
    """The expert prefixes of an MoE MLP with linear experts (``mlp.experts.N``), in order."""
    experts = modules.get(f"{mlp}.experts")
    if not isinstance(experts, nn.ModuleList):
        return []
    return [f"{mlp}.experts.{i}" for i in range(len(experts))]


def _pair(modules: dict[str, nn.Module], prefix: str) -> tuple[str, str, str] | None:
    """``(gate, up, down)`` of a gated MLP or expert: gate_proj/up_proj/down_proj or w1/w3/w2."""
    for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        names = tuple(f"{prefix}.{leaf}" for leaf in (gate, up, down))
        if all(_linear(modules, n) is not None for n in names):
            return names
    return None


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
    experts = [(e, _pair(modules, e)) for e in _experts(modules, mlp)]
    if not experts or any(pair is None for _, pair in experts):
        return [], [
            f"{norm} → the experts: {mlp}'s experts are not linear layers (one fused weight per "
            "projection): not smoothed"
        ]
    router = (f"{mlp}.gate",) if _linear(modules, f"{mlp}.gate") is not None else ()
    balance = tuple(name for _, (gate, up, _) in experts for name in (gate, up))
    found = [Mapping(norm, balance, mlp, index, scaled=router)]
    found += [Mapping(up, (down,), down, index) for _, (_, up, down) in experts]
    return found, []
