"""The activation side of ``lab.analyse.pipeline.analyse``: one calibration pass, observers in the hooks.

``calibrate`` plans an ``Observation`` (``lab.calibrate.stream``) for each activation tensor and observer (and
each tool's default, ``--as``) whose result the cache does not hold, runs the model's calibration
batches once with an ``ObserverStream`` in its capture hooks (inputs and outputs of the layers, key
and value states of the attention blocks; block by block when the capture is sequential), and
returns small values: each tensor's results, its whole shape, the bounded sample of tokens the
capture kept (for plots and metrics) and the input statistics the weight observers take.

Per-token specs are the exception: their qparams belong to the tokens they were computed on, so
they are computed on the sample. A transform's view is applied batch by batch; SmoothQuant first
runs a pass that finds each input channel's ``max |x|``, since its scales need every token.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import observers as ob
from lab.analyse.run_config import RunConfig
from lab.analyse.tools import profile
from lab.calibrate import observed
from lab.calibrate.stream import ChannelMax, MeanStatistic, Observation, ObserverStream, Statistic, View, token_axis
from lab.scale.distributed import Ranks
from lab.vocab import KV_TENSORS, spec_key
from lab.vocab import observer_kind as _observer_kind
from observers.shared import Op
from observers.suite import SuiteResult
from observers.transforms import smoothing_scales
from sample_models.calibration import CaptureSubsampledWarning
from sample_models.capture import BlockTap, Done, Key, Propagation
from sample_models.layers import inputs_are_columns, io_widths
from sample_models.sequential import return_freed_memory


@dataclass
class Slot:
    """One result of a tensor, in the order the analysis lists them: already known (a cache hit,
    or a tool that cannot express the scheme) or still to come from its ``observation``."""

    name: str
    known: SuiteResult | None = None
    observation: Observation | None = None
    tool: str | None = None
    profile: Any = None


@dataclass
class Calibrated:
    """What the calibration pass hands ``analyse``, per tensor key ``(layer, "input"|"output")`` or
    ``(block, "k"|"v")``: ``results`` (observers and tools in their order; a tool's result is named
    ``"<tool>: <observer>"`` and listed in ``tools``), ``samples`` (the kept tokens, as the observers
    saw them), ``shapes`` (over every token of every rank), ``sampled`` (the sample's tokens on
    every rank: what the error metrics are computed on); ``statistics``: ``{layer: {knob:
    tensor}}`` for the weight observers; ``smoothing``: SmoothQuant's scales per layer."""

    results: dict[Key, list[Slot]] = field(default_factory=dict)
    samples: dict[Key, torch.Tensor] = field(default_factory=dict)
    shapes: dict[Key, tuple[int, ...]] = field(default_factory=dict)
    sampled: dict[Key, int] = field(default_factory=dict)
    statistics: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    smoothing: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def tensor_id(model: Any, key: Key) -> str:
    """What identifies a tensor's values in the result cache."""
    source = [getattr(model, "name", ""), str(getattr(model, "source", "")), str(getattr(model, "dtype", ""))]
    return f"{json.dumps(source)}|{key[0]}|{key[1]}"


def activation_keys(layers: Sequence[str], attention: Sequence[str], config: RunConfig) -> list[Key]:
    """The activation tensors a run observes, in run order."""
    sides = [side for side in ("input", "output") if side in config.specs]
    return [(layer, side) for layer in layers for side in sides] + [(b, w) for b in attention for w in KV_TENSORS]


UNREAD_SAMPLE_BYTES = 16 << 20
"""The capture keeps a sample of tokens whatever it is asked; a pass whose sample no one reads (one
for input statistics alone: GPTQ's Hessians, SmoothQuant's maxima, a weights-only run's) keeps a
small one rather than ``RunConfig.sample_bytes`` of every layer's inputs beside its statistics."""

Settled = Callable[[list[str], "Calibrated"], "Propagation | None"]
"""Told the layers and attention blocks whose activation results are final (a block at a time in a
sequential capture), with the ``Calibrated`` that holds them, so the caller can finish and hand on
those layers before the pass ends."""


def calibrate(
    model: Any,
    layers: Sequence[str],
    attention: Sequence[str],
    config: RunConfig,
    cache: Any,
    ranks: Ranks,
    extra: str,
    settled: Settled | None = None,
    tap: BlockTap | None = None,
) -> Calibrated:
    """Stream the calibration batches through the observers of every activation tensor of the run
    (and gather the input statistics its weight observers take). ``extra`` completes the cache keys
    (calibration, share, transform). ``tap`` rides the layers' pass (made for it alone when nothing
    else needs one)."""
    across = ranks.reduce if ranks.world_size > 1 else None
    keys = activation_keys(layers, attention, config)
    out = Calibrated(results={key: _plan(model, key, config, cache, extra) for key in keys})
    observations = {
        key: [s.observation for s in slots if s.observation and s.observation.spec.strategy != "token"]
        for key, slots in out.results.items()
    }
    statistics = _statistics(model, layers, config)
    if observed.smooths(config):
        out.smoothing = _smoothing_scales(model, layers, config, ranks) if layers else {}
        note = "SmoothQuant does not apply to key/value states; they are shown as captured"
        out.notes = [f"{block}: {note}" for block in attention]
    view = _view(config, out.smoothing)
    flat_statistics: dict[Key, list[Statistic]] = {key: list(found.values()) for key, found in statistics.items()}
    stream = ObserverStream(observations, flat_statistics, _empty_shapes(model, keys), view, across)
    device = torch.device(str(getattr(model, "device", "cpu")))

    def settle(done: list[Key], kept: dict[Key, torch.Tensor], counts: dict[Key, int]) -> Propagation | None:
        for key in sorted((k for k in done if k in out.results), key=lambda k: k in stream.same):
            sample = kept[key] if view is None else view(key, kept[key])
            out.samples[key] = sample
            out.shapes[key] = _whole_shape(key, sample, counts[key], across)
            out.sampled[key] = _whole_shape(key, sample, None, across)[token_axis(key)]
            stand_in = {slot.name: slot for slot in out.results.get(stream.same.get(key), ())}
            for slot in out.results[key]:
                found = stand_in.get(slot.name)
                if slot.known is not None:
                    continue
                if found is not None and found.observation is not None:
                    slot.known = cache.store(slot.observation.cache_key, found.known, computed=False)
                else:
                    slot.known = _result(cache, slot.observation, sample, across)
        settling = [key for key in done if key in statistics]
        for key in settling:
            found = _statistic_values(statistics[stream.stand_in(key)], across, device)
            if found is None:
                out.notes.append(_unreached_note(key[0]))
            elif found:
                out.statistics[key[0]] = found
        if settling:
            return_freed_memory()  # their fp64 sums, let go as each mean is made, before the weights are read
        if settled is None:
            return None
        return settled(list(dict.fromkeys(key[0] for key in done)), out)

    _capture(model, layers, attention, config, ranks, stream, settle, tap, read=bool(keys))
    return out


def _plan(model: Any, key: Key, config: RunConfig, cache: Any, extra: str) -> list[Slot]:
    """The tensor's results in order: the cache's where it holds them, else an observation."""
    spec, kind = config.specs[spec_key(key[1])], _observer_kind(key[1])
    ident = tensor_id(model, key)
    slots = []
    for name in config.observers_for(spec_key(key[1])):
        knobs = dict(config.knobs.get(name, {}))
        cache_key = cache.key(ident, spec, name, knobs, extra + str(config.actorder))
        known = cache.peek(cache_key)
        slots.append(Slot(name, known, None if known else Observation(name, name, spec, kind, knobs, cache_key)))
    for tool in config.tools:
        try:
            chosen = profile(tool, key[1], spec)
        except ValueError as err:
            slots.append(Slot(tool, SuiteResult(tool, None, {}, 0.0, {}, 0, str(err)), tool=tool))
            continue
        label = f"{tool}: {chosen.observer}"
        cache_key = cache.key(ident, chosen.spec, chosen.observer, chosen.knobs, extra)
        known = cache.peek(cache_key)
        observation = None if known else Observation(label, chosen.observer, chosen.spec, kind, chosen.knobs, cache_key)
        slots.append(Slot(label, known and replace(known, name=label), observation, tool, chosen))
    return slots


def _result(cache: Any, observation: Observation, sample: torch.Tensor, across: Any) -> SuiteResult:
    """``observation``'s result, kept in the cache under its key. A per-token observer runs on the
    sample: its qparams belong to the tokens they describe."""
    if observation.spec.strategy == "token":
        found = ob.run_one(
            observation.observer, sample, observation.spec, observation.kind, across=across, **observation.knobs
        )
        return cache.store(observation.cache_key, replace(found, name=observation.name))
    return cache.store(observation.cache_key, observation.result(sample, across))


def _statistics(model: Any, layers: Sequence[str], config: RunConfig) -> dict[Key, dict[str, MeanStatistic]]:
    """The input statistics the run's weight observers (or activation order) take, per layer input."""
    wanted = observed.wanted_statistics(config)
    if not wanted:
        return {}
    return {
        (layer, "input"): {knob: MeanStatistic(observed.INPUT_STATISTICS[knob]) for knob in wanted}
        for layer in _column_fed(model, layers)
    }


def _column_fed(model: Any, layers: Sequence[str]) -> list[str]:
    """The ``layers`` whose inputs are their weight's columns (``inputs_are_columns``): only theirs
    have statistics. An embedding has none, so its observers fall back as they say, rather than
    fail on (or stop the run over) the statistics of token ids."""
    infos = {info.name: info for info in model.layers()}
    return [layer for layer in layers if inputs_are_columns(infos[layer])]


def _statistic_values(
    found: dict[str, MeanStatistic], across: Any, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """Each statistic's mean over every token of one layer's inputs; None when no token reached them
    on any rank (an expert the router never chose), which the run says: the layer then has no
    statistic and its weight observers fall back as they say."""
    values = {}
    for knob, statistic in found.items():
        try:
            value = statistic.value(across, device)
        except ValueError:  # the same on every rank: it depends on the layer's shape only
            continue
        if value is None:
            return None
        values[knob] = value
    return values


def _unreached_note(layer: str) -> str:
    """The one line a run says about a layer whose inputs no calibration token reached, worded as
    ``lab.results.token_warnings`` words an activation that saw none; ``layer: `` first, as every
    run warning about one unit (a sweep files it under its unit)."""
    return (
        f"{layer}: no tokens observed at its input (an expert the router never chose?); "
        "its weight observers that take input statistics ran unweighted"
    )


def _view(config: RunConfig, smoothing: dict[str, torch.Tensor]) -> View | None:
    """How the transform of ``config`` shows each streamed tensor to its observers."""
    transform = config.transform
    if transform is None:
        return None
    if transform.kind == ob.TransformKind.HADAMARD:

        def rotated(key: Key, data: torch.Tensor) -> torch.Tensor:
            if key[1] in KV_TENSORS:
                return ob.transform_states(transform, data)
            return data if key[1] == "output" else ob.transform_layer(transform, None, data)[1]

        return rotated

    def smoothed(key: Key, data: torch.Tensor) -> torch.Tensor:
        scales = smoothing.get(key[0])
        return data.float() / scales if key[1] == "input" and scales is not None else data

    return smoothed


def _smoothing_scales(model: Any, layers: Sequence[str], config: RunConfig, ranks: Ranks) -> dict[str, torch.Tensor]:
    """SmoothQuant's scales per layer, from a first pass that finds each input channel's ``max |x|``
    over every token (merged across ranks) and the layer's weight."""
    across = ranks.reduce if ranks.world_size > 1 else None
    maxima = input_statistics(model, layers, config, ranks, ChannelMax)
    scales = {}
    for layer, found in maxima.items():
        weight = model.weight(layer)
        value = found.value if found.value is not None else torch.zeros(weight.shape[-1], device=weight.device)
        if across is not None:
            value = across(value, Op.MAX)
        scales[layer] = smoothing_scales(value.unsqueeze(0), weight, config.transform.alpha)
    return scales


def input_statistics(
    model: Any, layers: Sequence[str], config: RunConfig, ranks: Ranks, make: Callable[[], Any], **options: Any
) -> dict[str, Any]:
    """A pass of its own for one statistic of each layer's inputs (``make()`` per layer: a
    ``ChannelMax``, a ``MeanStatistic``) over every token, nothing kept; ``options`` replace the
    run's capture options (other ``texts``: GPTQ's held-out inputs). A layer whose inputs are not
    its weight's columns (an embedding) is left out."""
    across = ranks.reduce if ranks.world_size > 1 else None
    fed = _column_fed(model, layers)
    if not fed:
        return {}
    found = {(layer, "input"): [make()] for layer in fed}
    stream = ObserverStream({}, found, _empty_shapes(model, list(found)), None, across)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureSubsampledWarning)
        model.capture(fed, stream=stream, **(_options(config, ranks) | {"max_bytes": UNREAD_SAMPLE_BYTES} | options))
    # Layers fed one tensor (q, k and v) are summed once, under the first one's key.
    return {layer: found[stream.stand_in((layer, "input"))][0] for layer in fed}


def _options(config: RunConfig, ranks: Ranks) -> dict[str, Any]:
    """``config.capture_options()``, and this rank's share of the batches when ranks split them."""
    split = {"share": (ranks.rank, ranks.world_size)} if ranks.world_size > 1 else {}
    return config.capture_options() | split


def _capture(
    model: Any,
    layers: Sequence[str],
    attention: Sequence[str],
    config: RunConfig,
    ranks: Ranks,
    stream: ObserverStream,
    done: Done,
    tap: BlockTap | None = None,
    read: bool = True,
) -> None:
    """Run the calibration pass(es); ``done`` gets each group of keys with their kept tokens and the
    real tokens each saw. The sample is meant to be a sample (the observers see every token), so
    the capture's subsampling warning is not passed on; ``TensorAnalysis.metrics_note`` says it.
    ``read``: whether anything reads the sample (no activation observed: a small one is kept)."""
    options = _options(config, ranks) | ({} if read else {"max_bytes": UNREAD_SAMPLE_BYTES})
    wants_input = "input" in config.specs or bool(observed.wanted_statistics(config)) or observed.smooths(config)
    wants_output = "output" in config.specs
    busy = stream if any(stream.observations.values()) or stream.statistics else None  # else: a memo will do
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureSubsampledWarning)
        riding = {} if tap is None else {"tap": tap}
        if layers and (wants_input or wants_output):
            model.capture(list(layers), outputs=wants_output, stream=busy, done=done, **options, **riding)
        elif tap is not None:
            model.capture([], tap=tap, **options)
        if attention:
            model.capture_kv(list(attention), stream=busy, done=done, **options)


def _whole_shape(key: Key, sample: torch.Tensor, count: int | None, across: Any) -> tuple[int, ...]:
    """The shape of a tensor over every real token it saw (on every rank)."""
    shape = list(sample.shape)
    axis = token_axis(key)
    count = sample.shape[axis] if count is None else count
    if across is not None:
        count = int(across(torch.tensor([count], device=sample.device), Op.SUM))
    shape[axis] = count
    return tuple(shape)


def _empty_shapes(model: Any, keys: Sequence[Key]) -> dict[Key, tuple[int, ...]]:
    """Each key's shape with no tokens (a rank's empty part of a batch)."""
    infos = {info.name: info for info in model.layers()}
    shapes: dict[Key, tuple[int, ...]] = {}
    for layer, side in keys:
        if side in KV_TENSORS:
            heads, head_dim = model.kv_shape(layer)
            shapes[(layer, side)] = (1, heads, 0, head_dim)
        else:
            width_in, width_out = io_widths(infos[layer])
            shapes[(layer, side)] = (0, width_in if side == "input" else width_out)
    return shapes
