"""AWQ's candidates for one mapping: the balance layers smoothed by each candidate's scales, an observer's
qparams on each smoothed weight (optionally clip-searched per group), and the effective weight
``Q(W·s)/s`` the parent is judged with.

A candidate's arithmetic is llm-compressor's (``W·s`` as a float64 product cast back, ``Q(W·s)/s``
likewise). Many candidates are made at once where it changes no number: an observer whose qparams
are per row or per group of a row (integer and float grids with group or channel scales, no
global scale) and whose knobs take nothing from the inputs but a per-column importance (one row
per candidate) sees every candidate's smoothed weight stacked as rows of one weight, each kept
apart where its search would stop early (``observe(apart=…)``), so it runs once, not once per
candidate; whatever the observer, such qparams quantize every candidate in one product, and the
clip search judges every candidate's shrunk ranges in one tensor expression too.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import observers as ob
from lab.awq.budget import STACKED_ELEMENTS
from lab.awq.moment import InputMoment
from lab.awq.observed import (
    observe,
    once,
    rowwise,
    scaled_blocks,
    stackable,
    statistic_knobs,
)
from lab.runtime import fusion
from lab.runtime import scales as scales_rule
from observers.metrics import clip_ratio
from observers.smoothed_quant_kernel import smoothed_fake_quantize

_SMOOTHED = "smoothed:"
"""The memo's keys of smoothed weights (``_smoothed_rows``)."""

_ALIVE = "effective"
"""The memo's key of the live candidates' effective weights (``_alive``), which outlive a slice."""
"""Those an observer takes one row per stacked weight (``(n, in)``, ``observe(apart=n)``)."""


@dataclass
class Candidate:
    """One way to quantize a mapping's balance layers: its scales (None: unsmoothed), each layer's
    qparams on its smoothed weight, and the effective weight ``Q(W·s)/s`` the parent runs with."""

    scales: torch.Tensor | None
    qparams: dict[str, ob.QParams]
    effective: dict[str, torch.Tensor]
    key: str | None = None
    """Its ``digest``, kept by ``make`` once the qparams are final (None: computed when asked)."""

    def clipped(self, weights: dict[str, torch.Tensor], spec: ob.QuantSpec) -> dict[str, float]:
        """Per layer, the share of its smoothed weight outside the range its qparams represent
        (``clip_ratio``: one mask, none of the other metrics' passes over a 7B-wide layer; a plain
        cast, which has no scale, counts the values beyond its largest as its metrics do)."""
        return {name: _clip_share(smoothed(weights[name], self.scales), qp, spec) for name, qp in self.qparams.items()}


def _clip_share(weight: torch.Tensor, qp: ob.QParams, spec: ob.QuantSpec) -> float:
    if spec.format.kind == "cast":
        return float(ob.quantization_metrics(weight, qp, spec)["clip_ratio"])
    return clip_ratio(weight, qp, spec)


def scales_key(scales: torch.Tensor | None) -> str:
    """Smoothing scales in a few bytes: ``""`` for none or unit scales (``W·1`` is ``W``)."""
    if scales is None or bool((scales == 1).all()):
        return ""
    return hashlib.sha1(scales.detach().double().cpu().contiguous().numpy().tobytes()).hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """A tensor's dtype, shape and values in a few bytes: equal digests are the same tensor."""
    found = hashlib.sha1(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    found.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def digest(candidate: Candidate, scales: str | None = None) -> str:
    """A candidate's scales and qparams in a few bytes: two candidates with the same digest quantize
    to the same weights. ``scales``: the candidate's ``scales_key`` when the caller has it."""
    if candidate.key is not None:
        return candidate.key
    found = hashlib.sha1((scales_key(candidate.scales) if scales is None else scales).encode())
    for name in sorted(candidate.qparams):
        qp = candidate.qparams[name]
        for part in (qp.scale, qp.zero_point, qp.global_scale):
            if part is not None:
                found.update(part.detach().float().cpu().contiguous().numpy().tobytes())
    return found.hexdigest()


def smoothed(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """``W·s`` in the weight's dtype, as llm-compressor writes it (float64 product, then cast; the
    weight promoted inside the product, with no float64 copy of it); ``scales`` ``(n, in)`` give
    ``n`` smoothed weights ``(n, out, in)`` in one product, each equal to its own."""
    return weight if scales is None else (weight * scales.double().unsqueeze(-2)).to(weight.dtype)


def effective(quantized: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """``Q(W·s)/s`` in the weight's dtype, as llm-compressor runs the parent with it (a float64
    quotient, then cast); ``quantized`` ``(n, out, in)`` with ``scales`` ``(n, in)`` gives each of
    ``n`` its own in one quotient."""
    return quantized if scales is None else (quantized / scales.double().unsqueeze(-2)).to(quantized.dtype)


def _rows(qp: ob.QParams, count: int, rows: int) -> list[ob.QParams]:
    """Stacked qparams (``count`` weights of ``rows`` rows each) cut into each weight's."""
    total = count * rows

    def cut(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == total:
            return list(value.split(rows))
        return [value] * count

    fields = {name: cut(getattr(qp, name)) for name in ("scale", "zero_point", "min_val", "max_val")}
    return [
        ob.QParams(**{name: parts[i] for name, parts in fields.items()}, global_scale=qp.global_scale, kind=qp.kind)
        for i in range(count)
    ]


def make(
    weights: dict[str, torch.Tensor],
    scales: torch.Tensor | None,
    observer: str,
    spec: ob.QuantSpec,
    knobs: dict[str, Any],
    moment: InputMoment,
    clip: list[float] | None = None,
    memo: dict[str, Any] | None = None,
    elements: int = STACKED_ELEMENTS,
) -> list[Candidate]:
    """One candidate per row of ``scales`` (``(n, in)``; None: one, unsmoothed), ``observer``'s
    qparams on each balance layer's smoothed weight, clip-searched per group with ``clip``'s
    ratios when given. ``memo`` remembers the smoothed weights (by layer and scales), an observer's
    qparams (by observer, layer and scales; twins that agree on a weight observed once as one,
    ``once``) and clip searches (by layer, scales and the qparams searched from) across calls:
    each grid point is smoothed once, the clip search's pass runs no observer again, and
    observers that agree search once. A candidate whose digest another made candidate still
    alive has (a twin observer's, the min-max family's and the search's) shares its effective
    weights instead of quantizing and dividing again (``_alive``). ``elements``: the weight
    elements one stacked step holds (``lab.awq.budget``)."""
    memo = {} if memo is None else memo
    rows = [None] if scales is None else list(scales)
    keys = [scales_key(s) for s in rows]
    made = [Candidate(s, {}, {}) for s in rows]
    together = rowwise(spec)
    for name, weight in weights.items():
        smooth = _smoothed_rows(name, weight, scales, keys, memo)
        step = max(1, elements // (weight.numel() * (len(clip) if clip else 1))) if together else 1
        for start in range(0, len(rows), step):
            chunk = slice(start, start + step)
            found = _qparams(name, smooth[chunk], rows[chunk], keys[chunk], observer, spec, knobs, moment, clip, memo)
            for candidate, qp in zip(made[chunk], found, strict=True):
                candidate.qparams[name] = qp
    _share_fused(made, list(weights), spec)
    for candidate, key in zip(made, keys, strict=True):
        candidate.key = digest(candidate, key)
    smooth_of = lambda name, weight: _smoothed_rows(name, weight, scales, keys, memo)  # noqa: E731
    _fill_effective(made, weights, scales, smooth_of, spec, memo, elements)
    return made


def light(candidate: Candidate) -> Candidate:
    """``candidate`` without its effective weights (its scales, qparams and digest): what a search
    keeps of a pick once the race is over, a few kilobytes instead of a copy of the balance layers;
    ``rebuilt`` makes the weights again when a figure needs them."""
    return Candidate(candidate.scales, candidate.qparams, {}, digest(candidate))


def rebuilt(
    weights: dict[str, torch.Tensor],
    made: list[Candidate],
    spec: ob.QuantSpec,
    memo: dict[str, Any] | None = None,
    elements: int = STACKED_ELEMENTS,
) -> list[Candidate]:
    """``made`` (``light`` candidates) with their effective weights made again, as ``make`` made
    them (the same arithmetic, so the same bits): candidates with scales and those without each in
    one stacked pass, sharing a twin's weights while one holding them lives (``memo``)."""
    memo = {} if memo is None else memo
    found = [Candidate(c.scales, c.qparams, {}, digest(c)) for c in made]
    unsmoothed = [c for c in found if c.scales is None]
    if unsmoothed:
        unsmoothed_of = lambda _, weight: weight.unsqueeze(0).expand(len(unsmoothed), -1, -1)  # noqa: E731
        _fill_effective(unsmoothed, weights, None, unsmoothed_of, spec, memo, elements)
    smoothed_ones = [c for c in found if c.scales is not None]
    if smoothed_ones:
        scales = torch.stack([c.scales for c in smoothed_ones])
        smoothed_of = lambda _, weight: smoothed(weight, scales)  # noqa: E731
        _fill_effective(smoothed_ones, weights, scales, smoothed_of, spec, memo, elements)
    return found


def _fill_effective(
    made: list[Candidate],
    weights: dict[str, torch.Tensor],
    scales: torch.Tensor | None,
    smooth_of: Callable[[str, torch.Tensor], torch.Tensor],
    spec: ob.QuantSpec,
    memo: dict[str, Any],
    elements: int,
) -> None:
    """Each candidate's effective weight ``Q(W·s)/s`` per layer, a twin's taken while one holding
    it lives (``_alive``), the rest quantized and divided stacked where the qparams are per row
    (``rowwise``): in one native pass from the weight where the kernel takes them
    (``observers.smoothed_quant_kernel``, bit for bit the eager arithmetic), else eagerly from
    ``smooth_of(name, weight)`` (the layer smoothed by every row of ``scales``, stacked
    ``(n, out, in)``; None: unsmoothed), made only then."""
    alive = _alive(memo)
    together = rowwise(spec)
    for name, weight in weights.items():
        for candidate in made:
            if (found := alive.get(f"{name}:{candidate.key}")) is not None:
                candidate.effective[name] = found
        todo = [i for i, candidate in enumerate(made) if name not in candidate.effective]
        smooth: torch.Tensor | None = None
        step = max(1, elements // weight.numel()) if together else 1
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            part = [made[i] for i in chunk]
            joined = _joined([c.qparams[name] for c in part])
            divided = None if scales is None else smoothed_fake_quantize(weight, scales[chunk], joined, spec)
            if divided is None:
                smooth = smooth_of(name, weight) if smooth is None else smooth
                stacked = _rows_of(smooth, chunk)
                quantized = ob.fake_quantize(stacked.flatten(0, 1), joined, spec).reshape(stacked.shape)
                divided = effective(quantized, None if scales is None else scales[chunk])
            for candidate, q in zip(part, divided, strict=True):
                candidate.effective[name] = alive[f"{name}:{candidate.key}"] = q


def forget_slice(memo: dict[str, Any]) -> None:
    """Drop what ``make`` remembered of a slice of the grid (smoothed weights, observers' qparams,
    clip searches: each keyed by its grid point's scales), keeping only the live candidates'
    effective weights (``_alive``): a search done with a slice lets them go, so it never holds the
    whole grid's smoothed weights (7 GB for a 7B-wide gate/up) or qparams (5.6 MB a layer and
    candidate there) at once. A later pass over the same grid point makes them again."""
    for key in [key for key in memo if key != _ALIVE]:
        del memo[key]


def _alive(memo: dict[str, Any]) -> weakref.WeakValueDictionary:
    """The effective weights of the candidates still held somewhere (by layer and digest): equal
    digests quantize to the same weights, and the memo keeps none of them alive itself."""
    return memo.setdefault(_ALIVE, weakref.WeakValueDictionary())


def _share_fused(made: list[Candidate], names: list[str], spec: ob.QuantSpec) -> None:
    """Each candidate's qparams of the balance layers a server fuses into one linear under the one
    scale it keeps for them (``share_fused``), as llm-compressor links its observers during the
    search (``fuse_weight_observers``)."""
    for candidate in made:
        candidate.qparams.update(share_fused({name: candidate.qparams[name] for name in names}, spec))


def share_fused(qparams: dict[str, ob.QParams], spec: ob.QuantSpec) -> dict[str, ob.QParams]:
    """``qparams`` (per layer) with the layers a server fuses into one linear (q/k/v, gate/up)
    under the one scale it keeps for them (``lab.runtime.scales``: NVFP4's global scale, an FP8
    per-tensor scale)."""
    how = scales_rule.collapse(spec, "weight")
    shared = dict(qparams)
    if how is None:
        return shared
    share = ob.fused.share_global_scale if how == scales_rule.Collapse.GLOBAL_SCALE else ob.fused.share_tensor_range
    for _, members in fusion.fused_groups(list(qparams), scales_rule.level("weight")):
        if len(members) > 1:
            shared.update(zip(members, share([qparams[m] for m in members], spec), strict=True))
    return shared


def _smoothed_rows(
    name: str, weight: torch.Tensor, scales: torch.Tensor | None, keys: list[str], memo: dict
) -> torch.Tensor:
    """``smoothed(weight, s)`` for each row of ``scales`` (``keys``: their ``scales_key``; None: the
    weight itself), stacked ``(n, out, in)`` and made once per layer and grid (``memo``): every
    observer and pass of a search smooths the same grid points, and reads them as views."""
    key = f"{_SMOOTHED}{name}:{':'.join(keys)}"
    if key not in memo:
        memo[key] = weight.unsqueeze(0) if scales is None else smoothed(weight, scales)
    return memo[key]


def _qparams(name, smooth, chunk, chunk_keys, observer, spec, knobs, moment, clip, memo) -> list[ob.QParams]:
    """A chunk of candidates' qparams of one layer (``smooth``: its weight smoothed by each of the
    chunk's scales): the observer's (one stacked call where ``stackable``, else one each;
    remembered in ``memo``, so the clip search's pass over the same grid points does not run the
    observer again), then clip-searched when ``clip`` is given."""
    observer, knobs, tag = once(observer, knobs)
    keys = [f"{tag}:{name}:{key}" for key in chunk_keys]
    missing = [i for i, key in enumerate(keys) if key not in memo]
    if missing:
        part = [chunk[i] for i in missing]
        weights = _rows_of(smooth, missing)
        blocks = moment.blocks
        if len(part) > 1 and stackable(observer, spec):
            each = statistic_knobs(observer, knobs, moment.diagonal(), blocks, torch.stack(part))
            stacked = observe(observer, weights.flatten(0, 1), spec, each, apart=len(part))
            found = _rows(stacked, len(part), weights.shape[1])
        else:
            found = [
                observe(observer, w, spec, statistic_knobs(observer, knobs, moment.diagonal(), blocks, s))
                for w, s in zip(weights, part, strict=True)
            ]
        memo.update({keys[i]: qp for i, qp in zip(missing, found, strict=True)})
    qps = [memo[key] for key in keys]
    if clip is None:
        return qps
    return _clipped(name, smooth, qps, spec, clip, chunk, chunk_keys, moment, memo)


def _rows_of(stacked: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``stacked``'s ``rows`` (a view when they follow each other in order: no copy)."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return stacked[rows[0] : rows[0] + len(rows)]
    return stacked[rows]


def _clipped(name, smooth, qps, spec, ratios, scales, scale_keys, moment, memo) -> list[ob.QParams]:
    """``_clip_search`` of the candidates ``memo`` has not seen (by layer, scales and qparams);
    ``smooth``: the layer's weight smoothed by each of ``scales`` (``scale_keys``: their keys)."""
    keys = [
        f"{name}:{digest(Candidate(s, {name: qp}, {}), key)}"
        for s, qp, key in zip(scales, qps, scale_keys, strict=True)
    ]
    missing = [i for i, key in enumerate(keys) if key not in memo]
    if missing:
        found = _clip_search(
            _rows_of(smooth, missing),
            [qps[i] for i in missing],
            spec,
            ratios,
            [scales[i] for i in missing],
            moment,
        )
        memo.update({keys[i]: qp for i, qp in zip(missing, found, strict=True)})
    return [memo[key] for key in keys]


def _joined(qps: list[ob.QParams]) -> ob.QParams:
    """Per-weight qparams stacked back along the rows (the inverse of ``_rows``)."""
    first = qps[0]
    fields = {
        name: torch.cat([getattr(q, name) for q in qps]) for name in ("scale", "zero_point", "min_val", "max_val")
    }
    return ob.QParams(**fields, global_scale=first.global_scale, kind=first.kind)


def _clip_search(
    weights: torch.Tensor, qps: list[ob.QParams], spec, ratios: list[float], scales: list, moment: InputMoment
) -> list[ob.QParams]:
    """Per candidate and group, the share of the observer's range (among ``ratios``) whose part of
    the layer's output error on the smoothed inputs ``x/s`` is least (the first least, in the
    ratios' order, as ModelOpt's ``awq_clip`` keeps a ratio only when strictly better).
    ``weights`` are the candidates' smoothed weights ``(n, out, in)``.

    The pick is ``ob.awq.clip_picks``' (a native kernel over every ratio where it takes the data)."""
    n, rows, columns = weights.shape
    size = spec.group_size if spec.strategy == "group" else columns
    joined = _joined(qps)
    unscaled = moment.blocks(size)
    blocks = torch.stack([scaled_blocks(unscaled, s) for s in scales]).float()
    best = ob.awq.clip_picks(weights, ob.awq.shrunk(joined, spec, ratios), blocks, spec)
    chosen = torch.tensor(ratios, dtype=torch.float32, device=weights.device)[best].reshape(joined.min_val.shape)
    found = ob.qparams.range_rule(joined.min_val * chosen, joined.max_val * chosen, spec)
    return _rows(found, n, rows)
