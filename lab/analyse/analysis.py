"""What a run produced: ``Analysis`` (every analysed tensor of one run, and the facts of its model),
``TensorAnalysis`` (the suite's results on one tensor) and ``ToolResult`` (a tool's default beside
them).

A module of their own, below both sides of the pipeline: many modules read analyses
(``lab.results`` ranks them, ``lab.export`` writes them, ``lab.effect`` and ``lab.scale.sweep`` take
them in) and one makes them, ``lab.analyse.pipeline``, which itself asks ``lab.results`` what
propagation quantizes with. From here the readers get the types without the calibration pass,
and the pipeline imports its readers without a circle (``tests/test_architecture.py`` checks
that ``lab/`` has none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import observers as ob
from lab.analyse.kept_values import KeptValues, ValueHistogram, extremes_of
from lab.analyse.model_facts import ModelFacts
from lab.analyse.run_config import RunConfig
from lab.gptq.layer import GPTQRow
from lab.vocab import KV_TENSORS
from observers.suite import SuiteResult


@dataclass(frozen=True)
class ToolResult:
    """One tool's default on one tensor: its ``profile`` (observer, knobs, spec with the tool's
    conventions; None when the tool cannot express the scheme, ``result.error`` says why) and the
    suite's result, named ``"<tool>: <observer>"`` so plots and tables tell it from the observers."""

    tool: str
    profile: Any
    result: SuiteResult


@dataclass(frozen=True)
class Served:
    """How a server runs a tensor fused with others (``lab.runtime``): the fused ``unit``
    (``model.layers.0.self_attn qkv_proj``), its ``members`` in the run, what it keeps one of for
    them (``collapse``: ``global scale`` or ``tensor scale``), and per observer the member whose
    own range sets that shared scale (``set_by``: the one reaching farthest)."""

    unit: str
    members: tuple[str, ...]
    collapse: str
    set_by: dict[str, str] = field(default_factory=dict)


@dataclass
class TensorAnalysis:
    """The suite's results on one tensor of one layer.

    ``source`` is an activation's kept sample of tokens (``data``), or a function that reads a
    weight again from its checkpoint when a page asks for it: an analysis holds no whole weight. An
    activation of a run reopened from the history holds a seeded subset of that sample's tokens
    (``kept_values``; ``lab.analyse.kept_values``).
    ``total_shape`` is the shape over every calibration token (of every rank, when ranks split
    the batches; ``data`` is then this rank's sample), a weight's shape; ``rank`` is None for what
    all ranks computed together, else the rank that computed a weight's results."""

    layer: str
    tensor: str
    spec: ob.QuantSpec
    source: torch.Tensor | Callable[[], torch.Tensor]
    results: list[SuiteResult]
    g_idx: torch.Tensor | None = None
    total_shape: tuple[int, ...] | None = None
    rank: int | None = 0
    tool_results: list[ToolResult] = field(default_factory=list)
    """What each of ``RunConfig.tools`` produces by default (``lab.analyse.tools``): shown beside the
    observers, recorded in the JSON, never ranked, chosen or exported as qparams."""
    gptq: list[GPTQRow] = field(default_factory=list)
    """Of a weight, with ``RunConfig.gptq``: each observer's qparams under GPTQ beside round-to-nearest
    (``lab.gptq.layer``)."""
    hessian_source: torch.Tensor | Callable[[], torch.Tensor] | None = None
    """Of a weight, with ``RunConfig.gptq``: GPTQ's Hessian of the layer's inputs ``(in, in)``, fp32,
    kept so a chosen observer's GPTQ weight can be made again (propagation, the model-level effect,
    the updated weights' histogram, the checkpoint), or how to read it from the file it waits in
    (``lab.gptq.hessians.SpilledHessians``: a run keeps every layer's, 0.9 GB a 7B-wide block);
    never written into the lab JSON (the CLI keeps it beside it, ``lab.gptq.hessians``)."""
    metrics_tokens: int | None = None
    """Of an activation: the calibration tokens its error metrics were computed on (the kept
    sample, ``data``, on every rank); its qparams come from all ``num_tokens``."""
    served: Served | None = None
    """Of a tensor a server runs fused with others whose scales it shares: the fused group.
    ``results`` then hold each observer's qparams and figures as served (the group's shared scale),
    ``per_layer`` the same observers with this tensor's own scales."""
    per_layer: list[SuiteResult] = field(default_factory=list)
    """With ``served``: each observer's result with this tensor's own scales, in ``results``' order
    (what a runtime that does not fuse, e.g. transformers' own forward, runs)."""
    kept_values: KeptValues | None = None
    """Of an activation of a run reopened from the history (``lab.history.run_file``): the
    histogram and per-channel extremes of the whole sample its metrics saw, where ``data`` holds a
    seeded subset of the sample's tokens (``kept_values.KEPT_VALUES`` values)."""
    smoothing: torch.Tensor | None = None
    """Of a weight under a SmoothQuant transform: the scales its input columns are multiplied by
    (``lab.calibrate.observed.weight_view``), so the transformed weight is read from the model again."""

    @property
    def data(self) -> torch.Tensor:
        """The tensor: an activation's sample, or the weight read again (as the run's transform shows it)."""
        return self.source() if callable(self.source) else self.source

    @property
    def hessian(self) -> torch.Tensor | None:
        """GPTQ's Hessian (``hessian_source``), read from its file when it waits in one."""
        source = self.hessian_source
        return source() if callable(source) else source

    @property
    def values(self) -> torch.Tensor | ValueHistogram:
        """What a value histogram draws: ``data``, or a reopened run's histogram of the whole sample."""
        return self.data if self.kept_values is None else self.kept_values.histogram

    @property
    def extremes(self) -> torch.Tensor:
        """Of an activation or attention states: each channel's min and max over every token of the
        sample, as two tokens (``kept_values.extremes_of``), what per-channel figures draw."""
        return extremes_of(self.data) if self.kept_values is None else self.kept_values.extremes

    @property
    def kept_note(self) -> str | None:
        """ "170 of the 5,825 tokens the metrics saw" when a reopened run holds a subset of the sample
        (``kept_values``): what the figures re-derived from values draw on; None otherwise."""
        if self.kept_values is None or self.metrics_tokens is None:
            return None
        data = self.data
        held = int(data.shape[0] * data.shape[2]) if self.tensor in KV_TENSORS else int(data.shape[0])
        if held >= self.metrics_tokens:
            return None
        return f"{held:,} of the {self.metrics_tokens:,} tokens the metrics saw"

    @property
    def metrics_note(self) -> str | None:
        """ "metrics on 4,096 of 1,048,576 tokens" when the metrics saw a sample; None for a weight,
        or when they saw every token."""
        if self.metrics_tokens is None or self.metrics_tokens >= self.num_tokens:
            return None
        return f"metrics on {self.metrics_tokens:,} of {self.num_tokens:,} tokens"

    @property
    def shape(self) -> tuple[int, ...]:
        """The analysed tensor's shape (all ranks' tokens together for a split calibration)."""
        return tuple(self.data.shape) if self.total_shape is None else self.total_shape

    def result(self, observer: str) -> SuiteResult:
        for r in self.results:
            if r.name == observer:
                return r
        raise ValueError(f"observer {observer!r} was not run on {self.layer} {self.tensor}")

    @property
    def num_tokens(self) -> int:
        """Calibration tokens in ``data`` (0 for weights): rows of an activation, sequence
        positions of attention states ``(batch, heads, seq, head_dim)``."""
        if self.tensor == "weight":
            return 0
        if self.tensor in KV_TENSORS:
            return int(self.shape[0] * self.shape[2])
        return int(self.shape[0])


@dataclass
class Analysis:
    """Everything one run produced, in run order, and the facts of the model it ran on."""

    facts: ModelFacts
    config: RunConfig
    entries: list[TensorAnalysis]
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    """The calibration set the activations saw (``CalibrationSamples.to_dict``: source, fingerprint,
    samples, asked, tokens); None when nothing was calibrated."""
    served_choices: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """``lab.analyse.served.as_chosen``'s memo of fused groups whose members chose different
    observers, by group and choices: each page rerun, export and evaluation asks again, and serving
    such a group reads its weights (and may search again)."""

    @property
    def source(self) -> dict[str, Any]:
        """Where the analysed weights came from (``ModelFacts.source``)."""
        return self.facts.source

    def keys(self) -> list[tuple[str, str]]:
        """The analysed ``(layer, tensor)`` pairs in run order."""
        return [(e.layer, e.tensor) for e in self.entries]

    def entry(self, layer: str, tensor: str) -> TensorAnalysis:
        for e in self.entries:
            if e.layer == layer and e.tensor == tensor:
                return e
        raise ValueError(f"no results for layer {layer!r} tensor {tensor!r}")

    def frame(self):
        """pandas DataFrame: one row per (layer, tensor, observer) with metrics and time."""
        import pandas as pd

        rows = []
        for e in self.entries:
            frame = ob.results_frame(e.results)
            frame.insert(0, "tensor", e.tensor)
            frame.insert(0, "layer", e.layer)
            rows.append(frame)
        return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
