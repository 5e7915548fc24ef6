"""One layer's weight observers under GPTQ: for each observer's qparams, the layer-output error and
the clipped share of round-to-nearest and of GPTQ (``observers.gptq_quantize``) on the calibration
inputs behind the layer's Hessian.

The error is the relative ``‖WX − ŴX‖²`` GPTQ minimises, from the Hessian alone
(``observers.layer_output_error``); the clipped share is the lab's ``clip_ratio`` rule, of the
original weight for round-to-nearest and of the error-updated weights for GPTQ (what fixed scales
cut off). With ``fixed`` scales an observer's qparams on the whole weight go in as they are (every
observer of a layer in one stacked sweep, ``observers.gptq_quantize_fixed``); with ``refit`` the
observer runs again on each group as the sweep reaches it. The same errors on held-out inputs come
from their own Hessian (``lab.gptq.held_out``).

What the stage holds is bounded by one layer, whatever the number of observers: a stacked sweep's
results are made into rows before the next sweep (``STACKED_ELEMENTS`` bounds a sweep), each GPTQ
weight let go before its round-to-nearest copy is made, and the held-out Hessian read for each
sweep's rows only, so it is never in memory beside the inverse factor being made or a sweep's
copies (at a 4096-wide ``down_proj``, each ``(in, in)`` matrix is 485 MB).

``gptq_weight`` (``entry_gptq`` for an analysed weight) makes one observer's GPTQ of a layer again
from its kept Hessian: what the checkpoint packs, propagation and the model-level effect run
(``weight_quant``) and the Ranges page draws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

import observers as ob
from lab.allocator import large_blocks_mapped
from observers.suite import SuiteResult
from sample_models.effect import TensorQuant
from sample_models.sequential import return_freed_memory

NO_HESSIAN = "no Hessian: no calibration token reached this layer, or it is fed token ids"
"""Why a layer has no GPTQ: its inputs gave no Hessian (an unrouted expert, an embedding)."""


@dataclass(frozen=True)
class GPTQRow:
    """One observer on one layer under GPTQ (``error`` says why there is nothing else)."""

    observer: str
    rtn_error: float | None = None
    gptq_error: float | None = None
    rtn_clipped: float | None = None
    gptq_clipped: float | None = None
    rtn_held_out: float | None = None
    """The layer-output errors on held-out inputs (``lab.gptq.held_out``): what GPTQ's fit to the
    calibration tokens carries over to others."""
    gptq_held_out: float | None = None
    fallback: bool = False
    notes: tuple[str, ...] = ()
    error: str | None = None


HeldOutRead = Callable[[], torch.Tensor | None]
"""Reads a layer's held-out Hessian (``lab.gptq.held_out``) when its figures are made; None: none."""


def gptq_rows(
    results: list[SuiteResult],
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    spec: ob.QuantSpec,
    gptq: ob.GPTQSpec,
    knobs: dict[str, dict[str, Any]],
    held_out: HeldOutRead | None = None,
) -> list[GPTQRow]:
    """A row per weight observer that gave qparams (``results``, the observers' results on
    ``weight``), GPTQ with ``gptq``'s knobs and scale semantics; ``hessian`` is None when no
    calibration token reached the layer or its inputs are token ids (an embedding), ``held_out``
    reads the Hessian of held-out inputs (None, or it reading None: no held-out figures).
    ``knobs`` are the run's knobs per observer (a refit runs the observer with them).

    The sweeps run with large blocks mapped for themselves (``lab.allocator.large_blocks_mapped``),
    after what the weight's observers freed is handed back: a heap that keeps freed blocks would
    hold their sizes' leftovers beside the next ones."""
    return_freed_memory()
    with large_blocks_mapped():
        layer = _Layer(weight, hessian, held_out) if hessian is not None else None
        usable = [result for result in results if result.qparams is not None] if layer is not None else []
        fixed = _fixed_rows(usable, layer, spec, gptq, knobs) if gptq.scales == "fixed" and layer is not None else {}
        rows = []
        for result in results:
            if result.qparams is None:
                rows.append(GPTQRow(result.name, error=result.error or "no qparams"))
            elif layer is None:
                rows.append(GPTQRow(result.name, error=NO_HESSIAN))
            elif result.name in fixed:
                rows.append(fixed[result.name])
            else:
                rows.append(_own_row(result, layer, spec, gptq, knobs.get(result.name, {})))
        return rows


STACKED_ELEMENTS = 32 << 20
"""Weight elements swept at once when several observers' fixed-scale GPTQ runs as one sweep
(``observers.gptq_quantize_fixed``): a small layer takes every observer together, a big one a few.
It bounds what the stage holds of GPTQ's results too: one sweep's, made into rows before the next."""


def _fixed_rows(
    usable: list[SuiteResult], layer: _Layer, spec: ob.QuantSpec, gptq: ob.GPTQSpec, knobs
) -> dict[str, GPTQRow]:
    """Every usable observer's row under fixed scales, their GPTQ in as few stacked sweeps as
    ``STACKED_ELEMENTS`` allows; an observer a stacked sweep fails on is left out here and gets its
    own sweep (and error) later."""
    step = max(1, STACKED_ELEMENTS // max(1, layer.weight.numel()))
    settings = {name: value for name, value in gptq.kwargs().items() if name != "scales"}
    weight = layer.weight.float()
    rows: dict[str, GPTQRow] = {}
    twins = _twins(usable) if ob.gptq.ACTORDER_ALIASES[gptq.actorder] != "group" else {}
    swept_once = [result for result in usable if result.name not in twins]
    for start in range(0, len(swept_once), step):
        chunk = swept_once[start : start + step]
        fns = [observer_qparams(r.name, weight, r.qparams, spec, _person_knobs(knobs.get(r.name, {}))) for r in chunk]
        try:
            found = ob.gptq_quantize_fixed(layer.weight, layer.hessian, spec, fns, factors=layer.factors, **settings)
        except ValueError:
            continue
        swept = [_Swept.of(one) for one in found]
        del found  # the codes and updated weights beside each GPTQ weight, before any error is computed
        rows |= _rows(chunk, swept, layer, spec)
    for twin in (result for result in usable if result.name in twins and twins[result.name] in rows):
        clipped = twin.metrics.get("clip_ratio")
        rows[twin.name] = replace(rows[twins[twin.name]], observer=twin.name, rtn_clipped=clipped)
    return rows


def _twins(usable: list[SuiteResult]) -> dict[str, str]:
    """Each observer whose qparams set an earlier one's grid (``QParams.same_grid``), and that one's name:
    fixed-scale GPTQ of the one is the other's (the min-max family on a weight observed once, the
    MSE grid with and without its moving average), so it is swept and measured once. Not under
    ``group`` activation order, where each observer runs again on the reordered columns."""
    twins: dict[str, str] = {}
    for index, result in enumerate(usable):
        for first in usable[:index]:
            if first.name not in twins and first.qparams.same_grid(result.qparams):
                twins[result.name] = first.name
                break
    return twins


def _own_row(result: SuiteResult, layer: _Layer, spec: ob.QuantSpec, gptq: ob.GPTQSpec, knobs) -> GPTQRow:
    """One observer's row from a sweep of its own (refit scales, or a stacked sweep that failed)."""
    try:
        done = gptq_weight(layer.weight, layer.hessian, spec, gptq, result.name, result.qparams, knobs, layer.factors)
    except ValueError as err:
        return GPTQRow(result.name, error=str(err))
    swept = [_Swept.of(done)]
    del done
    return _rows([result], swept, layer, spec)[result.name]


def _rows(chunk: list[SuiteResult], swept: list[_Swept], layer: _Layer, spec: ob.QuantSpec) -> dict[str, GPTQRow]:
    """The rows of ``chunk``'s observers from their GPTQ weights (``swept``, in the same order,
    emptied as the rows are made), the held-out Hessian read for them and let go with them."""
    held_out = layer.held_out()
    return {result.name: _row(result, layer, spec, swept.pop(0), held_out) for result in chunk}


def _row(
    result: SuiteResult, layer: _Layer, spec: ob.QuantSpec, swept: _Swept, held_out: torch.Tensor | None
) -> GPTQRow:
    """One observer's row: its GPTQ weight's errors (``swept``, whose last reference this is, let go
    once they are made), then round-to-nearest's with the same qparams."""
    gptq_error, gptq_held_out = layer.error(swept.weight), layer.held_out_error(swept.weight, held_out)
    gptq_clipped, fallback, notes = swept.clip_ratio, swept.fallback, swept.notes
    del swept  # one layer-sized approximation at a time: the GPTQ weight goes before RTN's is made
    rtn = ob.fake_quantize(layer.weight.float(), result.qparams, spec)
    return GPTQRow(
        result.name,
        rtn_error=layer.error(rtn),
        gptq_error=gptq_error,
        rtn_clipped=result.metrics.get("clip_ratio"),
        gptq_clipped=gptq_clipped,
        rtn_held_out=layer.held_out_error(rtn, held_out),
        gptq_held_out=gptq_held_out,
        fallback=fallback,
        notes=notes,
    )


@dataclass(frozen=True)
class _Swept:
    """What a row reads of one observer's ``GPTQResult``: the GPTQ weight and its figures."""

    weight: torch.Tensor
    clip_ratio: float
    fallback: bool
    notes: tuple[str, ...]

    @classmethod
    def of(cls, done: ob.GPTQResult) -> _Swept:
        return cls(done.weight, done.clip_ratio, done.fallback, done.notes)


def _person_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """Statistics filled from the layer's inputs are tensors per column of the whole weight and do
    not fit a group: an observer run again on part of a weight gets the person's knobs only."""
    return {name: value for name, value in knobs.items() if not isinstance(value, torch.Tensor)}


class _Layer:
    """What every observer's GPTQ on one layer shares: the weight and Hessian, ``‖WX‖²`` (the
    errors' reference), the inverse factors per order (``gptq_quantize``'s ``factors``) and how to
    read the held-out Hessian (its ``‖WX‖²`` found on the first read)."""

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor, held_out: HeldOutRead | None) -> None:
        self.weight, self.hessian, self._read_held_out = weight, hessian, held_out
        self.energy = ob.gptq.output_energy(weight, hessian)
        self.held_out_energy: float | None = None
        self.factors: dict = {}

    def error(self, approx: torch.Tensor) -> float:
        return ob.layer_output_error(self.weight, approx, self.hessian, self.energy)

    def held_out(self) -> torch.Tensor | None:
        """The held-out Hessian, read again for each sweep's rows (None: no held-out figures)."""
        found = None if self._read_held_out is None else self._read_held_out()
        if found is not None and self.held_out_energy is None:
            self.held_out_energy = ob.gptq.output_energy(self.weight, found)
        return found

    def held_out_error(self, approx: torch.Tensor, held_out: torch.Tensor | None) -> float | None:
        if held_out is None:
            return None
        return ob.layer_output_error(self.weight, approx, held_out, self.held_out_energy)


def observer_qparams(
    observer: str, weight: torch.Tensor, qparams: ob.QParams, spec: ob.QuantSpec, knobs: dict[str, Any]
) -> Callable[[torch.Tensor], ob.QParams]:
    """``gptq_quantize``'s ``qparams_fn`` for one observer: its ``qparams`` on the original
    ``weight`` when asked for that weight (``fixed`` scales), else the observer run again with its
    ``knobs`` on what the sweep hands it (a group of updated weights under ``refit``, the columns in
    activation order under ``group`` ordering)."""

    def observe(tensor: torch.Tensor) -> ob.QParams:
        if tensor.shape == weight.shape and torch.equal(tensor, weight):
            return qparams
        found = ob.run_one(observer, tensor, spec, "weight", **knobs)
        if found.qparams is None:
            raise ValueError(f"{observer} gave no qparams on a group: {found.error}")
        return found.qparams

    return observe


def gptq_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: ob.QuantSpec,
    gptq: ob.GPTQSpec,
    observer: str,
    qparams: ob.QParams,
    knobs: dict[str, Any],
    factors: dict | None = None,
) -> ob.GPTQResult:
    """One observer's GPTQ of ``weight``: what a choice made under GPTQ deploys (the checkpoint's
    codes and scales), what propagation and the model-level effect run, and whose updated weights
    the Ranges page draws. Made again from the kept Hessian whenever asked, as deterministic as the
    analysis's own (same inputs, same device). Its large blocks are mapped for themselves, as the
    analysis's sweeps' are (``lab.allocator.large_blocks_mapped``)."""
    observe = observer_qparams(observer, weight.float(), qparams, spec, _person_knobs(knobs))
    with large_blocks_mapped():
        return ob.gptq_quantize(weight, hessian, spec, observe, factors=factors, **gptq.kwargs())


def entry_gptq(entry: Any, observer: str, gptq: ob.GPTQSpec, result: SuiteResult | None = None) -> ob.GPTQResult:
    """``gptq_weight`` of an analysed weight (a ``TensorAnalysis`` with its kept ``hessian``) with one
    of its observers: the weight read again, the observer's qparams and knobs as the run had them
    (``result``: as a choice serves them, when a fused group's members chose different observers)."""
    if entry.hessian_source is None:
        raise ValueError(f"{entry.layer}: {NO_HESSIAN}: no GPTQ weight")
    result = entry.result(observer) if result is None else result
    if result.qparams is None:
        raise ValueError(f"{observer} gave no qparams on {entry.layer}: no GPTQ weight")
    return gptq_weight(entry.data, entry.hessian, entry.spec, gptq, observer, result.qparams, result.knobs)


def weight_quant(entry: Any, result: SuiteResult, gptq: ob.GPTQSpec | None) -> TensorQuant:
    """How a chosen weight runs in the model (propagation, the model-level effect): its chosen
    ``result``'s qparams (as served), and under GPTQ (``gptq`` given, a Hessian kept) its GPTQ
    weight, which is what the checkpoint deploys."""
    if gptq is None or entry.hessian_source is None:
        return TensorQuant(entry.spec, result.qparams)
    return TensorQuant(entry.spec, result.qparams, entry_gptq(entry, result.name, gptq, result).weight)
