"""Which layers a server runs as one, the one rule every stage reads (analysis, choice, GPTQ,
allocation, checkpoint, recipe).

vLLM (and SGLang) load a decoder's query, key and value projections into one linear layer
(``qkv_proj``), its gate and up projections into another (``gate_up_proj``), DeepSeek's
``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, and a BERT-style encoder's
``query``, ``key`` and ``value`` into ``qkv_proj``; a mixture-of-experts layer's experts run as one
fused MoE kernel, every expert's gate and up projections (``w1``/``w3``) as ``w13`` and every
expert's down projection as ``w2``. llm-compressor 0.14 links the observers of the first four
(``observers/helpers.py``, ``FUSED_LAYER_NAMES``: gate/up, q/k/v, q_a/kv_a_with_mqa, w1/w3); the
BERT encoders are what vLLM fuses beyond them.

Two levels, because a server collapses different things at each:

- ``Level.LINEAR``: the shards of one linear layer (an attention's q/k/v, an MLP's or one expert's
  gate/up). They share a scheme, and a server keeps one value of each per-tensor scale: NVFP4's
  global scale (``max()`` of the shards'), an FP8 per-tensor weight scale (every shard requantized
  with the largest), a static input scale (the largest).
- ``Level.KERNEL``: what one kernel runs, the linear shards and, in a mixture of experts, every
  expert of the layer together (``w13``, ``w2``). They share a scheme and their static input
  scales (vLLM's MoE kernels take one activation scale per layer); each expert keeps its own
  weight scales.

A name no rule matches is a group of its own. The rules go by a layer's name: a sibling set under
one parent module, as llm-compressor's ``fuse_weight_observers`` matches them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from enum import StrEnum


class Level(StrEnum):
    """What a group of fused layers is: the shards of one linear layer, or one kernel's layers."""

    LINEAR = "linear"
    KERNEL = "kernel"


LINEAR_FUSIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
    (("q_a_proj", "kv_a_proj_with_mqa"), "fused_qkv_a_proj"),
    (("w1", "w3"), "w13"),
    (("query", "key", "value"), "qkv_proj"),
)
"""Sibling layer names a server loads into one linear layer, and what it calls that layer."""
LLM_COMPRESSOR_LINKS = LINEAR_FUSIONS[:4]
"""The fusions whose NVFP4 global scales llm-compressor 0.14 links (``FUSED_LAYER_NAMES``); it
links no per-tensor scale, and no BERT query/key/value."""

EXPERT_FUSIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gate_proj", "up_proj", "w1", "w3"), "experts w13 (gate and up)"),
    (("down_proj", "w2"), "experts w2 (down)"),
)
"""An expert's layer names that one fused MoE kernel runs together across the layer's experts."""

_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.(?P<name>[^.]+)$")


def _linear_unit(layer: str) -> str | None:
    parent, _, name = layer.rpartition(".")
    for members, fused in LINEAR_FUSIONS:
        if name in members and parent:
            return f"{parent} {fused}"
    return None


def linked_by_llm_compressor(layer: str) -> bool:
    """Whether llm-compressor's ``fuse_weight_observers`` links ``layer``'s NVFP4 global scale with
    its fused siblings'."""
    return layer.rpartition(".")[2] in {name for members, _ in LLM_COMPRESSOR_LINKS for name in members}


def _kernel_unit(layer: str) -> str | None:
    found = _EXPERT.match(layer)
    if found:
        for members, fused in EXPERT_FUSIONS:
            if found["name"] in members:
                return f"{found['experts']} {fused}"
    return _linear_unit(layer)


def member_name(layer: str) -> str:
    """How a fused group's line names one member: ``q_proj``; an expert's ``0.w1``."""
    return ".".join(layer.split(".")[-2:]) if _EXPERT.match(layer) else layer.rpartition(".")[2]


def unit(layer: str, level: Level = Level.LINEAR) -> str:
    """The fused unit ``layer`` belongs to at ``level`` (``model.layers.0.self_attn qkv_proj``), or
    the layer itself when no server fuses it."""
    found = _linear_unit(layer) if level == Level.LINEAR else _kernel_unit(layer)
    return layer if found is None else found


def fused_groups(layers: Iterable[str], level: Level = Level.KERNEL) -> list[tuple[str, list[str]]]:
    """``layers`` in the groups a server fuses at ``level``, in the order their first layer comes:
    each group's name (its fused unit, or the layer itself when it is alone) and its layers in their
    own order. The default, ``Level.KERNEL``, is what must share a scheme."""
    groups: dict[str, list[str]] = {}
    for layer in layers:
        groups.setdefault(unit(layer, level), []).append(layer)
    return list(groups.items())


def missing_members(chosen: Sequence[str], every_layer: Iterable[str], level: Level) -> dict[str, list[str]]:
    """Per fused unit of ``chosen`` at ``level``, the model's layers (``every_layer``) in that unit that
    ``chosen`` leaves out: what a server would run fused with them. Units with none missing are left out."""
    wanted = {unit(layer, level) for layer in chosen}
    picked = set(chosen)
    missing: dict[str, list[str]] = {}
    for layer in every_layer:
        name = unit(layer, level)
        if name in wanted and layer not in picked and name != layer:
            missing.setdefault(name, []).append(layer)
    return missing
