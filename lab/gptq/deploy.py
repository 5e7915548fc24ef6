"""A GPTQ choice as the checkpoint deploys it: each chosen weight observer's GPTQ weight, made
again from the layer's kept Hessian (``lab.gptq.hessians``) with the run's GPTQ knobs and scale
semantics, so that the packed codes are the GPTQ codes and the scales the observer's (``fixed``) or
the ones the sweep refit (``refit``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import observers as ob
from lab.gptq.hessians import HessianOf
from lab.gptq.layer import gptq_weight


@dataclass(frozen=True)
class GPTQDeploy:
    """The run's ``GPTQSpec`` and where its layers' Hessians are."""

    gptq: ob.GPTQSpec
    hessian_of: HessianOf

    @classmethod
    def of_config(cls, config: Mapping[str, Any], hessian_of: HessianOf | None) -> GPTQDeploy | None:
        """From a lab file's recorded run config (``RunConfig.to_dict``): None when the run had no
        GPTQ. One ``ValueError`` for what a checkpoint cannot hold: no Hessians at hand, or GPTQ's
        group activation order (it needs ``g_idx``, which compressed-tensors 0.20 removed)."""
        recorded = config.get("gptq")
        if not recorded:
            return None
        gptq = ob.GPTQSpec.from_dict(dict(recorded))
        weight_spec = (config.get("specs") or {}).get("weight") or {}
        if ob.gptq.ACTORDER_ALIASES[gptq.actorder] == "group" and weight_spec.get("strategy") == "group":
            raise ValueError(
                f"GPTQ with activation order {gptq.actorder!r} needs g_idx, which compressed-tensors 0.20 removed: "
                "run with --gptq-actorder static (llm-compressor's default) or none to deploy it"
            )
        if hessian_of is None:
            raise ValueError("a GPTQ choice is deployed from its run's Hessians, and none were given")
        return cls(gptq, hessian_of)

    def apply(
        self, chosen: Any, weight: torch.Tensor, input_scales: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ob.QParams]:
        """``chosen``'s (a ``lab.export.chosen.Chosen`` weight) GPTQ weight in fp32 and the qparams
        its codes were rounded with. ``input_scales``: AWQ's scales ``s`` folded into ``weight``'s
        columns (AWQ then GPTQ): its inputs are ``x/s``, whose Hessian is ``diag(1/s)·H·diag(1/s)``.
        A layer no calibration token reached (``lab.gptq.hessians.unreached``) is rounded to nearest
        with its chosen qparams."""
        hessian = self.hessian_of(chosen.layer)
        if hessian is None:
            why = "no calibration token reached it, or it is fed token ids"
            raise ValueError(f"{chosen.layer}: its run kept no GPTQ Hessian ({why})")
        if not hessian.numel():
            return ob.fake_quantize(weight.float(), chosen.qparams, chosen.spec), chosen.qparams
        if input_scales is not None:
            inverse = 1.0 / input_scales.to(hessian.device, torch.float64)
            hessian = (hessian.double() * inverse.unsqueeze(0) * inverse.unsqueeze(1)).to(hessian.dtype)
        done = gptq_weight(
            weight.float(),
            hessian.to(weight.device),
            chosen.spec,
            self.gptq,
            chosen.observer,
            chosen.qparams,
            dict(chosen.knobs),
        )
        return done.weight, done.qparams
