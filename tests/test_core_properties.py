"""Hypothesis properties of the core: scales, rounding error, idempotence, vectorized == loop."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob

INT_DTYPES = ["int2", "int3", "int4", "int8", "uint4", "uint8"]
FLOAT_DTYPES = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1"]
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def weights(draw):
    rows = draw(st.integers(1, 9))
    cols = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
    offset = draw(st.sampled_from([0.0, 0.5, -3.0]))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) + offset) * magnitude


@st.composite
def int_specs(draw):
    dtype = draw(st.sampled_from(INT_DTYPES))
    symmetric = draw(st.booleans())
    strategy = draw(st.sampled_from(["tensor", "channel", "group", "block"]))
    return ob.QuantSpec(
        dtype,
        symmetric=symmetric,
        strategy=strategy,
        group_size=draw(st.integers(1, 16)) if strategy == "group" else None,
        block_size=(draw(st.integers(1, 5)), draw(st.integers(1, 16))) if strategy == "block" else None,
    )


@given(weights(), int_specs(), st.sampled_from(["minmax", "memoryless_minmax", "moving_average_minmax"]))
@SETTINGS
def test_scales_finite_positive_and_zero_points_in_range(w, spec, name):
    obs = ob.create(name, spec)
    obs.observe(w)
    qp = obs.qparams()
    qmin, qmax = spec.int_range
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
    assert ((qp.zero_point >= qmin) & (qp.zero_point <= qmax)).all()


@given(weights(), int_specs())
@SETTINGS
def test_in_range_elements_within_half_a_step(w, spec):
    obs = ob.create("minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    w_hat = ob.fake_quantize(w, qp, spec)
    flat, flat_hat = ob.flatten(w, spec, "weight"), ob.flatten(w_hat, spec, "weight")
    scale = flat.broadcast(qp.scale)
    qmin, qmax = spec.int_range
    zero_point = flat.broadcast(qp.zero_point)
    low, high = (qmin - zero_point) * scale, (qmax - zero_point) * scale
    inside = (flat.data >= low) & (flat.data <= high)
    error = (flat_hat.data - flat.data).abs()
    assert (error[inside.expand_as(error)] <= (scale / 2 * (1 + 1e-5)).expand_as(error)[inside]).all()


@given(weights(), int_specs())
@SETTINGS
def test_fake_quantize_is_idempotent(w, spec):
    obs = ob.create("minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    once = ob.fake_quantize(w, qp, spec)
    assert torch.allclose(ob.fake_quantize(once, qp, spec), once, rtol=1e-6, atol=0)


@given(weights(), st.sampled_from(FLOAT_DTYPES), st.sampled_from(["tensor", "channel", "group"]))
@SETTINGS
def test_float_formats_idempotent_and_finite(w, dtype, strategy):
    spec = ob.QuantSpec(dtype, strategy=strategy, group_size=8 if strategy == "group" else None)
    obs = ob.create("minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    once = ob.fake_quantize(w, qp, spec)
    assert torch.isfinite(once).all()
    assert torch.equal(ob.fake_quantize(once, qp, spec), once)
    assert ob.error_metrics(w, once, qp, spec)["clip_ratio"] == 0.0


@given(weights(), st.integers(1, 16), st.booleans())
@SETTINGS
def test_vectorized_group_equals_naive_loop(w, group_size, symmetric):
    spec = ob.QuantSpec("int4", symmetric=symmetric, strategy="group", group_size=group_size)
    obs = ob.create("minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    w_hat = ob.fake_quantize(w, qp, spec)
    tensor_spec = ob.QuantSpec("int4", symmetric=symmetric)
    for g, start in enumerate(range(0, w.shape[1], group_size)):
        for row in range(w.shape[0]):
            piece = w[row : row + 1, start : start + group_size]
            loop_obs = ob.create("minmax", tensor_spec)
            loop_obs.observe(piece)
            loop_qp = loop_obs.qparams()
            assert qp.scale[row, g].item() == loop_qp.scale.item()
            assert qp.zero_point[row, g].item() == loop_qp.zero_point.item()
            assert torch.equal(
                w_hat[row : row + 1, start : start + group_size], ob.fake_quantize(piece, loop_qp, tensor_spec)
            )


@given(weights(), st.integers(1, 5), st.integers(1, 16))
@SETTINGS
def test_vectorized_block_equals_naive_loop(w, block_rows, block_cols):
    spec = ob.QuantSpec("int8", strategy="block", block_size=(block_rows, block_cols))
    obs = ob.create("minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    w_hat = ob.fake_quantize(w, qp, spec)
    tensor_spec = ob.QuantSpec("int8")
    for bi, r in enumerate(range(0, w.shape[0], block_rows)):
        for bj, c in enumerate(range(0, w.shape[1], block_cols)):
            piece = w[r : r + block_rows, c : c + block_cols]
            loop_obs = ob.create("minmax", tensor_spec)
            loop_obs.observe(piece)
            loop_qp = loop_obs.qparams()
            assert qp.scale[bi, bj].item() == loop_qp.scale.item()
            assert torch.equal(
                w_hat[r : r + block_rows, c : c + block_cols], ob.fake_quantize(piece, loop_qp, tensor_spec)
            )


@given(st.integers(1, 6), st.integers(1, 6), st.integers(2, 24), st.integers(1, 8))
@SETTINGS
def test_activation_group_equals_naive_loop(batch, tokens, hidden, group_size):
    x = torch.randn(batch, tokens, hidden)
    spec = ob.QuantSpec("int8", strategy="group", group_size=group_size)
    obs = ob.create("minmax", spec, kind="activation")
    obs.observe(x)
    qp = obs.qparams()
    flat2 = x.reshape(-1, hidden)
    for g, start in enumerate(range(0, hidden, group_size)):
        amax = flat2[:, start : start + group_size].abs().max()
        assert torch.isclose(qp.scale[g], amax / 127.5, rtol=1e-6)
