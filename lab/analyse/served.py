"""A fused group's results as a server runs them: every observer's qparams under the scale the group
shares (``observers.fused``), and its figures on each member's own tensor.

``serve(entries, tensors, how, unit)`` takes the entries of one fused group (``lab.runtime.fusion``;
the same tensor kind, the same observers in the same order), the tensors their figures are
measured on (a weight, or an activation's kept sample) and what the server collapses
(``lab.runtime.scales.Collapse``). Per observer, the members that produced qparams share one
scale: an NVFP4 global scale (the smallest of their own; an observer whose block search runs under
the global scale searches again under it), or a per-tensor range (the union of theirs). Each entry
then holds the served results in ``results``, its own in ``per_layer``, and ``served`` names the
group and the member whose range set the shared scale.

``as_chosen(analysis, choices)`` serves a choice: members of a group that chose different observers
share the scale of the member whose own choice reaches farthest.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

import observers as ob
from lab.analyse.analysis import Analysis, Served, TensorAnalysis
from lab.runtime.scales import Collapse
from observers import fused
from observers.suite import SuiteResult


def serve(entries: Sequence[TensorAnalysis], tensors: Sequence[torch.Tensor], how: Collapse, unit: str) -> None:
    """Turn the entries of one fused group into their served results (in place); a group of one is
    left as it is."""
    if len(entries) < 2:
        return
    members = tuple(entry.layer for entry in entries)
    own = [list(entry.results) for entry in entries]
    served = [list(results) for results in own]
    set_by: dict[str, str] = {}
    for index, first in enumerate(own[0]):
        usable = [k for k in range(len(entries)) if own[k][index].qparams is not None]
        if len(usable) < 2:
            continue
        found = _shared(
            [own[k][index] for k in usable], [entries[k] for k in usable], [tensors[k] for k in usable], how
        )
        for k, result in zip(usable, found, strict=True):
            served[k][index] = result
        set_by[first.name] = members[usable[fused.setter([own[k][index].qparams for k in usable])]]
    for entry, mine, theirs in zip(entries, own, served, strict=True):
        entry.per_layer = mine
        entry.results = theirs
        entry.served = Served(unit, members, how.value, set_by)


def _shared(
    results: Sequence[SuiteResult], entries: Sequence[TensorAnalysis], tensors: Sequence[torch.Tensor], how: Collapse
) -> list[SuiteResult]:
    """The members' results (one observer each) under the scale they share."""
    spec = entries[0].spec
    start = time.perf_counter()
    qparams = [result.qparams for result in results]
    shared = (
        fused.share_tensor_range(qparams, spec)
        if how == Collapse.TENSOR_SCALE
        else fused.share_global_scale(qparams, spec)
    )
    seconds = (time.perf_counter() - start) / len(results)
    served = []
    for result, qp, tensor, entry in zip(results, shared, tensors, entries, strict=True):
        if how == Collapse.GLOBAL_SCALE and fused.searches_under_global_scale(result.name):
            served.append(_searched(result, entry, tensor, qp.global_scale))
        else:
            served.append(_measured(result, qp, tensor, entry.spec, seconds))
    return served


def _measured(
    result: SuiteResult, qparams: ob.QParams, tensor: torch.Tensor, spec: ob.QuantSpec, seconds: float
) -> SuiteResult:
    """``result`` with the group's ``qparams`` and their error metrics on ``tensor``; bit for bit
    ``result`` when the shared qparams are its own."""
    if qparams.same_grid(result.qparams):
        return result
    metrics = ob.quantization_metrics(tensor, qparams, spec) if tensor.numel() else {}
    return replace(result, qparams=qparams, metrics=metrics, seconds=result.seconds + seconds)


def _searched(result: SuiteResult, entry: TensorAnalysis, tensor: torch.Tensor, global_scale: torch.Tensor):
    """An observer whose block search runs under the global scale, searched again under the group's
    (its own result when that is its own global scale)."""
    if torch.equal(result.qparams.global_scale.float(), global_scale.float()):
        return result
    knobs = {**result.knobs, "group_global_scale": global_scale}
    again = ob.run_one(result.name, tensor, entry.spec, "weight", g_idx=entry.g_idx, **knobs)
    if again.qparams is None:
        return replace(result, qparams=None, metrics={}, error=f"under the group's global scale: {again.error}")
    knobs.pop("group_global_scale")
    return replace(again, knobs=knobs, seconds=result.seconds + again.seconds)


@dataclass(frozen=True)
class ServedChoice:
    """One chosen tensor as a server runs the whole choice: the ``result`` it is served with (the
    shared scale of its fused group under every member's own choice), its ``own`` result with its
    own scales, and the member whose range set the shared scale (None: not fused)."""

    result: SuiteResult
    own: SuiteResult
    set_by: str | None = None


def as_chosen(analysis: Analysis, choices: Mapping[tuple[str, str], str]) -> dict[tuple[str, str], ServedChoice]:
    """Every choice of ``choices`` (valid ones: an analysed tensor, an observer that gave qparams) as
    served. Members of a fused group that chose one observer are served as analysed (``results``);
    a group whose members chose different observers shares the scale of the member whose own choice
    reaches farthest (llm-compressor's linked observers do the same), each member keeping its own
    observer's ranges under it, so what is ranked, exported and evaluated is what a server runs."""
    found: dict[tuple[str, str], ServedChoice] = {}
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key, observer in choices.items():
        entry = analysis.entry(*key)
        index = next(i for i, r in enumerate(entry.results) if r.name == observer)
        own = entry.per_layer[index] if entry.served is not None else entry.results[index]
        set_by = entry.served.set_by.get(observer) if entry.served is not None else None
        found[key] = ServedChoice(entry.results[index], own, set_by)
        if entry.served is not None:
            groups.setdefault((entry.served.unit, entry.tensor), []).append(key)
    for keys in groups.values():
        if len({choices[key] for key in keys}) < 2:
            continue
        memo = tuple((key, choices[key]) for key in keys)
        if memo not in analysis.served_choices:
            entries = [analysis.entry(*key) for key in keys]
            own = [found[key].own for key in keys]
            shared = _shared(own, entries, [entry.data for entry in entries], Collapse(entries[0].served.collapse))
            set_by = entries[fused.setter([result.qparams for result in own])].layer
            analysis.served_choices[memo] = [ServedChoice(r, mine, set_by) for r, mine in zip(shared, own, strict=True)]
        found.update(zip(keys, analysis.served_choices[memo], strict=True))
    return found
