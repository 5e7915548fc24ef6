"""``observers.smoothed_quant_kernel``: AWQ's candidates' effective weights ``Q(W·s)/s`` in one native
pass, bit for bit the eager arithmetic (the float64 product cast, fake-quantization, the float64
quotient cast) in every variant this CPU runs, and None wherever the eager path must run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from lab.awq import candidates
from observers import kernels
from observers.smoothed_quant_kernel import group_of, smoothed_fake_quantize

pytestmark = pytest.mark.skipif(
    not kernels.available_isas("smoothed_quant"), reason=kernels.status("smoothed_quant")
)


def _case(rows: int, columns: int, n: int, spec: ob.QuantSpec, seed: int, ties: bool = False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * 0.02
    weight[:: max(1, rows // 4)] *= 40  # heavy rows, wide ranges
    scales = torch.rand(n, columns, generator=generator, dtype=torch.float64) * 3 + 0.2
    smooth = candidates.smoothed(weight, scales)
    qps = []
    for i in range(n):
        observer = ob.create("memoryless_minmax", spec, "weight")
        observer.observe(smooth[i])
        qps.append(observer.qparams())
    joined = candidates._joined(qps)
    if ties:  # weights on exact half steps, where rounding must go to even as torch's does
        per_row = joined.effective_scale.reshape(n, rows, -1)[0]
        step = per_row.repeat_interleave(columns // per_row.shape[1], 1)
        weight = ((torch.randint(-6, 6, (rows, columns), generator=generator) + 0.5) * step).float()
        scales = torch.ones(n, columns, dtype=torch.float64)
        smooth = candidates.smoothed(weight, scales)
    eager = candidates.effective(ob.fake_quantize(smooth.flatten(0, 1), joined, spec).reshape(smooth.shape), scales)
    return weight, scales, joined, eager


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 4),
    group=st.sampled_from([16, 32, 128]),
    n=st.integers(1, 4),
    symmetric=st.booleans(),
    dtype=st.sampled_from(["int4", "int8"]),
    channel=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_every_variant_gives_the_eager_effective_weights_bit_for_bit(
    rows, groups, group, n, symmetric, dtype, channel, seed
):
    columns = groups * group
    spec = (
        ob.QuantSpec(dtype=dtype, strategy="channel", symmetric=symmetric)
        if channel
        else ob.QuantSpec(dtype=dtype, strategy="group", group_size=group, symmetric=symmetric)
    )
    weight, scales, joined, eager = _case(rows, columns, n, spec, seed)
    for isa in kernels.available_isas("smoothed_quant"):
        mine = smoothed_fake_quantize(weight, scales, joined, spec, isa)
        assert mine is not None and torch.equal(mine, eager), isa


def test_half_steps_round_to_even_as_torch_does():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    weight, scales, joined, eager = _case(8, 64, 1, spec, seed=3, ties=True)
    for isa in kernels.available_isas("smoothed_quant"):
        assert torch.equal(smoothed_fake_quantize(weight, scales, joined, spec, isa), eager)


def test_the_eager_path_runs_where_the_kernel_does_not_read_the_data():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    weight, scales, joined, _ = _case(8, 64, 2, spec, seed=1)
    assert smoothed_fake_quantize(weight, scales, joined, spec) is not None
    assert smoothed_fake_quantize(weight.double(), scales, joined, spec) is None  # not fp32
    assert smoothed_fake_quantize(weight, scales.float(), joined, spec) is None  # scales not float64
    assert group_of(ob.QuantSpec(dtype="int4", strategy="group", group_size=8, symmetric=True), 64) is None
    assert group_of(ob.QuantSpec(dtype="fp4_e2m1", strategy="group", group_size=16), 64) is None  # a float grid
    assert group_of(ob.QuantSpec(dtype="int8", strategy="tensor", symmetric=True), 64) is None
    with kernels.disabled():
        assert smoothed_fake_quantize(weight, scales, joined, spec) is None


def test_candidates_made_with_the_kernel_are_the_eager_ones():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    generator = torch.Generator().manual_seed(5)
    weights = {"a": torch.randn(48, 64, generator=generator), "b": torch.randn(32, 64, generator=generator)}
    scales = torch.rand(6, 64, generator=generator, dtype=torch.float64) + 0.5
    moment = __import__("lab.awq.moment", fromlist=["InputMoment"]).InputMoment.of(torch.randn(200, 64))
    native = candidates.make(weights, scales, "mse_grid", spec, {}, moment)
    with kernels.disabled():
        eager = candidates.make(weights, scales, "mse_grid", spec, {}, moment)
    for mine, theirs in zip(native, eager, strict=True):
        assert all(torch.equal(mine.effective[name], theirs.effective[name]) for name in weights)
