"""Run the observer suite over chosen layers of a model: the one code path of the app and CLI.

``analyse(model, layers, config, attention=blocks)`` streams the calibration batches once through
the observers of the chosen activations (layer inputs and outputs, the key and value states of
attention blocks: ``lab.calibrate.activations``), then reads each layer's weight when its layer is finished
and runs the weight observers on it. Results are cached per (tensor, spec, observer, knobs,
calibration) in a ``ResultCache``, so a re-run after one knob changes recomputes only that
observer; ``lab.calibrate.capture_memo`` keeps the app's sample of tokens. The ``Analysis`` it
returns (``lab.analyse.analysis``) records the facts of its model (``lab.analyse.model_facts``), so
its results stay tied to that model. Ranking and choosing observers live in ``lab.results``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis, ToolResult
from lab.analyse.model_facts import ModelFacts
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from lab.analyse.served import as_chosen, serve
from lab.analyse.tools import profile
from lab.calibrate import observed
from lab.calibrate.activations import Calibrated, activation_keys, calibrate
from lab.calibrate.activations import tensor_id as activations_tensor_id
from lab.gptq.held_out import held_out_hessians
from lab.gptq.hessians import SpilledHessians
from lab.gptq.layer import gptq_rows, weight_quant
from lab.results import Choices, choose
from lab.runtime.fusion import fused_groups, unit
from lab.runtime.scales import level, serving_level, shared_tensors, with_fused_members
from lab.scale.distributed import SINGLE, Ranks, owner
from lab.vocab import (
    DEFAULT_METRIC,
    KV,
    KV_TENSORS,
    LAYER_TENSORS,
    spec_key,
)
from lab.vocab import observer_kind as _observer_kind
from observers.suite import SuiteResult
from sample_models.calibration_sets import CalibrationSamples
from sample_models.capture import BlockTap, Propagation
from sample_models.effect import TensorQuant, quantizing_hooks
from sample_models.sequential import return_freed_memory

ProgressFn = Callable[[int, int, str], None]


def analyse(
    model,
    layers: Sequence[str],
    config: RunConfig,
    progress: ProgressFn | None = None,
    cache: ResultCache | None = None,
    attention: Sequence[str] = (),
    ranks: Ranks = SINGLE,
    on_done: Callable[[Analysis], None] | None = None,
    choices: Callable[[Analysis], Choices] | None = None,
    tap: BlockTap | None = None,
) -> Analysis:
    """Run ``config`` on ``layers`` of ``model`` (a ``sample_models`` model), and its ``kv`` spec
    on the key and value states of the ``attention`` blocks (entries ``(block, "k")`` and
    ``(block, "v")``, observed as ``kind="attention"``).

    Activations are observed in one calibration pass (``lab.calibrate.activations``): every batch goes
    through the observers inside the capture hooks, so ranges are over every token, and only a
    bounded sample of tokens is kept (``TensorAnalysis.data``) for plots and error metrics.

    With several ``ranks`` (torchrun) the ranks split the calibration batches: every rank calls
    ``analyse`` with the same arguments, streams its share, and the activation observers merge
    their statistics across ranks (``observers.shared``), so every rank ends with the same
    activation results; the weights are split instead, layer ``i`` analysed by rank
    ``i % world_size`` only (``lab.scale.distributed.owner``).

    ``on_done``: hand on each group of finished entries (a block's layers, in a sequential pass) as
    an ``Analysis`` of its own instead of keeping them: a sweep writes them and forgets them, so a
    whole model is analysed in one calibration pass. The returned ``Analysis`` then has no entries.

    ``choices``: what propagation (``RunConfig.propagate``) quantizes a settled block's tensors with,
    given that block as an ``Analysis``; default: ``lab.results.choose`` by the default metric (the
    CLI passes its ``--choose-by`` and ``--choose``, so the next block calibrates behind what the
    run exports).

    ``tap``: a stage that rides the calibration pass block by block (``run --awq``'s
    ``lab.awq.run.AWQWalk``): the pass is then made, and made layer by layer, whatever else needs it;
    what it changes (``tap.key``) is in every result's cache key.

    ``progress(done, total, label)`` is called before each (layer, tensor, observer) step.
    Errors of one observer land in its ``SuiteResult.error``; a bad layer name or a missing
    activation source raises ``ValueError`` before anything runs.
    """
    layer_kinds = [kind for kind in LAYER_TENSORS if kind in config.specs]
    if attention and KV not in config.specs:
        raise ValueError("attention blocks were chosen but no KV-cache spec: add a 'kv' spec to the run config")
    if KV in config.specs and not attention:
        raise ValueError("a KV-cache spec needs at least one attention block to capture keys and values from")
    if layer_kinds and not layers:
        raise ValueError("choose at least one layer")
    if not layers and not attention:
        raise ValueError("choose at least one layer or attention block")
    if config.propagate and ranks.world_size > 1:
        raise ValueError("propagation runs in one process: every rank would need every weight's choice")
    cache = ResultCache() if cache is None else cache
    start = time.perf_counter()
    shared = shared_tensors(config.specs)
    every = [info.name for info in model.layers()] if hasattr(model, "layers") else list(layers)
    layers, added = with_fused_members(layers, every, config.specs)
    facts = ModelFacts.of(model, with_kv=bool(attention))
    split = ranks.world_size > 1
    mine = _owned(layers, config, ranks)
    extra = config.calibration_key()
    extra += f"|share {ranks.rank}/{ranks.world_size}" if split else ""
    extra += f"|{json.dumps(config.transform.to_dict(), sort_keys=True)}" if config.transform else ""
    extra += f"|tap {tap.key}" if tap is not None and tap.key else ""
    jobs = [(layer, tensor) for layer in layers for tensor in layer_kinds]
    jobs += [(block, which) for block in attention for which in KV_TENSORS]
    order = {job: index for index, job in enumerate(jobs)}
    names_for = {key: config.observers_for(key) for key in config.specs}
    total = sum(len(names_for[spec_key(tensor)]) for _, tensor in jobs)
    if progress is not None:
        progress(0, total, "calibrating")
    if config.gptq is not None and not getattr(model, "supports_activations", True):
        raise ValueError(
            f"GPTQ needs each layer's calibration inputs for its Hessian, and {getattr(model, 'name', 'this model')} "
            "holds weights only: open a full model (directory with config.json, or a built-in sample)"
        )
    gptq = config.gptq is not None
    # a weights-only run calibrates too when its weight observers take their inputs' statistics (imatrix's
    # importance, local_hessian's blocks) and the model can run: without them they would search unweighted
    statistics = bool(observed.wanted_statistics(config)) and getattr(model, "supports_activations", True)
    streams = bool(activation_keys(layers, attention, config) or config.actorder or gptq or statistics)
    streams = streams or observed.smooths(config) or tap is not None
    calibration = _calibration_set(model, config) if streams else None  # a bad dataset stops it here
    entries: list[TensorAnalysis] = []
    warnings: list[str] = [calibration.shortfall] if calibration is not None and calibration.shortfall else []
    warnings += added
    recorded = None if calibration is None else calibration.to_dict()
    steps = iter(range(total))
    finished: set[str] = set()

    def tick(label: str) -> None:
        step = next(steps)
        if progress is not None:
            progress(step, total, label)

    def finish(units: list[str], calibrated: Calibrated) -> Propagation | None:
        """The entries of ``units`` (layers, attention blocks), now that their activations are final:
        their weights are read and observed now, a fused group's at once (``_weight_group``), and
        a fused group's activations served together. Each unit is finished once: what the
        calibration pass settled is recorded here, not guessed afterwards from the values it left
        (a layer no token reached leaves none)."""
        finished.update(units)
        found, weights = [], []
        for layer, tensor in (job for job in jobs if job[0] in units):
            spec, names = config.specs[spec_key(tensor)], names_for[spec_key(tensor)]
            if tensor != "weight":
                found.append(_activation_entry(layer, tensor, spec, calibrated, None if split else ranks.rank))
            elif layer in mine:
                weights.append(layer)
                continue
            for name in names:
                tick(f"{layer} · {tensor} · {name}")
        for _, members in fused_groups(weights, level("weight")) if "weight" in shared else [(w, [w]) for w in weights]:
            smoothing = [calibrated.smoothing.get(layer) for layer in members]
            reads = [partial(_read_weight, model, name, config, s) for name, s in zip(members, smoothing, strict=True)]
            given = [calibrated.statistics.get(layer, {}) for layer in members]
            group = _weight_group(model, members, reads, given, config, cache, extra, tick, ranks.rank, hessians)
            for entry, scales in zip(group, smoothing, strict=True):
                entry.smoothing = scales
            found += group
        if "input" in shared:
            inputs = [e for e in found if e.tensor == "input"]
            for unit, members in fused_groups([e.layer for e in inputs], level("input")):
                group = [next(e for e in inputs if e.layer == member) for member in members]
                serve(group, [e.data for e in group], shared["input"], unit)
        found.sort(key=lambda e: order[(e.layer, e.tensor)])
        warnings.extend(note for note in calibrated.notes if note not in warnings)
        part = Analysis(facts, config, found, time.perf_counter() - start, list(warnings), recorded)
        if on_done is None:
            entries.extend(found)
        else:
            on_done(part)
        return _propagation(model, part, choices) if config.propagate else None

    failed = None
    hessians = _RunHessians(SpilledHessians(), SpilledHessians())
    try:
        weights = [layer for layer in mine if "weight" in config.specs]
        if gptq:
            hessians.held_out = held_out_hessians(model, weights, config, ranks)
        calibrated = calibrate(model, layers, attention, config, cache, ranks, extra, finish, tap) if streams else None
        rest = [unit for unit in dict.fromkeys(job[0] for job in jobs) if unit not in finished]
        if rest:
            finish(rest, calibrated or Calibrated())
    except (ValueError, OSError, RuntimeError) as err:  # one rank's reads failing stops every rank
        failed = err
    finally:
        hessians.held_out.close()
    ranks.agree(failed)
    entries.sort(key=lambda e: order[(e.layer, e.tensor)])
    if progress is not None:
        progress(total, total, "done")
    return Analysis(facts, config, entries, time.perf_counter() - start, warnings, recorded)


def _propagation(model, part: Analysis, choices: Callable[[Analysis], Choices] | None) -> Propagation | None:
    """What the next block calibrates behind: ``part``'s layers fake-quantized with the observer
    each would be exported with (``choices``, else ``lab.results.choose`` by the default metric);
    under GPTQ a chosen weight is its GPTQ weight, as llm-compressor's sequential pipeline
    calibrates the next block behind the already GPTQ-quantized one. Those are made widest input
    first, after the analysis's freed memory is handed back: the hooks hold every one of them, and
    the widest's sweep (a 7B ``down_proj``'s ``(11008, 11008)`` matrices) then runs beside none.
    They are made when the pass installs the hooks, and let go with them: a block whose outputs
    nothing reads (the last, with no layer after it) makes none."""
    chosen = choose(part, DEFAULT_METRIC) if choices is None else choices(part)
    served = as_chosen(part, chosen)
    entries = [e for e in part.entries if e.tensor in LAYER_TENSORS and (e.layer, e.tensor) in served]
    if not entries:
        return None
    heads = getattr(getattr(model, "config", None), "num_attention_heads", 1)
    owner = threading.get_ident()

    def hooks(module: nn.Module) -> AbstractContextManager:
        return_freed_memory()
        made = {
            (e.layer, e.tensor): _quantized(e, served[(e.layer, e.tensor)].result, part.config)
            for e in sorted(entries, key=_sweep_width, reverse=True)
        }
        quantization = {(e.layer, e.tensor): made[(e.layer, e.tensor)] for e in entries}
        return quantizing_hooks(module, quantization, heads, owner)

    return hooks


def _sweep_width(entry: TensorAnalysis) -> int:
    """A GPTQ weight's input columns (its Hessian is their square); 0 for what no sweep makes."""
    return entry.shape[-1] if entry.tensor == "weight" and entry.hessian_source is not None else 0


def _quantized(entry: TensorAnalysis, result: SuiteResult, config: RunConfig) -> TensorQuant:
    """How propagation quantizes one chosen tensor (``result``: its choice as served)."""
    if entry.spec.dynamic:
        return TensorQuant(entry.spec)
    if entry.tensor == "weight":
        return weight_quant(entry, result, config.gptq)
    return TensorQuant(entry.spec, result.qparams)


def _calibration_set(model, config: RunConfig) -> CalibrationSamples | None:
    """The calibration set the pass ran on (tokenized once: the model keeps it); None for a model
    that does not tell (a stand-in)."""
    if not hasattr(model, "calibration_set"):
        return None
    options = config.capture_options()
    return model.calibration_set(options["texts"], options["samples"], options["seq_len"])


def _activation_entry(
    layer: str, tensor: str, spec: ob.QuantSpec, calibrated: Calibrated, rank: int | None
) -> TensorAnalysis:
    """An activation's entry from the calibration pass: results, tools, sample, whole shape."""
    key = (layer, tensor)
    slots = calibrated.results[key]
    results = [slot.known for slot in slots if slot.tool is None]
    entry = TensorAnalysis(layer, tensor, spec, calibrated.samples[key], results, None, calibrated.shapes[key], rank)
    entry.tool_results = [ToolResult(slot.tool, slot.profile, slot.known) for slot in slots if slot.tool is not None]
    entry.metrics_tokens = calibrated.sampled[key]
    return entry


def _read_weight(model, layer: str, config: RunConfig, smoothing: torch.Tensor | None) -> torch.Tensor:
    """A layer's weight read from its model, as the run's transform shows it."""
    return observed.weight_view(config, model.weight(layer), smoothing)


def _owned(layers: Sequence[str], config: RunConfig, ranks: Ranks) -> list[str]:
    """The layers whose weights this rank analyses: every one in one process; with several ranks,
    fused group ``i`` (a layer alone when nothing is shared) goes to rank ``i % world_size``, so a
    group's shared scales are computed in one place."""
    if ranks.world_size <= 1:
        return list(layers)
    serving = serving_level(config.specs)
    groups = fused_groups(layers, serving) if serving is not None else [(layer, [layer]) for layer in layers]
    return [
        layer for i, (_, members) in enumerate(groups) if owner(i, ranks.world_size) == ranks.rank for layer in members
    ]


def _weight_group(
    model,
    layers: Sequence[str],
    reads: Sequence[Callable[[], torch.Tensor]],
    given: Sequence[dict[str, torch.Tensor | None]],
    config: RunConfig,
    cache: ResultCache,
    extra: str,
    tick: Callable[[str], None],
    rank: int,
    hessians: _RunHessians,
) -> list[TensorAnalysis]:
    """The weight entries of one fused group (or one layer): each observed alone (``_weight_entry``),
    then served together when the run's weight scales are shared (``lab.analyse.served``), then
    put through GPTQ with the served qparams and the layer's held-out Hessian (read when its rows need it),
    its own Hessian then moved from the calibration's statistics to a file (``_RunHessians.kept``).
    The weights are read once and dropped afterwards."""
    data = [read() for read in reads]
    entries = [
        _weight_entry(model, layer, read, tensor, config, cache, statistics, extra, tick, rank)
        for layer, read, tensor, statistics in zip(layers, reads, data, given, strict=True)
    ]
    how = shared_tensors(config.specs).get("weight")
    if how is not None and len(entries) > 1:
        serve(entries, data, how, unit(layers[0], level("weight")))
    if config.gptq is not None:
        for entry, tensor, statistics in zip(entries, data, given, strict=True):
            hessian = statistics.pop("gptq_hessian", None)
            entry.gptq = gptq_rows(
                entry.results,
                tensor,
                hessian,
                entry.spec,
                config.gptq,
                config.knobs,
                partial(hessians.held_out.get, entry.layer, tensor.device),
            )
            entry.hessian_source = None if hessian is None else hessians.kept.put([entry.layer], hessian)
            del hessian
    return entries


@dataclass
class _RunHessians:
    """A GPTQ run's Hessians on disk: the held-out ones (``lab.gptq.held_out``, read when a layer's
    rows are made, removed with the run) and each layer's own once its rows are made (``kept``,
    read when propagation, the checkpoint or a page makes a GPTQ weight again, removed when the
    last entry reading them goes), so the run holds one layer's Hessian at a time, not every
    layer's of the model. Layers fed one input (q, k and v) share one file."""

    held_out: SpilledHessians
    kept: SpilledHessians


def _weight_entry(
    model,
    layer: str,
    read: Callable[[], torch.Tensor],
    data: torch.Tensor,
    config: RunConfig,
    cache: ResultCache,
    given: dict[str, torch.Tensor | None],
    extra: str,
    tick: Callable[[str], None],
    rank: int,
) -> TensorAnalysis:
    """A weight (``data``, read by ``read``) observed by each of the run's weight observers (through
    the cache), with the statistics of its layer's inputs (``given``) where an observer takes them,
    and as each tool would. The entry keeps ``read``, not the weight."""
    spec, names = config.specs["weight"], config.observers_for("weight")
    g_idx = observed.g_idx_for(config, spec, given.get("importance"))
    weight_extra = extra if g_idx is not None else extra.removeprefix(config.calibration_key())
    tensor_id = activations_tensor_id(model, (layer, "weight"))
    results = []
    for name in names:
        tick(f"{layer} · weight · {name}")
        knobs = dict(config.knobs.get(name, {}))
        key = cache.key(tensor_id, spec, name, knobs, weight_extra + str(config.actorder))
        filled = sorted(knob for knob in given if knob in ob.knobs(name) and knob not in knobs)
        if filled:
            inputs_key = f"{'+'.join(filled)}|{config.calibration_key()}"
            key = cache.key(tensor_id, spec, name, knobs, inputs_key + weight_extra)
            knobs |= {knob: given[knob] for knob in filled}
        run = partial(ob.run_one, name, data, spec, "weight", g_idx=g_idx, **knobs)
        results.append(cache.get_or_run(key, run))
    entry = TensorAnalysis(layer, "weight", spec, read, results, g_idx, tuple(data.shape), rank)
    entry.tool_results = [_as_tool(tool, entry, data, cache, tensor_id, weight_extra) for tool in config.tools]
    return entry


def _as_tool(
    tool: str, entry: TensorAnalysis, data: torch.Tensor, cache: ResultCache, tensor_id: str, extra: str
) -> ToolResult:
    """A weight observed as ``tool`` would by default: its observer, knobs and conventions, through
    the result cache like the observers (a re-run after a knob change reuses it). Activations get
    theirs in the calibration pass (``lab.calibrate.activations``)."""
    try:
        found = profile(tool, entry.tensor, entry.spec)
    except ValueError as err:
        return ToolResult(tool, None, SuiteResult(tool, None, {}, 0.0, {}, 0, str(err)))
    kind = _observer_kind(entry.tensor)
    run = partial(ob.run_one, found.observer, data, found.spec, kind, g_idx=entry.g_idx, **found.knobs)
    result = cache.get_or_run(cache.key(tensor_id, found.spec, found.observer, found.knobs, extra), run)
    return ToolResult(tool, found, replace(result, name=f"{tool}: {found.observer}"))
