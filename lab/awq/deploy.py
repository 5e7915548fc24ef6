"""AWQ as a checkpoint deploys it (issue 41): one variant (``--awq-variant``, llm-compressor's
unless told otherwise), one observer per mapping, each mapping's scales, and each balance layer's
qparams on its folded weight, the tensor the checkpoint stores.

A mapping's balance layers share its scales, and under ``observer-in-search`` and ``clip-search``
the scales are the observer's own, so a mapping has one observer: the one ``--choose`` names for
its layers, else the best by an AWQ figure (``awq:mapping_error`` unless ``--choose-by`` names
another) under the deployed variant. A balance layer's qparams are computed on its folded weight
``F`` (its columns times its mapping's scales, its rows divided by the scales of the mapping it
smooths, as llm-compressor quantizes after every mapping of the block has folded): the observer on
``F`` with the statistics of the smoothed inputs, or the clip search's ranges scaled with the rows;
the layers a server fuses then share the scale it keeps (NVFP4's global scale).

``AWQDeploy`` is what the run writes beside its JSON (``x.awq.json``'s ``deployed``) and what the
checkpoint (each stored tensor folded as it is read, ``fold``), the recipe (``AWQModifier``'s
arguments, ``modifier``) and the model-level effect (``model_weights``) read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping as MappingType
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import pandas as pd
import torch

import observers as ob
from lab.allocator import large_blocks_mapped
from lab.awq import candidates, observed
from lab.awq.fold import fold_key, folded_keys, fused_views
from lab.awq.mappings import Mapping
from lab.awq.run import AWQRun
from lab.awq.search import MappingResult, Variant
from lab.awq.table import awq_frame
from lab.export.lab_json import LabEntry, LabFile
from lab.results import higher_is_better
from lab.vocab import AWQ_METRIC_PREFIX
from sample_models import Model
from sample_models.layers import EXPERT_TYPE

DEFAULT_FIGURE = AWQ_METRIC_PREFIX + "mapping_error"
"""What a mapping's observer is chosen by when ``--choose-by`` is not an AWQ figure."""
LC_DUO_SCALING = {"on": True, "off": False, "both": "both"}
"""``AWQSpec.duo_scaling`` as ``AWQModifier`` spells it."""


@dataclass(frozen=True)
class DeployedMapping:
    """One mapping as deployed: its observer, its scales (float64 ``(in,)``; None: not smoothed,
    ``rtn``) and the figure it was chosen by (None: named with ``--choose``)."""

    mapping: Mapping
    observer: str
    scales: torch.Tensor | None
    figure: float | None = None


@dataclass(frozen=True)
class AWQDeploy:
    """The deployed variant, its mappings in the order they fold, and each balance layer's
    qparams on its folded weight; ``knobs``: each deployed observer's knobs as the person gave
    them (the input statistics it takes are the smoothed inputs', filled when it ran);
    ``stored_keys``: the tensors the scales touch that the checkpoint stores under another name
    than the loaded model's (a hub Mixtral's ``mlp.experts.0.gate_proj.weight`` stored as
    ``block_sparse_moe.experts.0.w1.weight``, its router as ``block_sparse_moe.gate.weight``),
    module key → stored key. Layers are named by their modules throughout; ``fold``, ``touched``,
    ``input_scales``, ``output_scales``, ``observer_of`` and ``applied`` speak the stored names
    where they differ, as the checkpoint and the lab file do."""

    variant: Variant
    awq: ob.AWQSpec
    spec: ob.QuantSpec
    chosen_by: str
    mappings: tuple[DeployedMapping, ...]
    qparams: dict[str, ob.QParams]
    shapes: dict[str, tuple[int, ...]]
    knobs: dict[str, dict[str, Any]]
    stored_keys: dict[str, str] = field(default_factory=dict)

    @property
    def folds(self) -> list[tuple[Mapping, torch.Tensor]]:
        return [(m.mapping, m.scales) for m in self.mappings if m.scales is not None]

    def fold(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """The stored tensor ``key`` as the checkpoint holds it (``tensor`` when no scale touches it)."""
        return fold_key(self._module_key(key), tensor, self.folds)

    def touched(self) -> list[str]:
        """Every stored key the scales change."""
        keys = (key for mapping, _ in self.folds for key in folded_keys(mapping))
        return list(dict.fromkeys(self.stored_keys.get(key, key) for key in keys))

    def input_scales(self, layer: str) -> torch.Tensor | None:
        """The scales folded into ``layer``'s columns (its inputs are ``x/s``); None: not a balance layer."""
        layer = self._module_layer(layer)
        return next((m.scales for m in self.mappings if layer in m.mapping.balance), None)

    def output_scales(self, layer: str) -> torch.Tensor | None:
        """The scales that divide ``layer``'s last rows (the mapping it smooths); None: none does."""
        layer = self._module_layer(layer)
        return next((m.scales for m in self.mappings if m.mapping.smooth == layer), None)

    def observer_of(self, layer: str) -> str:
        layer = self._module_layer(layer)
        return next(m.observer for m in self.mappings if layer in m.mapping.balance)

    def listed(self, layer: str) -> str:
        """The name the model lists module ``layer`` by: where its weight is stored."""
        return self.stored_keys.get(f"{layer}.weight", f"{layer}.weight").removesuffix(".weight")

    @cached_property
    def _modules_by_stored(self) -> dict[str, str]:
        return {stored: module for module, stored in self.stored_keys.items()}

    def _module_key(self, key: str) -> str:
        return self._modules_by_stored.get(key, key)

    def _module_layer(self, layer: str) -> str:
        return self._module_key(f"{layer}.weight").removesuffix(".weight")

    def applied(self, lab_file: LabFile) -> LabFile:
        """``lab_file`` with every balance layer's weight chosen as deployed (its mapping's
        observer, its qparams on the folded weight); a balance layer the file lacks is added, since
        the search quantized it."""
        entries = {(e.layer, e.tensor): e for e in lab_file.entries}
        for module, qparams in self.qparams.items():
            observer, name = self.observer_of(module), self.listed(module)
            chosen = {"observer": observer, "knobs": dict(self.knobs.get(observer, {})), "qparams": qparams}
            old = entries.get((name, "weight"))
            if old is None:
                entries[(name, "weight")] = LabEntry(
                    name, "weight", self.shapes[module], self.spec, metrics={}, runner_up=None, **chosen
                )
            else:
                entries[(name, "weight")] = replace(old, spec=self.spec, metrics={}, runner_up=None, **chosen)
        return replace(lab_file, entries=list(entries.values()))

    def modifier(self, notes: list[str]) -> dict[str, Any]:
        """``AWQModifier``'s arguments reproducing the scale search: the knobs and the exact
        mappings (an MoE's router first among the balance layers, as llm-compressor lists it). A
        variant llm-compressor does not run gets a note: its oneshot gives the ``llm-compressor``
        variant's scales."""
        if self.variant != Variant.LLM_COMPRESSOR:
            notes.append(
                f"AWQ: this checkpoint deploys the {self.variant} variant; llm-compressor 0.14's AWQModifier searches "
                "with memoryless min-max and has no clip search, so its oneshot of this recipe gives the "
                "llm-compressor variant's scales"
            )
        return {
            "duo_scaling": LC_DUO_SCALING[self.awq.duo_scaling],
            "n_grid": self.awq.n_grid,
            "mappings": [
                {"smooth_layer": m.mapping.smooth, "balance_layers": [*m.mapping.scaled, *m.mapping.balance]}
                for m in self.mappings
            ],
        }

    def lines(self) -> list[str]:
        """The deployment in words, one line per mapping (the checkpoint's notes, the CLI)."""
        head = f"AWQ {self.variant} (n_grid {self.awq.n_grid}, duo scaling {self.awq.duo_scaling})"
        smoothed = len(self.folds)
        lines = [
            f"{head}: {smoothed} mapping(s) folded into their smooth and balance layers; observers by {self.chosen_by}"
        ]
        for m in self.mappings:
            how = "named with --choose" if m.figure is None else f"{self.chosen_by}={m.figure:.6g}"
            lines.append(f"{m.mapping.name}: {m.observer} ({how})")
        return lines

    def model_weights(self, model: Model, folded: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Every balance layer's weight as the deployed model computes it, in the model's own
        coordinates: ``diag(s_out)·Q(F)·diag(1/s_in)``, which on the unsmoothed inputs computes what
        ``Q(F)`` computes on the smoothed ones (what the model-level effect runs). ``folded``: each
        balance layer's ``F`` by name, where the caller has them (``weights_of_run``), taken out of
        it as each is used, so that a layer's ``F`` and its deployed weight are not both held for
        every layer."""
        stored = StoredByLayer(model)
        return {name: self.model_weight(stored, name, folded) for name in self.balance_layers()}

    def balance_layers(self) -> list[str]:
        """Every balance layer the deployment quantizes, mapping by mapping."""
        return [name for m in self.mappings for name in m.mapping.balance]

    def model_weight(
        self, stored: StoredByLayer, name: str, folded: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """One balance layer's weight as ``model_weights`` gives it, read from ``stored`` (or its
        ``F`` taken out of ``folded``): what the model-level effect makes as the layer's block runs."""
        scales = next(m.scales for m in self.mappings if name in m.mapping.balance)
        if folded is not None and name in folded:
            weight = folded.pop(name)
        else:
            weight = self.fold(f"{name}.weight", stored(f"{name}.weight"))
        dtype = weight.dtype
        quantized = ob.fake_quantize(weight, self.qparams[name], self.spec)
        del weight  # the folded copy goes before the float64 arithmetic, done in place on a copy of its own
        wide = quantized.to(torch.float64, copy=True)
        del quantized
        s_out = self.output_scales(name)
        if s_out is not None:
            wide[-s_out.numel() :] *= s_out.view(-1, 1)
        if scales is not None:
            wide /= scales.view(1, -1)
        return wide.to(dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": str(self.variant),
            "awq": self.awq.to_dict(),
            "spec": self.spec.to_dict(),
            "chosen_by": self.chosen_by,
            "mappings": [
                {
                    "smooth": m.mapping.smooth,
                    "balance": list(m.mapping.balance),
                    "scaled": list(m.mapping.scaled),
                    "parent": m.mapping.parent,
                    "block": m.mapping.block,
                    "observer": m.observer,
                    "figure": m.figure,
                    "scales": None if m.scales is None else m.scales.tolist(),  # float64 repr: exact
                }
                for m in self.mappings
            ],
            "layers": {
                name: {"shape": list(self.shapes[name]), "qparams": qp.to_dict()} for name, qp in self.qparams.items()
            },
            "knobs": self.knobs,
            "stored_keys": self.stored_keys,
        }

    @classmethod
    def from_dict(cls, data: MappingType[str, Any]) -> AWQDeploy:
        """From ``to_dict``'s form; a malformed record is one ``ValueError``."""
        try:
            mappings = tuple(
                DeployedMapping(
                    Mapping(m["smooth"], tuple(m["balance"]), m["parent"], int(m["block"]), tuple(m["scaled"])),
                    m["observer"],
                    None if m["scales"] is None else torch.tensor(m["scales"], dtype=torch.float64),
                    m["figure"],
                )
                for m in data["mappings"]
            )
            layers = data["layers"]
            return cls(
                Variant(data["variant"]),
                ob.AWQSpec.from_dict(dict(data["awq"])),
                ob.QuantSpec.from_dict(dict(data["spec"])),
                data["chosen_by"],
                mappings,
                {name: ob.QParams.from_dict(layer["qparams"]) for name, layer in layers.items()},
                {name: tuple(layer["shape"]) for name, layer in layers.items()},
                {name: dict(knobs) for name, knobs in data["knobs"].items()},
                dict(data.get("stored_keys", {})),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"the AWQ deployment record is malformed: {err!r}") from None


class StoredByLayer:
    """A model's stored tensors by its modules' names: an expert of a fused experts module
    (``experts.3.up_proj.weight``) read as its view of the module's 3-D tensor (``fold.fused_views``;
    each 3-D tensor read once), a tensor the checkpoint stores under another name (``renamed``,
    ``Model.stored_key``: a hub Mixtral's per-expert ``w1``, its router) read from there."""

    def __init__(self, model: Model) -> None:
        self.model, self.keys = model, set(model.stored_keys())
        self.fused: dict[str, str] = {}
        for info in model.layers():
            if info.type == EXPERT_TYPE:
                experts, projection = info.name.rsplit(".", 2)[0], info.name.rsplit(".", 1)[1]
                source = "down_proj" if projection == "down_proj" else "gate_up_proj"
                self.fused[f"{info.name}.weight"] = f"{experts}.{source}"
        self._read: dict[str, dict[str, torch.Tensor]] = {}
        self.renamed: dict[str, str] = {}

    def holds(self, key: str) -> bool:
        if key in self.keys or key in self.fused or key in self.renamed:
            return True
        stored = self.model.stored_key(key)
        if stored is not None:
            self.renamed[key] = stored
        return stored is not None

    def __call__(self, key: str) -> torch.Tensor:
        if key in self.keys:
            return self.model.stored(key)
        if key not in self.fused:
            if not self.holds(key):
                raise KeyError(key)
            return self.model.stored(self.renamed[key])
        source = self.fused[key]
        if source not in self._read:
            self._read[source] = fused_views(source, self.model.stored(source))
        return self._read[source][key]


def figure_of(choose_by: str) -> str:
    """The AWQ figure a mapping's observer is chosen by: ``choose_by`` when it is one."""
    return choose_by if choose_by.startswith(AWQ_METRIC_PREFIX) else DEFAULT_FIGURE


def choose_observers(
    run: AWQRun, variant: Variant, figure: str, rules: Sequence[tuple[str, str]] = ()
) -> dict[str, tuple[str, float | None]]:
    """Per mapping (by name), its observer under ``variant`` and its ``figure`` (an ``awq:`` one):
    the last ``--choose`` rule whose glob matches one of its balance layers, else the best by
    ``figure`` (ties keep the run's observer order). A mapping where no observer has a figure,
    or a named observer without a row there, is one ``ValueError``."""
    column = figure.removeprefix(AWQ_METRIC_PREFIX)
    sign = -1.0 if higher_is_better(figure) else 1.0
    frame = awq_frame(run)
    if column not in frame.columns:
        raise ValueError(f"--choose-by {figure}: this run has no such figure (AWQ then GPTQ's needs --gptq)")
    frame = frame[(frame["variant"] == str(variant)) & frame["error"].isna()]
    chosen: dict[str, tuple[str, float | None]] = {}
    for result in run.results:
        rows = frame[frame["mapping"] == result.mapping.name]
        values = {o: float(v) for o, v in zip(rows["observer"], rows[column], strict=True) if not pd.isna(v)}
        named = [o for pattern, o in rules if any(fnmatch.fnmatchcase(b, pattern) for b in result.mapping.balance)]
        if named:
            if named[-1] not in set(rows["observer"]):
                raise ValueError(f"--choose: {result.mapping.name}: {named[-1]} has no {variant} result there")
            chosen[result.mapping.name] = (named[-1], None)
        elif values:
            best = min(values, key=lambda o: sign * values[o])
            chosen[result.mapping.name] = (best, values[best])
        else:
            raise ValueError(f"{result.mapping.name}: no observer has {figure} under the {variant} variant")
    return chosen


@large_blocks_mapped()
def of_run(
    model: Model,
    run: AWQRun,
    variant: Variant,
    observers: MappingType[str, str],
    chosen_by: str = DEFAULT_FIGURE,
    figures: MappingType[str, float | None] | None = None,
    *,
    folded: dict[str, torch.Tensor] | None = None,
) -> AWQDeploy:
    """The deployment of ``run`` under ``variant`` with ``observers`` (per mapping name): the scales
    of each mapping's observer and each balance layer's qparams on its folded weight (put in
    ``folded`` by name when given). A stored tensor the scales touch that the model's files do not
    hold under its module's name, or an observer without qparams there, is one ``ValueError``. Its
    folded weights and the observers' work on them are large blocks of several sizes, mapped for
    themselves (``lab.allocator.large_blocks_mapped``)."""
    stored = StoredByLayer(model)
    mappings = []
    for result in run.results:
        observer = observers[result.mapping.name]
        if (variant, observer) not in result.qparams:
            raise ValueError(f"{result.mapping.name}: {observer} has no {variant} result to deploy")
        scales = result.scales.get((variant, observer))
        figure = None if figures is None else figures.get(result.mapping.name)
        mappings.append(DeployedMapping(result.mapping, observer, scales, figure))
    skeleton = AWQDeploy(variant, run.awq, run.spec, chosen_by, tuple(mappings), {}, {}, {})
    read = skeleton.touched() + [f"{name}.weight" for m in mappings for name in m.mapping.balance]
    missing = list(dict.fromkeys(key for key in read if not stored.holds(key) and not key.endswith(".bias")))
    if missing:
        raise ValueError(f"AWQ folds into tensors the model's files do not hold by these names: {', '.join(missing)}")
    qparams: dict[str, ob.QParams] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for result, deployed in zip(run.results, mappings, strict=True):
        found = {}
        for name in result.mapping.balance:
            raw = stored(f"{name}.weight")
            weight = skeleton.fold(f"{name}.weight", raw)
            if folded is not None:
                folded[name] = weight
            s_out = skeleton.output_scales(name)
            if s_out is None and result.weights.get(name) == candidates.tensor_digest(raw):
                found[name] = result.qparams[(variant, deployed.observer)][name]  # found on this very F
            else:
                found[name] = _layer_qparams(run, result, variant, deployed, weight, name, s_out)
            shapes[name] = tuple(weight.shape)
        qparams |= candidates.share_fused(found, run.spec)
    knobs = {m.observer: dict(run.observers.get(m.observer, {})) for m in mappings}
    return replace(skeleton, qparams=qparams, shapes=shapes, knobs=knobs, stored_keys=dict(stored.renamed))


def weights_of_run(
    model: Model, run: AWQRun, variant: Variant, observers: MappingType[str, str]
) -> dict[str, torch.Tensor]:
    """Every balance layer's weight as ``of_run``'s deployment computes it, in the model's own
    coordinates (``AWQDeploy.model_weights``), each folded weight made once for its qparams and
    its weight."""
    folded: dict[str, torch.Tensor] = {}
    deployed = of_run(model, run, variant, observers, folded=folded)
    return deployed.model_weights(model, folded)


def _layer_qparams(
    run: AWQRun,
    result: MappingResult,
    variant: Variant,
    deployed: DeployedMapping,
    weight: torch.Tensor,
    name: str,
    s_out: torch.Tensor | None,
) -> ob.QParams:
    """``Q(F)``'s qparams as the variant deploys it: the clip search's ranges with their rows
    scaled as the weight's were, else the observer on ``F`` with the statistics of ``x/s_in``."""
    spec, observer = run.spec, deployed.observer
    if variant == Variant.CLIP_SEARCH:
        qp = result.qparams[(variant, observer)][name]
        if s_out is None:
            return qp
        rows = torch.ones(weight.shape[0], 1, dtype=torch.float64, device=weight.device)
        rows[-s_out.numel() :, 0] = 1.0 / s_out.to(rows.device)
        return ob.qparams.range_rule((qp.min_val * rows).float(), (qp.max_val * rows).float(), spec)
    knobs = observed.statistic_knobs(
        observer, run.observers.get(observer, {}), result.importance, result.blocks.__getitem__, deployed.scales
    )
    try:
        return observed.observe(observer, weight, spec, knobs)
    except ValueError as err:
        raise ValueError(f"{name}: {observer} on the folded weight: {err}") from None
