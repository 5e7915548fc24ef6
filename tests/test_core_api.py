"""Hand-computed cases, the spec, granularity shapes, g_idx, attention states and bad input."""

import json
import math

import pytest
import torch

import observers as ob


def _qparams(name, x, spec, kind="weight", **kw):
    obs = ob.create(name, spec, kind=kind, **kw)
    obs.observe(x)
    return obs.qparams()


# ---------------------------------------------------------------- hand-computed cases


def test_int4_symmetric_by_hand():
    x = torch.tensor([[-1.5, 0.3, 3.0]])
    spec = ob.QuantSpec("int4")
    qp = _qparams("minmax", x, spec)
    assert qp.scale.item() == pytest.approx(3.0 / 7.5)
    assert ob.quantize(x, qp, spec).tolist() == [[-4, 1, 7]]
    torch.testing.assert_close(ob.fake_quantize(x, qp, spec), torch.tensor([[-1.6, 0.4, 2.8]]))


def test_uint4_asymmetric_by_hand_rounds_half_to_even():
    x = torch.tensor([[-1.0, 2.0, 0.5, 0.3]])
    spec = ob.QuantSpec("uint4", symmetric=False)
    qp = _qparams("minmax", x, spec)
    assert qp.scale.item() == pytest.approx(0.2)
    assert qp.zero_point.item() == 5
    # 0.5 / 0.2 = 2.5 -> 2 (half to even); 0.3 / 0.2 = 1.5 -> 2
    assert ob.quantize(x, qp, spec).tolist() == [[0, 15, 7, 7]]


def test_fp8_e4m3_grid_by_hand_and_against_torch_cast():
    values = torch.tensor([2.0**-9, 2.0**-10, 3 * 2.0**-10, 300.0, 440.0, 448.0, -0.0, 17.0])
    expected = torch.tensor([2.0**-9, 0.0, 2.0**-8, 288.0, 448.0, 448.0, -0.0, 16.0])
    got = ob.formats.round_to_float_grid(values, 4, 3, 448.0)
    assert got.tolist() == expected.tolist()
    assert math.copysign(1.0, got[6].item()) == -1.0
    x = torch.randn(10000) * 100
    torch_cast = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(ob.formats.round_to_float_grid(x, 4, 3, 448.0), torch_cast)


def test_fp8_e5m2_matches_torch_cast():
    x = torch.randn(10000) * 1000
    torch_cast = x.clamp(-57344, 57344).to(torch.float8_e5m2).float()
    assert torch.equal(ob.formats.round_to_float_grid(x, 5, 2, 57344.0), torch_cast)


def test_fp4_e2m1_grid_by_hand():
    values = torch.tensor([2.5, 5.0, 0.25, 0.75, 7.0, -3.4, 1.25, 1.75])
    # grid 0 .5 1 1.5 2 3 4 6; ties go to the even mantissa
    expected = [2.0, 4.0, 0.0, 1.0, 6.0, -3.0, 1.0, 2.0]
    assert ob.formats.round_to_float_grid(values, 2, 1, 6.0).tolist() == expected


def test_fp4_fake_quantize_with_scale():
    x = torch.tensor([[12.0, 5.0, -1.0, 0.6, 0.4]])
    spec = ob.QuantSpec("fp4_e2m1")
    qp = _qparams("minmax", x, spec)
    assert qp.scale.item() == 2.0
    assert ob.fake_quantize(x, qp, spec).tolist() == [[12.0, 4.0, -1.0, 1.0, 0.0]]


def test_fp6_formats_max_values():
    assert ob.formats.round_to_float_grid(torch.tensor([100.0, 27.0]), 3, 2, 28.0).tolist() == [28.0, 28.0]
    assert ob.formats.round_to_float_grid(torch.tensor([100.0, 7.3]), 2, 3, 7.5).tolist() == [7.5, 7.5]


def test_qmax_scale_rule():
    x = torch.tensor([[-2.0, 1.27]])
    qp = _qparams("minmax", x, ob.QuantSpec("int8", scale_rule="qmax"))
    assert qp.scale.item() == pytest.approx(2.0 / 127)


def test_zero_is_always_in_range():
    x = torch.tensor([[2.0, 3.0]])
    qp = _qparams("minmax", x, ob.QuantSpec("uint8", symmetric=False))
    assert qp.zero_point.item() == 0
    assert qp.scale.item() == pytest.approx(3.0 / 255)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int4", "fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("fill", [0.0, 5.0, -3.0])
def test_constant_tensor_gives_finite_positive_scale(dtype, fill):
    x = torch.full((4, 8), fill)
    for symmetric in [True, False] if dtype.startswith(("int", "uint")) else [True]:
        spec = ob.QuantSpec(dtype, symmetric=symmetric)
        qp = _qparams("minmax", x, spec)
        assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
        x_hat = ob.fake_quantize(x, qp, spec)
        assert torch.isfinite(x_hat).all()
        metrics = ob.error_metrics(x, x_hat, qp, spec)
        assert not any(isinstance(v, float) and math.isnan(v) for v in metrics.values())


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "kind,shape,spec_kw,qshape",
    [
        ("weight", (10, 300), {"strategy": "tensor"}, (1,)),
        ("weight", (10, 300), {"strategy": "channel"}, (10, 1)),
        ("weight", (10, 300), {"strategy": "channel", "ch_axis": 1}, (1, 300)),
        ("weight", (10, 300), {"strategy": "group", "group_size": 128}, (10, 3)),
        ("weight", (10, 300), {"strategy": "block", "block_size": (4, 128)}, (3, 3)),
        ("weight", (6, 3, 3, 3), {"strategy": "group", "group_size": 8}, (6, 4)),
        ("activation", (2, 7, 96), {"strategy": "tensor"}, (1,)),
        ("activation", (2, 7, 96), {"strategy": "token"}, (14, 1)),
        ("activation", (2, 7, 96), {"strategy": "group", "group_size": 40}, (3,)),
        ("activation", (2, 7, 96), {"strategy": "channel"}, (96,)),
        ("attention", (2, 4, 5, 8), {"strategy": "tensor"}, (1,)),
        ("attention", (2, 4, 5, 8), {"strategy": "channel"}, (4,)),
    ],
)
def test_qparam_shapes_and_round_trip(kind, shape, spec_kw, qshape):
    x = torch.randn(*shape)
    spec = ob.QuantSpec("int8", **spec_kw)
    qp = _qparams("minmax", x, spec, kind=kind)
    assert tuple(qp.scale.shape) == qshape
    assert tuple(qp.zero_point.shape) == qshape and tuple(qp.min_val.shape) == qshape
    x_hat = ob.fake_quantize(x, qp, spec)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert ob.error_metrics(x, x_hat, qp, spec)["sqnr_db"] > 30


def test_flatten_restore_is_identity_for_every_layout():
    x = torch.randn(10, 37)
    for spec in [
        ob.QuantSpec("int8", strategy="group", group_size=8),
        ob.QuantSpec("int8", strategy="block", block_size=(3, 5)),
        ob.QuantSpec("int8", strategy="channel", ch_axis=1),
    ]:
        flat = ob.flatten(x, spec, "weight")
        assert torch.equal(flat.restore(flat.data), x)


def test_ragged_padding_does_not_change_statistics():
    x = torch.arange(10.0).reshape(1, 10)
    qp = _qparams("minmax", x, ob.QuantSpec("int8", symmetric=False, strategy="group", group_size=4))
    assert qp.min_val.tolist() == [[0.0, 4.0, 8.0]]
    assert qp.max_val.tolist() == [[3.0, 7.0, 9.0]]


def test_half_precision_inputs_keep_dtype_and_fp32_stats():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(8, 64).to(dtype)
        spec = ob.QuantSpec("int8", strategy="group", group_size=32)
        qp = _qparams("minmax", x, spec)
        assert qp.scale.dtype == torch.float32
        assert ob.fake_quantize(x, qp, spec).dtype == dtype


# ---------------------------------------------------------------- observers over calls


def test_running_memoryless_and_moving_average_combine_differently():
    a, b = torch.tensor([[-1.0, 1.0]]), torch.tensor([[-3.0, 2.0]])
    spec = ob.QuantSpec("int8", symmetric=False)
    results = {}
    for name in ("minmax", "memoryless_minmax", "moving_average_minmax"):
        obs = ob.create(name, spec, kind="activation", **({"averaging_constant": 0.5} if "moving" in name else {}))
        obs.observe(a)
        obs.observe(b)
        qp = obs.qparams()
        results[name] = (qp.min_val.item(), qp.max_val.item())
    assert results == {"minmax": (-3.0, 2.0), "memoryless_minmax": (-3.0, 2.0), "moving_average_minmax": (-2.0, 1.5)}
    obs = ob.create("memoryless_minmax", spec, kind="activation")
    obs.observe(b)
    obs.observe(a)
    assert (obs.qparams().min_val.item(), obs.qparams().max_val.item()) == (-1.0, 1.0)


def test_token_counts_across_batches_and_shapes():
    obs = ob.create("minmax", ob.QuantSpec("int8"), kind="activation")
    obs.observe(torch.randn(2, 5, 16))
    obs.observe(torch.randn(3, 16))
    assert obs.num_observed_tokens == 13
    attn = ob.create("minmax", ob.QuantSpec("int8"), kind="attention")
    attn.observe(torch.randn(2, 4, 5, 8))
    assert attn.num_observed_tokens == 10
    results = ob.run_suite([torch.randn(4, 16), torch.randn(6, 16)], ob.QuantSpec("int8"), kind="activation")
    assert {r.num_observed_tokens for r in results if r.error is None} == {10}
    assert {r.num_observed_tokens for r in results if r.error is not None} <= {0}


def test_token_strategy_describes_last_batch():
    obs = ob.create("minmax", ob.QuantSpec("int8", strategy="token"), kind="activation")
    obs.observe(torch.full((3, 4), 100.0))
    last = torch.ones(5, 4)
    obs.observe(last)
    assert obs.qparams().scale.shape == (5, 1)
    assert torch.allclose(obs.qparams().max_val, torch.ones(5, 1))


# ---------------------------------------------------------------- g_idx (activation order)


def test_g_idx_permuted_groups_equal_positional_groups_of_permuted_tensor():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 12, generator=g)
    perm = torch.randperm(12, generator=g)
    g_idx = torch.empty(12, dtype=torch.long)
    g_idx[perm] = torch.arange(12) // 4
    spec = ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=4)
    obs = ob.create("minmax", spec)
    obs.observe(w, g_idx=g_idx)
    qp = obs.qparams()
    qp_pos = _qparams("minmax", w[:, perm], spec)
    assert torch.equal(qp.scale, qp_pos.scale) and torch.equal(qp.zero_point, qp_pos.zero_point)
    assert torch.equal(ob.fake_quantize(w, qp, spec)[:, perm], ob.fake_quantize(w[:, perm], qp_pos, spec))
    assert torch.equal(qp.extras["g_idx"], g_idx)


def test_g_idx_unequal_groups_match_naive_loop():
    w = torch.randn(5, 12)
    g_idx = torch.tensor([2, 0, 1, 1, 2, 2, 1, 1, 2, 2, 1, 2])
    spec = ob.QuantSpec("int8", strategy="group", group_size=4)
    obs = ob.create("minmax", spec)
    obs.observe(w, g_idx=g_idx)
    qp = obs.qparams()
    assert qp.scale.shape == (5, 3)
    for group in range(3):
        cols = w[:, g_idx == group]
        amax = torch.maximum(cols.amax(1).clamp(min=0), -cols.amin(1).clamp(max=0))
        torch.testing.assert_close(qp.scale[:, group], amax / 127.5)
    x_hat = ob.fake_quantize(w, qp, spec)
    for group in range(3):
        cols = w[:, g_idx == group]
        scale = qp.scale[:, group : group + 1]
        torch.testing.assert_close(x_hat[:, g_idx == group], torch.round(cols / scale).clamp(-128, 127) * scale)


def test_g_idx_with_minus_one_means_positional():
    w = torch.randn(4, 8)
    spec = ob.QuantSpec("int8", strategy="group", group_size=4)
    obs = ob.create("minmax", spec)
    obs.observe(w, g_idx=torch.full((8,), -1))
    assert torch.equal(obs.qparams().scale, _qparams("minmax", w, spec).scale)
    assert "g_idx" not in obs.qparams().extras


def test_activation_order_g_idx_groups_by_importance():
    inputs = torch.randn(100, 8) * torch.tensor([1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0])
    g_idx = ob.activation_order_g_idx(ob.column_importance(inputs), 4)
    assert g_idx.tolist() == [1, 0, 1, 0, 1, 0, 1, 0]


# ---------------------------------------------------------------- attention states


def test_attention_per_head_matches_naive_loop():
    x = torch.randn(2, 4, 5, 8) * torch.arange(1, 5).reshape(1, 4, 1, 1)
    spec = ob.QuantSpec("fp8_e4m3", strategy="channel")
    qp = _qparams("minmax", x, spec, kind="attention")
    for head in range(4):
        torch.testing.assert_close(qp.scale[head], x[:, head].abs().max() / 448.0)


# ---------------------------------------------------------------- spec and serialization


def test_spec_round_trip_and_validation_messages():
    spec = ob.QuantSpec("int4", symmetric=False, strategy="block", block_size=(64, 128), reduce_range=True)
    assert ob.QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="dtype 'int5'.*allowed"):
        ob.QuantSpec("int5")
    with pytest.raises(ValueError, match="strategy='row'"):
        ob.QuantSpec("int8", strategy="row")
    with pytest.raises(ValueError, match="group_size"):
        ob.QuantSpec("int8", strategy="group", group_size=0)
    with pytest.raises(ValueError, match="group_size"):
        ob.QuantSpec("int8", strategy="group")
    with pytest.raises(ValueError, match="quant_min"):
        ob.QuantSpec("int8", quant_min=10, quant_max=5)
    with pytest.raises(ValueError, match="unknown QuantSpec field"):
        ob.QuantSpec.from_dict({"dtype": "int8", "bits": 4})


def test_qparams_json_round_trip_is_bit_exact():
    x = torch.randn(16, 100)
    qp = _qparams("minmax", x, ob.QuantSpec("uint8", symmetric=False, strategy="group", group_size=32))
    back = ob.QParams.from_dict(json.loads(json.dumps(qp.to_dict())))
    for field in ("scale", "zero_point", "min_val", "max_val"):
        assert torch.equal(getattr(back, field), getattr(qp, field))
        assert getattr(back, field).dtype == getattr(qp, field).dtype


# ---------------------------------------------------------------- bad input


def test_nan_and_inf_are_counted_or_ignored():
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    x[1, 1] = float("inf")
    obs = ob.create("minmax", ob.QuantSpec("int8"))
    with pytest.raises(ValueError, match="2 non-finite"):
        obs.observe(x)
    obs = ob.create("minmax", ob.QuantSpec("int8"), ignore_nonfinite=True)
    obs.observe(x)
    finite = x[torch.isfinite(x)]
    assert obs.qparams().scale.item() == pytest.approx(float(finite.abs().max()) / 127.5)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: ob.create("minmax", ob.QuantSpec("int8")).observe(torch.empty(0, 4)), "empty"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8")).observe(torch.tensor(1.0)), "0-d"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8")).observe([1.0, 2.0]), "torch.Tensor"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8")).observe(torch.ones(3, 4, dtype=torch.int32)), "floating"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8", strategy="token"), kind="weight"), "token.*weight"),
        (
            lambda: ob.create("minmax", ob.QuantSpec("int8", strategy="block", block_size=(2, 2)), kind="activation"),
            "block.*activation",
        ),
        (lambda: ob.create("nope", ob.QuantSpec("int8")), "unknown observer"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8"), bins=3), "unknown knob"),
        (lambda: ob.create("moving_average_minmax", ob.QuantSpec("int8"), averaging_constant=0), "averaging_constant"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8")).qparams(), "observed nothing"),
        (lambda: ob.create("minmax", ob.QuantSpec("int8"), kind="bias"), "kind='bias'"),
    ],
)
def test_bad_input_gives_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_shape_change_between_calls_is_an_error():
    obs = ob.create("minmax", ob.QuantSpec("int8", strategy="channel"))
    obs.observe(torch.randn(4, 8))
    with pytest.raises(ValueError, match="shape changed"):
        obs.observe(torch.randn(5, 8))
    act = ob.create("minmax", ob.QuantSpec("int8"), kind="activation")
    act.observe(torch.randn(3, 8))
    with pytest.raises(ValueError, match="shape changed"):
        act.observe(torch.randn(3, 9))


def test_fake_quantize_rejects_qparams_of_another_shape():
    spec = ob.QuantSpec("int8", strategy="channel")
    qp = _qparams("minmax", torch.randn(4, 8), spec)
    with pytest.raises(ValueError, match="do not fit"):
        ob.fake_quantize(torch.randn(5, 8), qp, spec)


def test_suite_reports_inapplicable_observer_instead_of_crashing():
    results = ob.run_suite(torch.randn(4, 8), ob.QuantSpec("int8"), names=["minmax", "nope"])
    assert results[0].error is None and results[1].error.startswith("unknown observer")
    frame = ob.results_frame(results)
    assert list(frame["observer"]) == ["minmax", "nope"]
    assert set(ob.METRIC_KEYS) <= set(frame.columns)


def test_available_and_knobs_are_discoverable():
    names = ob.available()
    assert {"minmax", "memoryless_minmax", "moving_average_minmax"} <= set(names)
    assert all(isinstance(d, str) and d for d in names.values())
    assert ob.knobs("moving_average_minmax") == {"ignore_nonfinite": False, "averaging_constant": 0.01}
    assert "averaging_constant" in ob.describe("moving_average_minmax")


def test_metrics_edge_cases_are_defined():
    zeros = torch.zeros(3)
    assert ob.compare_tensors(zeros, zeros) == {"mse": 0.0, "sqnr_db": math.inf, "cosine": 1.0, "max_abs_error": 0.0}
    x = torch.tensor([3.0, 4.0])
    m = ob.compare_tensors(x, torch.tensor([3.0, 3.0]))
    assert m["sqnr_db"] == pytest.approx(20 * math.log10(5.0 / 1.0))
    assert m["mse"] == pytest.approx(0.5) and m["max_abs_error"] == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", ["int3", "int8"])
def test_the_range_end_of_half_range_scales_is_not_clipped(dtype):
    """With scale = amax / ((qmax - qmin) / 2), +amax sits exactly half a step past qmax: its error
    is rounding, not saturation; one step further out is clipped."""
    spec = ob.QuantSpec(dtype, strategy="channel")
    w = torch.randn(64, 96) * torch.logspace(-3, 3, 64).unsqueeze(1)
    obs = ob.create("memoryless_minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    assert ob.error_metrics(w, ob.fake_quantize(w, qp, spec), qp, spec)["clip_ratio"] == 0.0
    beyond = w.clone()
    beyond[:, 0] = (spec.int_range[1] + 1.5) * qp.scale[:, 0]
    clip = ob.error_metrics(beyond, ob.fake_quantize(beyond, qp, spec), qp, spec)["clip_ratio"]
    assert clip == pytest.approx(64 / w.numel())


@pytest.mark.parametrize("name", ["minmax", "memoryless_minmax", "moving_average_minmax"])
@pytest.mark.parametrize("strategy", ["tensor", "group", "channel"])
def test_single_nan_is_detected_at_every_granularity(name, strategy):
    x = torch.randn(4, 256)
    x[2, 100] = float("nan")
    spec = ob.QuantSpec("int8", strategy=strategy, group_size=128)
    obs = ob.create(name, spec)
    obs.observe(torch.randn(4, 256))
    with pytest.raises(ValueError, match="1 non-finite"):
        obs.observe(x)
    before = obs.qparams().scale.clone()
    assert torch.isfinite(before).all()


def test_exact_divisor_divides_as_the_cpu_on_every_device():
    """Scale rules divide by numbers like 448 or 127.5: on the CPU the number itself (torch divides
    exactly), elsewhere a 0-dim tensor on the data's device, since CUDA multiplies a tensor by the
    reciprocal of a Python number (one ulp off in about half the scales; tests/test_cuda.py checks
    the scales of both devices against each other)."""
    from observers.qparams import exact_divisor

    cpu = torch.rand(1000) * 10
    assert exact_divisor(448.0, cpu) == 448.0
    torch.testing.assert_close(cpu / exact_divisor(448.0, cpu), cpu.double().div(448.0).float(), rtol=0, atol=0)
    meta = torch.empty(4, device="meta", dtype=torch.float32)
    divisor = exact_divisor(127.5, meta)
    assert isinstance(divisor, torch.Tensor) and divisor.device == meta.device and divisor.ndim == 0
    assert divisor.dtype == torch.float32
