"""Qparams of tensors a server runs as one: fused layers share the scales it keeps one of.

A server that loads several layers into one (a decoder's q/k/v, its gate/up) keeps one NVFP4
global scale and one per-tensor scale for all of them. Each member's own qparams are therefore not
what it runs with. The rule here is llm-compressor 0.14's linked observers
(``observers/helpers.py``, ``fuse_weight_observers``; ``Observer.get_global_scale``): the group's
statistic is the members' combined one, so the member whose chosen range reaches farthest sets it,
and nothing is clipped that its own observer kept.

- NVFP4 (``share_global_scale``): the group's global scale is ``448·6 / max amax`` over every
  member's chosen block ranges, i.e. the smallest of the members' own global scales; each member
  keeps its own block ranges and gets block scales ``e4m3(amax_block / 6 · global)`` under it
  (``calculate_qparams`` with the group's global scale in llm-compressor, and ModelOpt's export of
  fused layers alike).
- A per-tensor scale (``share_tensor_range``): the union of the members' chosen ranges, through the
  format's own range rule; for symmetric scales that is the largest member scale, the one vLLM
  requantizes FP8 shards with.

An observer whose block search runs under a global scale (ModelOpt's FP8 scale sweeps and
``modelopt_mse`` on NVFP4) declares the ``group_global_scale`` knob and searches again under the
group's (``searches_under_global_scale``); reusing its block picks under another global scale
would keep choices made for a different grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from observers.base import observer_class
from observers.blocks import _amax, e4m3_block_scales
from observers.knobs import Knob
from observers.qparams import QParams, calculate_qparams
from observers.spec import QuantSpec

GROUP_GLOBAL_SCALE = Knob(
    None,
    torch.Tensor,
    optional=True,
    editable=False,
    expects="a positive finite float tensor of one element",
    doc="NVFP4 global scale of the fused group this weight is served in (one for q/k/v, one for gate/up): "
    "the search runs under it; None: this weight's own",
)
"""The knob of observers that search under a global scale (``searches_under_global_scale``)."""


def check_group_global_scale(value: torch.Tensor | None, spec: QuantSpec) -> None:
    """``group_global_scale`` is None, or one positive finite value of a spec with a global scale."""
    if value is None:
        return
    if spec.format.scale_kind != "e4m3":
        raise ValueError(f"group_global_scale needs dtype 'nvfp4' (a global scale), not {spec.dtype!r}")
    if not value.dtype.is_floating_point or value.numel() != 1 or not bool(torch.isfinite(value).all() & (value > 0)):
        raise ValueError(f"group_global_scale must be {GROUP_GLOBAL_SCALE.expects}, got {value!r}")


def searches_under_global_scale(observer: str) -> bool:
    """Whether ``observer``'s block search depends on the global scale, so that a fused group's
    shared scale is searched under again rather than applied to its picks."""
    return "group_global_scale" in observer_class(observer).knob_specs()


def setter(members: Sequence[QParams]) -> int:
    """The index of the member that sets the group's shared scale: the largest range (for NVFP4 the
    smallest global scale, for a per-tensor scale the widest range), the first on ties."""
    if members[0].global_scale is not None:
        values = torch.stack([qp.global_scale.float().reshape(()) for qp in members])
        return int(torch.argmin(values))
    widths = torch.stack([_amax(qp.min_val.float(), qp.max_val.float()).max() for qp in members])
    return int(torch.argmax(widths))


def group_global_scale(members: Sequence[QParams]) -> torch.Tensor:
    """The global scale a fused group shares: the smallest of the members' own (``448·6 / amax``
    of the member whose chosen ranges reach farthest), one fp32 element."""
    scales = [qp.global_scale for qp in members]
    if any(scale is None for scale in scales):
        raise ValueError("every member of a group sharing a global scale needs one (NVFP4 qparams)")
    return torch.stack([scale.float().reshape(()) for scale in scales]).min().reshape(1)


def under_global_scale(qp: QParams, spec: QuantSpec, global_scale: torch.Tensor) -> QParams:
    """``qp``'s own block ranges with NVFP4 block scales under another ``global_scale``: bit for bit
    ``qp`` itself when ``global_scale`` is its own."""
    amax = _amax(qp.min_val.float(), qp.max_val.float())
    scale = e4m3_block_scales(amax, global_scale.float().reshape(1).to(amax.device), spec.format.max_value)
    return replace(qp, scale=scale, global_scale=global_scale.float().reshape(1).to(amax.device).clone())


def share_global_scale(members: Sequence[QParams], spec: QuantSpec) -> list[QParams]:
    """Every member's qparams under the group's global scale (``group_global_scale``)."""
    shared = group_global_scale(members)
    return [under_global_scale(qp, spec, shared) for qp in members]


def group_range(members: Sequence[QParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the members' chosen per-tensor ranges, ``(min, max)`` of shape ``(1,)``."""
    low = torch.stack([qp.min_val.float().reshape(()) for qp in members]).min().reshape(1)
    high = torch.stack([qp.max_val.float().reshape(()) for qp in members]).max().reshape(1)
    return low, high


def share_tensor_range(members: Sequence[QParams], spec: QuantSpec) -> list[QParams]:
    """Every member's per-tensor qparams replaced by those of the group's range (``group_range``),
    kind and extras kept: the member with the widest range keeps its own scale bit for bit."""
    if any(qp.scale.numel() != 1 for qp in members):
        raise ValueError("sharing a tensor range needs per-tensor qparams (one scale per member)")
    low, high = group_range(members)
    shared = calculate_qparams(low, high, spec)
    return [
        replace(
            qp,
            scale=shared.scale.reshape(qp.scale.shape).clone(),
            zero_point=shared.zero_point.reshape(qp.zero_point.shape).clone(),
            min_val=low.reshape(qp.min_val.shape),
            max_val=high.reshape(qp.max_val.shape),
        )
        for qp in members
    ]
