"""Fused layers share the scales a server keeps one of (``observers.fused``, issue 39).

The NVFP4 rule is llm-compressor 0.14's linked observers (``Observer.get_global_scale``): the global
scale from the absmax of every member's statistics (``generate_gparam``), then each member's block
scales from its own ranges under it (``calculate_qparams(..., global_scale)``). The tests rebuild that
with compressed-tensors' own two functions, which llm-compressor calls, and compare bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers import fused

NVFP4 = ob.preset("NVFP4A16")["weight"]
FP8 = ob.preset("FP8")["weight"]


def _weights(seed: int, scales=(0.5, 1.0, 2.0), rows=(64, 16, 16), columns: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, columns, generator=g) * s for r, s in zip(rows, scales, strict=True)]


def _own(weights, spec=NVFP4, observer="memoryless_minmax", **knobs) -> list[ob.QParams]:
    return [ob.run_one(observer, w, spec, **knobs).qparams for w in weights]


def _llm_compressor_linked(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """llm-compressor's memoryless_minmax observers of q/k/v linked by ``fuse_weight_observers``:
    per-group min/max of each weight, the group's global scale from the absmax over all of them, each
    weight's block scales under it (E4M3 values), through compressed-tensors' functions."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    stats = []
    for w in weights:
        grouped = w.unflatten(-1, (-1, 16))
        stats.append((grouped.amin(dim=-1), grouped.amax(dim=-1)))
    absmax = stats[0][1].max()
    for low, high in stats:
        absmax = torch.max(absmax, -low.min())
        absmax = torch.max(absmax, high.max())
    global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    found = []
    for low, high in stats:
        scale, _ = calculate_qparams(low, high, args, global_scale=global_scale)
        found.append((scale.float(), global_scale.float()))
    return found


@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_groups_share_the_global_scale_llm_compressor_links(seed):
    weights = _weights(seed)
    shared = fused.share_global_scale(_own(weights), NVFP4)
    for qp, (scale, global_scale) in zip(shared, _llm_compressor_linked(weights), strict=True):
        assert torch.equal(qp.global_scale.reshape(1), global_scale.reshape(1))
        assert torch.equal(qp.scale, scale)


def test_the_member_reaching_farthest_sets_the_scale_and_keeps_its_qparams():
    weights = _weights(0, scales=(1.0, 3.0, 0.25))
    own = _own(weights)
    shared = fused.share_global_scale(own, NVFP4)
    assert fused.setter(own) == 1
    assert float(shared[0].global_scale) == float(own[1].global_scale) < float(own[0].global_scale)
    assert torch.equal(shared[1].scale, own[1].scale) and torch.equal(shared[1].global_scale, own[1].global_scale)
    # the others keep their own block ranges: only the block scales move, read against the shared global
    assert torch.equal(shared[0].max_val, own[0].max_val) and not torch.equal(shared[0].scale, own[0].scale)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=4), st.integers(0, 10_000))
def test_a_shared_scale_is_one_value_and_never_narrows_the_widest_member(scales, seed):
    weights = _weights(seed, scales=tuple(scales), rows=(16,) * len(scales), columns=64)
    for spec, how in ((NVFP4, "global"), (FP8, "tensor")):
        own = _own(weights, spec)
        shared = fused.share_global_scale(own, spec) if how == "global" else fused.share_tensor_range(own, spec)
        values = [qp.global_scale if how == "global" else qp.scale for qp in shared]
        assert all(torch.equal(values[0], value) for value in values)
        widest = own[fused.setter(own)]
        assert torch.equal(values[0], widest.global_scale if how == "global" else widest.scale)
        if how == "tensor":  # FP8 per tensor: the largest member scale, the one vLLM requantizes with
            assert float(values[0]) == max(float(qp.scale) for qp in own)


def test_a_sweep_searches_again_under_the_groups_global_scale_and_does_no_worse_than_reusing_its_picks():
    weights = _weights(1)
    for observer in ("nvfp4_fp8_sweep", "modelopt_mse"):
        own = _own(weights, observer=observer)
        group = fused.group_global_scale(own)
        assert fused.searches_under_global_scale(observer)
        for w, qp in zip(weights[1:], own[1:], strict=True):
            searched = ob.run_one(observer, w, NVFP4, group_global_scale=group)
            assert torch.equal(searched.qparams.global_scale, group)
            reused = fused.under_global_scale(qp, NVFP4, group)
            assert searched.metrics["mse"] <= ob.quantization_metrics(w, reused, NVFP4)["mse"] * (1 + 1e-6)
    assert not fused.searches_under_global_scale("mse_grid")


@pytest.mark.parametrize(
    ("spec", "value", "words"),
    [
        (ob.QuantSpec("int4", strategy="group", group_size=16), torch.tensor([100.0]), "needs dtype 'nvfp4'"),
        (NVFP4, torch.tensor([-1.0]), "positive finite"),
        (NVFP4, torch.tensor([1.0, 2.0]), "one element"),
    ],
)
def test_a_bad_group_global_scale_is_one_line(spec, value, words):
    result = ob.run_one("modelopt_mse", torch.randn(16, 64), spec, group_global_scale=value)
    assert result.qparams is None and words in result.error and "\n" not in result.error


def test_sharing_needs_what_the_rule_shares():
    with pytest.raises(ValueError, match="global scale"):
        fused.group_global_scale(_own(_weights(0), FP8))
    with pytest.raises(ValueError, match="per-tensor"):
        fused.share_tensor_range(_own(_weights(0), ob.QuantSpec("fp8_e4m3", strategy="channel")), FP8)
