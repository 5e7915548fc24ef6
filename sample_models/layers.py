"""Layer descriptions, layer filters and the mapping from layer names to weights in a module.

A "layer" is anything with a weight matrix an observer can look at: nn.Linear, transformers'
Conv1D (GPT-2 style, stored transposed), nn.Conv2d, nn.Embedding, any other module with a 2-D
``weight`` (MoE routers), and each expert projection of a fused MoE experts module. Weights are
always reported and returned as (out, in) so that per-channel observers see the same layout
whatever the storage.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

LAYER_TYPES = (nn.Linear, Conv1D, nn.Conv2d, nn.Embedding)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TYPE = "ExpertLinear"
_EXPERT_NAME = re.compile(r"^(?P<block>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class LayerInfo:
    """One listed layer: its name, module type, weight shape as (out, in, ...) and parameter count
    (weight plus bias)."""

    name: str
    type: str
    shape: tuple[int, ...]
    params: int


def filter_layers(infos: Iterable[LayerInfo], pattern: str | None) -> list[LayerInfo]:
    """Select layers by name.

    Rule: ``None`` selects everything; a pattern starting with ``re:`` is a Python regular
    expression matched from the start of the name (the compressed-tensors ``targets``
    convention, so filters can be pasted into exports); anything else is a shell glob over the
    whole name, where ``*`` also crosses dots (``*.mlp.down_proj``); a plain name matches itself.
    """
    if pattern is None:
        return list(infos)
    if pattern.startswith("re:"):
        try:
            regex = re.compile(pattern[3:])
        except re.error as err:
            raise ValueError(f"invalid regular expression in layer filter {pattern!r}: {err}") from err
        return [info for info in infos if regex.match(info.name)]
    return [info for info in infos if fnmatch.fnmatchcase(info.name, pattern)]


def io_widths(info: LayerInfo) -> tuple[int, int]:
    """Features per token of a layer's (input, output), used to budget activation memory."""
    if info.type == "Embedding":
        return 1, info.shape[1]
    return info.shape[1], info.shape[0]


def inputs_are_columns(info: LayerInfo) -> bool:
    """Whether each row of a layer's inputs holds one value per column of its (out, in) weight, so
    a statistic of those inputs (a column's importance, a Hessian) describes the weight's columns:
    true of a linear layer or an expert's projection, not of an embedding, fed token ids."""
    return len(info.shape) == 2 and io_widths(info)[0] == info.shape[1]


def is_fused_experts(module: nn.Module) -> bool:
    """True for a transformers MoE experts module storing all experts as 3-D parameters in the
    concatenated, non-transposed layout (Mixtral, Qwen2-MoE and most others in transformers 5)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.ndim == 3
        and down.ndim == 3
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
    )


def expert_weight(experts: dict[str, torch.Tensor], expert: int, projection: str) -> torch.Tensor:
    """One expert's projection ``(out, in)`` as a view of fused experts tensors (``gate_up_proj``:
    gate rows then up rows; ``down_proj``): the module's own, copies of them the same shape, or
    the one of them that holds ``projection``."""
    if projection == "down_proj":
        return experts["down_proj"][expert]
    gate_up = experts["gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if projection == "gate_proj" else gate_up[half:]


def expert_of(name: str) -> tuple[str, str, int, str] | None:
    """``(experts module, fused parameter, expert, projection)`` of an expert projection's layer
    name (``<experts>.<index>.<gate_proj|up_proj|down_proj>``), or None for any other name."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    fused = "down_proj" if match["proj"] == "down_proj" else "gate_up_proj"
    return match["block"], fused, int(match["expert"]), match["proj"]


def saved_expert_names(root: nn.Module) -> dict[str, str]:
    """Every expert projection of ``root``'s fused experts modules, by the name its own 2-D weight
    takes where transformers saves the model (``save_pretrained`` undoes the checkpoint conversion
    it loaded through: Mixtral's ``experts.gate_up_proj`` is written as ``block_sparse_moe.experts.
    <e>.w1`` and ``w3``): ``{view name: saved layer name}``. Found by saving row tags of each
    fused tensor through transformers' own ``revert_weight_conversion``, so no architecture's
    layout is restated here; an architecture saved fused, split some other way, or whose conversion
    cannot run on the tags, gives no names for its experts. ``root`` may be a skeleton (its
    parameters on the meta device)."""
    names: dict[str, str] = {}
    for name, module in root.named_modules():
        if not is_fused_experts(module):
            continue
        for fused in ("gate_up_proj", "down_proj"):
            experts, rows = getattr(module, fused).shape[:2]
            saved = _saved_row_tags(root, f"{name}.{fused}", (experts, rows))
            if saved is None:  # a conversion transformers cannot run on row tags: these experts get no names
                continue
            placed = {_tagged_view(fused, rows, tag): key for key, tag in saved.items()}
            if None in placed or len(placed) != experts * (2 if fused == "gate_up_proj" else 1):
                continue
            names |= {f"{name}.{expert}.{proj}": key.removesuffix(".weight") for (expert, proj), key in placed.items()}
    return names


def converted_rows(
    root: nn.Module, name: str, shape: torch.Size, keys: Collection[str], prefix: str = ""
) -> list[tuple[str, torch.Tensor]] | None:
    """Where transformers' checkpoint conversion takes parameter ``name`` (of ``shape``) from when it
    loads: each stored key (among ``keys``, with or without the base model ``prefix``) with the
    parameter's rows it holds in order (rows: every dimension but the last, flattened). Found as
    ``saved_expert_names`` finds experts, by saving row tags through ``revert_weight_conversion``;
    None when a stored tensor holds anything but whole rows (a transposed layout), a row is held twice
    or not at all, or the conversion cannot run on tags."""
    rows = math.prod(shape[:-1])
    saved = _saved_row_tags(root, name, tuple(shape[:-1]))
    if saved is None:
        return None
    parts, seen = [], torch.zeros(rows, dtype=torch.bool)
    for key, tag in saved.items():
        stored = next((c for c in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")) if c in keys), None)
        if stored is None or tag.dim() == 0 or tag.shape[-1] != 1:
            return None
        index = tag.reshape(-1).long()
        if bool(seen[index].any()):
            return None
        seen[index] = True
        parts.append((stored, index))
    return parts if parts and bool(seen.all()) else None


def _saved_row_tags(root: nn.Module, name: str, leading: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
    """The row tags of parameter ``name`` (its dimensions but the last, ``leading``; one column) as
    ``save_pretrained`` writes them: through transformers' own ``revert_weight_conversion``, by
    saved key. None when the conversion cannot run on tags."""
    from transformers.core_model_loading import revert_weight_conversion

    tags = torch.arange(math.prod(leading), dtype=torch.float64).reshape(*leading, 1)
    try:
        return revert_weight_conversion(root, {name: tags})
    except Exception:  # a conversion transformers cannot run on row tags
        return None


def _tagged_view(fused: str, rows: int, tag: torch.Tensor) -> tuple[int, str] | None:
    """The (expert, projection) whose rows a saved tensor of row tags holds whole and in order, or
    None when it holds anything else (part of a projection, rows of two, a transposed layout)."""
    if tag.ndim != 2 or tag.shape[1] != 1 or tag.shape[0] == 0:
        return None
    values = tag[:, 0].long()
    expert, first = divmod(int(values[0]), rows)
    if not torch.equal(values, torch.arange(values[0], values[0] + len(values))):
        return None
    if fused == "down_proj":
        return (expert, "down_proj") if first == 0 and len(values) == rows else None
    half = rows // 2
    if len(values) != half or first not in (0, half):
        return None
    return expert, "gate_proj" if first == 0 else "up_proj"


@dataclass(frozen=True)
class LayerRef:
    """Where a listed layer lives in a built module: a module, or one projection of one expert of
    a fused experts module."""

    module: nn.Module
    expert: int | None = None
    projection: str | None = None

    @property
    def type_name(self) -> str:
        return EXPERT_TYPE if self.expert is not None else type(self.module).__name__

    def weight(self) -> torch.Tensor:
        """The weight as (out, in, ...), a view of the module's parameter."""
        if self.expert is None:
            weight = self.module.weight
            return weight.t() if isinstance(self.module, Conv1D) else weight
        experts = {"gate_up_proj": self.module.gate_up_proj, "down_proj": self.module.down_proj}
        return expert_weight(experts, self.expert, self.projection)

    def bias(self) -> torch.Tensor | None:
        """The bias vector, or None when the layer has none."""
        if self.expert is None:
            bias = getattr(self.module, "bias", None)
            return bias if isinstance(bias, torch.Tensor) else None
        if self.projection == "down_proj":
            bias = getattr(self.module, "down_proj_bias", None)
            return None if bias is None else bias[self.expert]
        bias = getattr(self.module, "gate_up_proj_bias", None)
        if bias is None:
            return None
        half = bias.shape[-1] // 2
        row = bias[self.expert]
        return row[:half] if self.projection == "gate_proj" else row[half:]

    def info(self, name: str) -> LayerInfo:
        weight = self.weight()
        bias = self.bias()
        params = weight.numel() + (0 if bias is None else bias.numel())
        return LayerInfo(name, self.type_name, tuple(weight.shape), params)


def _has_matrix_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.ndim == 2


def module_layer_refs(root: nn.Module) -> dict[str, LayerRef]:
    """Every layer of a built module, in module order, with experts split into virtual layers
    named ``<experts>.<index>.<gate_proj|up_proj|down_proj>``."""
    refs: dict[str, LayerRef] = {}
    for name, module in root.named_modules():
        if is_fused_experts(module):
            for expert in range(module.gate_up_proj.shape[0]):
                for projection in EXPERT_PROJECTIONS:
                    refs[f"{name}.{expert}.{projection}"] = LayerRef(module, expert, projection)
        elif name and (isinstance(module, LAYER_TYPES) or _has_matrix_weight(module)):
            refs[name] = LayerRef(module)
    return refs


def resolve_layer(root: nn.Module, name: str) -> LayerRef | None:
    """The layer called ``name`` in ``root``, or None; cheaper than listing every layer."""
    match = _EXPERT_NAME.match(name)
    if match:
        block = _submodule(root, match["block"])
        if block is not None and is_fused_experts(block):
            expert = int(match["expert"])
            if expert < block.gate_up_proj.shape[0]:
                return LayerRef(block, expert, match["proj"])
    module = _submodule(root, name)
    if module is not None and name and (isinstance(module, LAYER_TYPES) or _has_matrix_weight(module)):
        return LayerRef(module)
    return None


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None
