"""Every layer of every built-in model under every preset, weights only and with the preset's inputs.

What a new user tries first (``--layers all`` with a preset) must give every weight usable scales:
embeddings fed token ids, routers, heads, and experts the router never chooses included, with the
observers that take their layer's input statistics (imatrix_mse, local_hessian,
nvfp4_expanded_imatrix) among them wherever they apply. A small calibration and few observers keep
it fast; each model is opened once, and its result cache is shared by its cases, as the app shares
one: a weight analysed under a spec by an earlier case (same calibration) is read back, not
searched again, while each case still runs its own calibration pass through ``analyse``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import observers as ob
from lab import results
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.pipeline import analyse
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from sample_models import open_model
from sample_models.layers import EXPERT_PROJECTIONS, inputs_are_columns

MODELS = ("minilm", "tiny-llama", "tiny-moe")
WEIGHTED = ("imatrix_mse", "local_hessian", "nvfp4_expanded_imatrix")
"""The weight observers that take their layer's input statistics."""
UNROUTED = {
    f"model.layers.{block}.mlp.experts.{expert}.{projection}"
    for block, expert in ((0, 2), (0, 3), (1, 1), (1, 3))
    for projection in EXPERT_PROJECTIONS
}
"""tiny-moe's experts no token reaches (``sample_models.builtin``: the skewed router's top 2 are the
same for every token)."""
NO_TOKENS = "no tokens observed"


def _modes(preset: str) -> tuple[str, ...]:
    """Weights only, and with the preset's inputs when it quantizes them (W4A16 and NVFP4A16 do not)."""
    return ("weights", "activations") if ob.preset(preset)["input"] is not None else ("weights",)


CASES = [(preset, mode) for preset in ob.PRESET_NAMES for mode in _modes(preset)]


@pytest.fixture(scope="module", params=MODELS)
def opened(request) -> tuple[str, object, ResultCache]:
    """A built-in model, opened once for all its cases, and the result cache they share."""
    return request.param, open_model(request.param), ResultCache()


def _config(preset: str, mode: str) -> RunConfig:
    """The preset's weight spec (and input spec, with activations) with memoryless_minmax and the
    statistic-weighted observers that apply to the weight spec."""
    specs = {kind: spec for kind, spec in ob.preset(preset).items() if spec is not None}
    if mode == "weights":
        specs = {"weight": specs["weight"]}
    applicable = ob.applicable(specs["weight"])
    names = ("memoryless_minmax", *(name for name in WEIGHTED if name in applicable))
    return RunConfig(specs=specs, observers=names, samples=4, seq_len=32)


def _usable(entry: TensorAnalysis) -> bool:
    """At least one observer gave finite, positive scales."""
    return any(
        r.qparams is not None and bool(torch.isfinite(r.qparams.scale).all()) and bool((r.qparams.scale > 0).all())
        for r in entry.results
    )


def _flagged(lines: list[str]) -> set[str]:
    """The layers a run's lines say saw no token (each line starts with its layer's name)."""
    return {line.split(" ", 1)[0].removesuffix(":") for line in lines if NO_TOKENS in line}


def _analysed(model, config: RunConfig, cache: ResultCache) -> Analysis:
    """Every layer of ``model`` analysed; the observers' fallback warnings (an embedding's or an
    unrouted expert's missing statistics) are asserted in test_pipeline and test_uncalibrated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return analyse(model, [info.name for info in model.layers()], config, cache=cache)


@pytest.mark.parametrize(("preset", "mode"), CASES, ids=[f"{preset}-{mode}" for preset, mode in CASES])
def test_every_layer_gets_usable_weight_scales(opened, preset, mode):
    name, model, cache = opened
    config = _config(preset, mode)
    analysis = _analysed(model, config, cache)
    infos = model.layers()
    weights = {e.layer: e for e in analysis.entries if e.tensor == "weight"}
    assert list(weights) == [info.name for info in infos]
    unusable = {layer: [r.error for r in e.results] for layer, e in weights.items() if not _usable(e)}
    assert unusable == {}
    unrouted = UNROUTED if name == "tiny-moe" else set()
    assert _flagged(analysis.warnings) == unrouted  # their weight observers ran without input statistics
    if mode == "weights":
        assert [e for e in analysis.entries if e.tensor != "weight"] == []
        return
    inputs = {e.layer: e for e in analysis.entries if e.tensor == "input"}
    assert list(inputs) == list(weights)
    assert _flagged(results.token_warnings(analysis)) == unrouted
    assert {e.layer for e in results.uncalibrated(analysis)} == unrouted
    for info in infos:
        entry = inputs[info.name]
        if not inputs_are_columns(info):  # an embedding's inputs are token ids: every observer says so
            assert {r.error for r in entry.results if r.name == "memoryless_minmax"} == {
                "observe() needs a floating-point tensor, got torch.int64"
            }
        elif info.name not in unrouted:
            assert _usable(entry), f"{info.name} input: {[r.error for r in entry.results]}"
