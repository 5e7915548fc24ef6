"""AWQ's core (``observers.awq``, issue 41): the scale grid, the weight means, the candidate scales and
the clip search's pieces, against hand cases and llm-compressor 0.14's / ModelOpt 0.47's formulas
written out here in plain torch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import observers as ob

INT4_G4 = ob.QuantSpec(dtype="int4", strategy="group", group_size=4, symmetric=True)


def test_the_grid_is_llm_compressors_in_its_order() -> None:
    grid = ob.AWQSpec().grid()
    assert len(grid) == 20
    assert grid[0] == (0.0, False)
    assert grid[1:] == [(i / 18, True) for i in range(19)]
    assert ob.AWQSpec(n_grid=5, duo_scaling="off").grid() == [
        (0.0, False),
        (0.25, False),
        (0.5, False),
        (0.75, False),
        (1.0, False),
    ]
    both = ob.AWQSpec(n_grid=6, duo_scaling="both").grid()
    assert both == [(0.0, False), (0.0, True), (0.5, False), (0.5, True), (1.0, False), (1.0, True)]


def test_the_clip_ratios_are_modelopts() -> None:
    assert ob.AWQSpec().clip_ratios() == [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]
    assert ob.AWQSpec(clip_min=0.8, clip_step=0.1).clip_ratios() == [0.8, 0.9, 1.0]


@pytest.mark.parametrize(
    ("settings_", "words"),
    [
        ({"n_grid": 2}, "n_grid must be an integer in [3, 1000]"),
        ({"n_grid": 3.0}, "n_grid must be an integer"),
        ({"duo_scaling": "yes"}, "duo_scaling must be one of 'on', 'off', 'both'"),
        ({"duo_scaling": "both", "n_grid": 3}, "needs n_grid >= 4"),
        ({"clip_min": 1.0}, "clip_min must be a number in [0.05, 1.0)"),
        ({"clip_step": 0.0}, "clip_step must be a number in [0.01, 0.5]"),
    ],
)
def test_a_knob_out_of_bounds_is_one_line(settings_: dict, words: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        ob.AWQSpec(**settings_)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_the_spec_round_trips_and_refuses_unknown_settings() -> None:
    spec = ob.AWQSpec(n_grid=10, duo_scaling="both", clip_min=0.6, clip_step=0.1)
    assert ob.AWQSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown AWQ setting"):
        ob.AWQSpec.from_dict({"grid": 3})


def test_weight_means_by_hand() -> None:
    # one layer, two rows, groups of 2: each group divided by its max |w| (+1e-6), then column means
    weight = torch.tensor([[1.0, -2.0, 4.0, 0.0], [-3.0, 3.0, 1.0, 2.0]])
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=2, symmetric=True)
    rows = [
        [1 / (2 + 1e-6), 2 / (2 + 1e-6), 4 / (4 + 1e-6), 0.0],
        [3 / (3 + 1e-6), 3 / (3 + 1e-6), 1 / (2 + 1e-6), 2 / (2 + 1e-6)],
    ]
    expected = torch.tensor(rows, dtype=torch.float64).mean(0)
    assert torch.allclose(ob.awq.weight_means([weight], spec), expected, rtol=1e-6)
    # two layers: their rows together
    both = ob.awq.weight_means([weight, weight * 2], spec)
    assert both.dtype == torch.float64 and torch.allclose(both, expected, rtol=1e-6)


def test_weight_means_refuse_groups_that_do_not_divide() -> None:
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    with pytest.raises(ValueError, match="group size 16 to divide the 40 input columns"):
        ob.awq.weight_means([torch.randn(8, 40)], spec)


def _llm_compressor_scales(x_mean, w_mean, ratio, duo):
    """llm-compressor 0.14's ``_compute_best_scale`` candidate, typed out."""
    if duo:
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
    scales = scales / (scales.max() * scales.min()).sqrt()
    scales[torch.isinf(scales)] = 1
    scales[torch.isnan(scales)] = 1
    return scales


@pytest.mark.parametrize("duo", ["on", "off", "both"])
def test_candidate_scales_are_llm_compressors_bit_for_bit(duo: str) -> None:
    torch.manual_seed(0)
    x_mean = torch.rand(64) * torch.logspace(-3, 1, 64)
    weight = torch.randn(32, 64)
    w_mean = ob.awq.weight_means([weight], INT4_G4)
    spec = ob.AWQSpec(n_grid=12, duo_scaling=duo)
    found = ob.awq.candidate_scales(x_mean, w_mean, spec.grid())
    for row, (ratio, use_duo) in zip(found, spec.grid(), strict=True):
        theirs = _llm_compressor_scales(x_mean, w_mean, ratio, use_duo)
        assert torch.equal(row, theirs.double())


def test_a_zero_channel_takes_the_floor() -> None:
    x_mean = torch.tensor([0.0, 1.0, 4.0])
    scales = ob.awq.candidate_scales(x_mean, None, [(0.5, False)])
    floor, top = 1e-4, 2.0  # x^0.5 = [0, 1, 2] floored at 1e-4, divided by sqrt(max*min)
    expected = torch.tensor([floor, 1.0, top]) / math.sqrt(top * floor)
    assert torch.allclose(scales[0], expected.double(), rtol=1e-6)
    with pytest.raises(ValueError, match="duo scaling needs"):
        ob.awq.candidate_scales(x_mean, None, [(0.5, True)])


@settings(max_examples=25, deadline=None)
@given(
    ratios=st.integers(1, 3),
    weights=st.integers(1, 3),
    rows=st.integers(1, 4),
    groups=st.integers(1, 3),
    tokens=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
@example(ratios=1, weights=3, rows=3, groups=2, tokens=1, seed=1)  # a single token: cancellation in float32
def test_group_output_errors_are_each_groups_part_of_the_output_error(
    ratios, weights, rows, groups, tokens, seed
) -> None:
    size = 4
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(weights, tokens, groups * size, generator=generator, dtype=torch.float64)
    d = torch.randn(ratios, weights, rows, groups * size, generator=generator, dtype=torch.float64)
    moments = x.transpose(1, 2) @ x / tokens
    blocks = torch.stack(
        [torch.stack([m[g * size : (g + 1) * size, g * size : (g + 1) * size] for g in range(groups)]) for m in moments]
    )
    found = ob.awq.group_output_errors(d, blocks)
    # by tokens: the mean over each weight's tokens of (Σ_{j in g} x_j d_j)², what ModelOpt's awq_clip sums per block
    products = x.reshape(1, weights, tokens, 1, groups, size) * d.reshape(ratios, weights, 1, rows, groups, size)
    per_group = products.sum(-1).square().mean(2)
    assert found.shape == (ratios, weights, rows, groups)
    # float32 inside: a quadratic form's rounding scales with Σ|d_i||H_ij||d_j|, which cancellation
    # (a rank-one block of a single token) can leave far above the form itself
    grouped = d.abs().reshape(ratios, weights, rows, groups, size)
    scale = torch.einsum("rwngi,wgij,rwngj->rwng", grouped, blocks.abs(), grouped)
    assert bool(((found.double() - per_group).abs() <= 1e-4 * per_group + 1e-6 * scale).all())


def test_group_output_errors_refuse_blocks_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="group_output_errors needs differences"):
        ob.awq.group_output_errors(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 4, 4))


def test_shrunk_ranges_and_the_formats_the_clip_search_takes() -> None:
    weight = torch.tensor([[1.0, -2.0, 0.5, 7.0]])
    qp = ob.run_one("memoryless_minmax", weight, INT4_G4, "weight").qparams
    half = ob.awq.shrunk(qp, INT4_G4, [0.5])[0]
    assert torch.allclose(half.max_val, qp.max_val * 0.5) and torch.allclose(half.scale, qp.scale * 0.5)
    nvfp4 = ob.preset("NVFP4A16")["weight"]
    with pytest.raises(ValueError, match="integer grid"):
        ob.awq.shrunk(qp, nvfp4, [0.5])
