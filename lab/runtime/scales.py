"""Which scales a server keeps one of for a fused group (``lab.runtime.fusion``), and how it picks it.

vLLM's compressed-tensors loader, for the shards of one fused linear layer:

- NVFP4 (``tensor_group``) weights and inputs: one global scale, the ``max()`` of the shards'
  (``compressed_tensors_w4a4_nvfp4.py``, ``process_weights_after_loading``; the W4A16 Marlin path
  alike). A shard stored with a smaller global scale is then dequantized with another's: its
  weights come out shrunk by the ratio. In a fused MoE kernel, an expert's ``w13`` global scale is
  its ``w1``'s.
- FP8 per-tensor weights: every shard requantized with the largest shard scale
  (``requantize_with_max_scale``).
- Static per-tensor input scales: the largest shard's (``input_scale.max()``), across every expert
  of a fused MoE kernel too.

Integer per-tensor weight scales are expanded per channel (``convert_to_channelwise``), so each
shard keeps its own; per-channel, per-group and MX scales belong to their rows and blocks.

The lab therefore writes one value for every collapsed scale of a group: the one of the member
whose range reaches farthest (``observers.fused``), which the server's collapse leaves unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum

import torch

import observers as ob
from lab.runtime.fusion import Level, fused_groups, member_name, missing_members


class Collapse(StrEnum):
    """What a server keeps one of for a fused group's tensors of one kind."""

    GLOBAL_SCALE = "global scale"
    """NVFP4: one global scale; every member's block scales are read against it."""
    TENSOR_SCALE = "tensor scale"
    """A per-tensor scale (and zero point): one for the group."""


def collapse(spec: ob.QuantSpec, tensor: str) -> Collapse | None:
    """What a fusing server collapses of ``tensor`` (``weight`` or ``input``) quantized by ``spec``
    across a fused group, or None when each member keeps its own scales."""
    if spec.format.scale_kind == "e4m3":
        return Collapse.GLOBAL_SCALE
    if spec.strategy != "tensor" or spec.format.is_block:
        return None
    if tensor == "weight":
        return Collapse.TENSOR_SCALE if spec.format.kind == "float" else None
    if tensor == "input" and not spec.dynamic:
        return Collapse.TENSOR_SCALE
    return None


def level(tensor: str) -> Level:
    """The fusion level at which a server shares ``tensor``'s scales: a weight's within one fused
    linear layer, an input's across the whole kernel (every expert of a fused MoE layer)."""
    return Level.LINEAR if tensor == "weight" else Level.KERNEL


def shared_tensors(specs: Mapping[str, ob.QuantSpec]) -> dict[str, Collapse]:
    """The tensor kinds of a run (``RunConfig.specs``) whose scales a fusing server collapses, and how."""
    found = {tensor: collapse(specs[tensor], tensor) for tensor in ("weight", "input") if tensor in specs}
    return {tensor: how for tensor, how in found.items() if how is not None}


def serving_level(specs: Mapping[str, ob.QuantSpec]) -> Level | None:
    """The coarsest fusion level at which a run's scales are shared (None: nothing is): the layers
    of one unit at this level must be analysed together, on one rank, in one chunk."""
    shared = shared_tensors(specs)
    if "input" in shared:
        return Level.KERNEL
    return Level.LINEAR if shared else None


def with_fused_members(
    layers: Sequence[str], every_layer: Sequence[str], specs: Mapping[str, ob.QuantSpec]
) -> tuple[list[str], list[str]]:
    """``layers`` with every layer of ``every_layer`` that a server runs fused with one of them added
    (in model order), when a run of ``specs`` shares scales across such a group (``serving_level``):
    their served figures need the whole group. Also one note per group that grew."""
    serving = serving_level(specs)
    missing = {} if serving is None else missing_members(layers, every_layer, serving)
    if not missing:
        return list(layers), []
    wanted = set(layers) | {layer for added in missing.values() for layer in added}
    notes = [
        f"added {', '.join(added)}: a server runs them fused with the chosen layers as {unit} and they share "
        "its scales, so its figures need them"
        for unit, added in missing.items()
    ]
    return [layer for layer in every_layer if layer in wanted], notes


Packed = Mapping[str, Mapping[str, tuple[ob.QuantSpec, ob.QParams]]]
"""What a checkpoint packs: per layer, per tensor kind (``weight``, ``input``), its spec and qparams."""


def load_problems(packed: Packed, linear_layers: Iterable[str]) -> list[str]:
    """Why a fusing server would not run ``packed`` as the lab computed it, one line per fused group
    (empty: it would). ``linear_layers`` are the model's layers a server quantizes. A group must be
    packed whole (vLLM refuses a fused layer whose shards are quantized differently), in one format,
    and every scale the server collapses (``collapse``) must be one value across it, else the server
    replaces some members' scales with another's."""
    problems = []
    for name, members in fused_groups(linear_layers, Level.KERNEL):
        inside = [member for member in members if member in packed]
        if len(members) < 2 or not inside:
            continue
        left = [member for member in members if member not in packed]
        if left:
            problems.append(
                f"{name}: {_short(inside)} quantized but {_short(left)} not: a server loads them as one layer "
                "with one scheme (choose all of them, or none)"
            )
            continue
        formats = {
            json.dumps({t: spec.to_dict() for t, (spec, _) in packed[m].items()}, sort_keys=True) for m in members
        }
        if len(formats) > 1:
            problems.append(f"{name}: {_short(members)} have different schemes: a server runs them with one")
            continue
        for tensor in ("weight", "input"):
            problems += _unshared(packed, members, tensor)
    return problems


def _unshared(packed: Packed, members: Sequence[str], tensor: str) -> list[str]:
    """One line per fused group of ``members`` at ``tensor``'s level whose collapsed scale differs."""
    found = []
    for name, group in fused_groups([m for m in members if tensor in packed[m]], level(tensor)):
        spec = packed[group[0]][tensor][0]
        how = collapse(spec, tensor)
        if how is None or len(group) < 2:
            continue
        qparams = [packed[member][tensor][1] for member in group]
        values = [qp.global_scale if how == Collapse.GLOBAL_SCALE else qp.scale for qp in qparams]
        same = all(torch.equal(values[0].float().cpu(), value.float().cpu()) for value in values[1:])
        if how == Collapse.TENSOR_SCALE and same:
            same = all(torch.equal(qparams[0].zero_point.cpu(), qp.zero_point.cpu()) for qp in qparams[1:])
        if not same:
            shown = ", ".join(
                f"{member.rpartition('.')[2]} {float(value.float().reshape(-1)[0]):.6g}"
                for member, value in zip(group, values, strict=True)
            )
            found.append(
                f"{name}: {tensor} {how.value}s differ ({shown}): a server keeps one for the group and would "
                "read the others' values against it; export from a run of this lab, which shares them"
            )
    return found


def _short(layers: Sequence[str]) -> str:
    """``q_proj, k_proj`` for layers of one parent; ``0.w1, 1.w1`` for experts' layers."""
    return ", ".join(member_name(layer) for layer in layers)
