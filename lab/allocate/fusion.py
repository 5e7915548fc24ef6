"""Which layers must share a scheme because a server runs them as one kernel (issue 34). vLLM fuses
a decoder's query, key and value projections (``qkv_proj``) and its gate and up projections
(``gate_up_proj``), and runs a mixture-of-experts layer's experts as one fused MoE kernel: every
expert's gate and up projections together (``w13``) and every expert's down projection (``w2``),
all in one scheme each. Their observers may still differ per layer.

The rules go by the layers' names, per family of architecture (``FUSIONS``); a name no rule matches
is a group of its own. Encoders (BERT, MiniLM) are served unfused by the engines the lab exports
for, so none is assumed there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

FUSIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "decoder (Llama, Mistral, Qwen)": (
        (r"^(?P<key>.*\.self_attn)\.(q|k|v)_proj$", "qkv_proj"),
        (r"^(?P<key>.*\.mlp)\.(gate|up)_proj$", "gate_up_proj"),
    ),
    "mixture of experts (Mixtral)": (
        (r"^(?P<key>.*\.experts)\.\d+\.(gate|up)_proj$", "experts w13 (gate and up)"),
        (r"^(?P<key>.*\.experts)\.\d+\.down_proj$", "experts w2 (down)"),
    ),
}
"""Per family: a pattern whose ``key`` group names the fused unit, and what a server calls it."""


def fused_groups(layers: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``layers`` in groups that share a scheme, in the order their first layer comes: each group's
    name (``model.layers.0.self_attn qkv_proj``, or the layer itself when it is alone) and its
    layers in their own order."""
    groups: dict[str, list[str]] = {}
    for layer in layers:
        groups.setdefault(_unit(layer), []).append(layer)
    return list(groups.items())


def _unit(layer: str) -> str:
    for rules in FUSIONS.values():
        for pattern, fused in rules:
            found = re.match(pattern, layer)
            if found:
                return f"{found['key']} {fused}"
    return layer
