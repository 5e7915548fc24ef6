"""AWQ then GPTQ (issue 41), as llm-compressor composes ``AWQModifier`` and ``GPTQModifier``: the
smoothed model's balance layers put through GPTQ, each with its observer's qparams on the smoothed
weight ``W·s`` and the Hessian of its smoothed inputs ``x/s`` (``2·diag(1/s)·M·diag(1/s)`` from the
inputs' second moment ``M``), then judged on the parent's output like any candidate. Under ``rtn``
(no smoothing) it is GPTQ alone, so each observer's row says what AWQ adds to GPTQ.

Candidates that share scales share the GPTQ factors (the Cholesky of one Hessian); with fixed
scales, a candidate whose scales and qparams another had is not put through GPTQ again. An observer
GPTQ cannot run with gets no GPTQ figure; its other figures stand.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingType

import torch

import observers as ob
from lab.awq import candidates
from lab.awq.candidates import Candidate
from lab.awq.moment import InputMoment
from lab.gptq.layer import gptq_weight


def smoothed_hessian(moment: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """GPTQ's Hessian ``2/n Σ xxᵀ`` of the smoothed inputs ``x/s`` from their unsmoothed mean
    ``x xᵀ`` (float64 in, float32 out)."""
    if scales is None:
        return (2.0 * moment).float()
    inverse = 1.0 / scales.to(moment.device, torch.float64)
    return (2.0 * moment * inverse.unsqueeze(0) * inverse.unsqueeze(1)).float()


def gptq_candidates(
    weights: MappingType[str, torch.Tensor],
    kept: MappingType[tuple, tuple[Candidate, dict]],
    moment: InputMoment,
    spec: ob.QuantSpec,
    gptq: ob.GPTQSpec,
) -> dict[tuple, Candidate]:
    """Per key of ``kept`` (``key: (candidate, observer knobs)``, the key's last item the observer),
    the candidate with every balance layer's effective weight ``GPTQ(W·s)/s``; a key GPTQ refuses
    is left out."""
    factors: dict[str, dict] = {}
    hessians: dict[str, torch.Tensor] = {}
    seen: dict[str, Candidate | None] = {}
    done: dict[tuple, Candidate] = {}
    for key, (candidate, knobs) in kept.items():
        observer, scales = key[-1], candidate.scales
        where = candidates.digest(Candidate(scales, {}, {}))
        same = candidates.digest(candidate) + (f":{observer}" if gptq.scales == "refit" else "")
        if same not in seen:
            if where not in hessians:
                hessians[where] = smoothed_hessian(moment.full(), scales)
            seen[same] = _through_gptq(weights, candidate, observer, knobs, hessians[where], spec, gptq, factors, where)
        if seen[same] is not None:
            done[key] = seen[same]
    return done


def _through_gptq(weights, candidate: Candidate, observer, knobs, hessian, spec, gptq, factors, where):
    """``candidate`` with each balance layer's effective weight ``GPTQ(W·s)/s`` (None: GPTQ refused)."""
    effective = {}
    try:
        for name, weight in weights.items():
            smoothed = candidates.smoothed(weight, candidate.scales).float()
            shared = factors.setdefault(f"{where}:{name}", {})
            found = gptq_weight(smoothed, hessian, spec, gptq, observer, candidate.qparams[name], knobs, shared)
            effective[name] = candidates.effective(found.weight.to(weight.dtype), candidate.scales)
    except ValueError:
        return None
    return Candidate(candidate.scales, candidate.qparams, effective)
