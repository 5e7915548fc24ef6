"""Issue 18, part 1: the observers and conventions of llm-compressor 0.14, ModelOpt 0.47, AIMET and
Quark 0.13 that Observer Lab lacked, each against a slow loop written from the rule (these run
everywhere) and, where the reference package is installed, against the reference itself."""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers.blocks import quark_bfp_exponent, shared_exponent
from observers.lwp_search import parse_percentiles
from observers.modelopt_search import fp8_scale_candidates, local_hessian, multiplier_candidates
from observers.sqnr_search import sqnr_candidates

E4M3_MAX = 448.0


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_lc = pytest.mark.skipif(not _installed("llmcompressor"), reason="reference package not installed")
needs_modelopt = pytest.mark.skipif(not _installed("modelopt"), reason="reference package not installed")
needs_quark = pytest.mark.skipif(not _installed("quark"), reason="reference package not installed")
needs_ct = pytest.mark.skipif(not _installed("compressed_tensors"), reason="reference package not installed")


def _weight(rows: int = 24, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).add(0.1)


def _inputs(cols: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 20, cols, generator=g) * torch.rand(cols, generator=g).add(0.05)


def _qparams(name: str, x: torch.Tensor, spec: ob.QuantSpec, kind: str = "weight", inputs=None, **knobs):
    obs = ob.create(name, spec, kind=kind, **knobs)
    if inputs is not None:
        obs.observe_inputs(inputs)
    obs.observe(x)
    return obs.qparams()


# ------------------------------------------------------------------ aliases


def test_aliases_resolve_without_duplicate_rows():
    assert ob.aliases() == {
        "fouroversix": "nvfp4_expanded_mse",
        "static_minmax": "minmax",
        "memoryless_mse": "mse_grid",
    }
    assert not set(ob.aliases()) & set(ob.available())
    assert ob.observer_class("static_minmax") is ob.observer_class("minmax")
    assert ob.knobs("fouroversix") == ob.knobs("nvfp4_expanded_mse")
    obs = ob.create("fouroversix", ob.QuantSpec("nvfp4"))
    assert obs.name == "nvfp4_expanded_mse"
    w = _weight()
    spec = ob.QuantSpec("int8", strategy="channel")
    assert torch.equal(_qparams("static_minmax", w, spec).scale, _qparams("minmax", w, spec).scale)
    results = ob.run_suite(w, spec, names=["static_minmax"])
    assert results[0].error is None


def test_alias_registration_refuses_taken_or_unknown_names():
    with pytest.raises(ValueError, match="already taken"):
        ob.base.register_alias("minmax", "mse_grid")
    with pytest.raises(ValueError, match="not a registered observer"):
        ob.base.register_alias("my_alias", "no_such_observer")
    with pytest.raises(ValueError, match="unknown observer"):
        ob.create("no_such_observer", ob.QuantSpec("int8"))


# ------------------------------------------------------------------ llm-compressor 0.14


def _lc_grid_loop(x, spec, factors, norm, patience, expand, weight=None, search_spec=None):
    """llm-compressor's grid search written as its sequential loop (fp32 errors, first best kept)."""
    search_spec = search_spec or spec
    flat = ob.flatten(x, spec, "weight")
    low = flat.data.amin(dim=(0, -1)) * expand
    high = flat.data.amax(dim=(0, -1)) * expand
    best = torch.full_like(low, torch.finfo(torch.float32).max)
    best_low, best_high = low.clone(), high.clone()
    stale = 0
    for p in factors:
        qp = ob.calculate_qparams(low * p, high * p, search_spec)
        x_hat = ob.fake_quantize(x, qp, search_spec)
        err = (ob.flatten(x_hat, spec, "weight").data - flat.data).abs().pow(norm)
        if weight is not None:
            err = err * weight
        err = err.sum(dim=(0, -1))
        improved = err < best
        if improved.any():
            best = torch.where(improved, err, best)
            best_low = torch.where(improved, low * p, best_low)
            best_high = torch.where(improved, high * p, best_high)
            stale = 0
        else:
            stale += 1
            if patience and stale >= patience:
                break
    return best_low, best_high


def test_every_declared_once_twin_exists_and_takes_the_knobs_passed_on():
    twins = {name: ob.observer_class(name) for name in ob.available() if ob.observer_class(name).once_as}
    assert set(twins) >= {"minmax", "moving_average_minmax", "mse_grid_moving_average"}
    for name, cls in twins.items():
        twin = ob.observer_class(cls.once_as)
        assert twin.once_as is None and set(cls.combining_knobs) <= set(cls.knob_specs())
        assert set(cls.knob_specs()) - set(cls.combining_knobs) == set(twin.knob_specs()), name
    assert ob.once_form("imatrix_mse", {"grid": 50}) == ("imatrix_mse", {"grid": 50})
    assert ob.once_form("static_minmax", {}) == ("memoryless_minmax", {})  # an alias resolves


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    symmetric=st.booleans(),
    strategy=st.sampled_from(["group", "channel", "tensor"]),
    constant=st.floats(0.01, 1.0),
    grid=st.sampled_from([20, 100]),
)
def test_an_observer_observed_once_gives_its_once_twins_qparams(seed, symmetric, strategy, constant, grid):
    # one observe never runs the combining rule: the running/moving-average observers' qparams are
    # their twins' with the knobs once_form passes on, to the bit
    torch.manual_seed(seed)
    spec = ob.QuantSpec(dtype="int4", strategy=strategy, group_size=16, symmetric=symmetric)
    weight = torch.randn(24, 64) * torch.rand(24, 1) * 4
    for name, knobs in (
        ("minmax", {}),
        ("moving_average_minmax", {"averaging_constant": constant}),
        ("mse_grid_moving_average", {"averaging_constant": constant, "grid": grid}),
    ):
        twin, passed = ob.once_form(name, knobs)
        assert "averaging_constant" not in passed and twin != name
        found = [ob.create(n, spec, "weight", **k) for n, k in ((name, knobs), (twin, passed))]
        for observer in found:
            observer.observe(weight)
        ours, theirs = (observer.qparams() for observer in found)
        assert torch.equal(ours.scale, theirs.scale) and torch.equal(ours.zero_point, theirs.zero_point)
        assert torch.equal(ours.min_val, theirs.min_val) and torch.equal(ours.max_val, theirs.max_val)


def test_imatrix_mse_has_llm_compressor_014_defaults():
    knobs = ob.knobs("imatrix_mse")
    assert (knobs["maxshrink"], knobs["grid"], knobs["patience"], knobs["norm"]) == (0.95, 20.0, 5, 3.0)
    assert "0.14" in ob.available()["imatrix_mse"]


@pytest.mark.parametrize(
    "spec",
    [
        ob.QuantSpec("int4", strategy="group", group_size=16),
        ob.QuantSpec("int4", symmetric=False, strategy="channel"),
    ],
)
def test_imatrix_mse_equals_the_weighted_loop(spec):
    w, x = _weight(), _inputs()
    importance = x.reshape(-1, 64).square().mean(dim=0)
    qp = _qparams("imatrix_mse", w, spec, importance=importance)
    weight = ob.flatten((importance / importance.mean()).expand(24, 64), spec, "weight").data
    factors = [1 - i / 20 for i in range(max(1, int(0.95 * 20)) + 1)]
    assert len(factors) == 20
    low, high = _lc_grid_loop(w, spec, factors, norm=3.0, patience=5, expand=1.0, weight=weight)
    assert torch.equal(qp.min_val, low) and torch.equal(qp.max_val, high)


def test_imatrix_mse_collects_importance_itself():
    w, x = _weight(), _inputs()
    spec = ob.QuantSpec("int4", strategy="group", group_size=16)
    collected = ob.create("imatrix_mse", spec)
    for batch in x:
        collected.observe_inputs(batch)
    collected.observe(w)
    given = _qparams("imatrix_mse", w, spec, importance=ob.column_importance(x) * 7.0)
    assert torch.equal(collected.qparams().scale, given.scale)
    with pytest.raises(ValueError, match="non-empty floating-point"):
        collected.observe_inputs(torch.zeros(0, 64))
    with pytest.raises(ValueError, match="columns"):
        collected.observe_inputs(torch.ones(2, 32))


def test_imatrix_mse_without_importance_warns_and_runs_unweighted():
    w = _weight()
    spec = ob.QuantSpec("int4", strategy="channel")
    with pytest.warns(UserWarning, match="no importance"):
        plain = _qparams("imatrix_mse", w, spec)
    with pytest.warns(UserWarning):
        zero = _qparams("imatrix_mse", w, spec, importance=torch.zeros(64))
    factors = [1 - i / 20 for i in range(20)]
    low, high = _lc_grid_loop(w, spec, factors, norm=3.0, patience=5, expand=1.0)
    assert torch.equal(plain.max_val, high) and torch.equal(zero.max_val, high)


def test_imatrix_patience_zero_never_stops():
    w = _weight()
    spec = ob.QuantSpec("int4", strategy="channel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp = _qparams("imatrix_mse", w, spec, patience=0, maxshrink=0.5, grid=10)
    factors = [1 - i / 10 for i in range(6)]
    low, high = _lc_grid_loop(w, spec, factors, norm=3.0, patience=0, expand=1.0)
    assert torch.equal(qp.max_val, high)


def test_nvfp4_expanded_mse_defaults_and_loop():
    knobs = ob.knobs("nvfp4_expanded_mse")
    assert knobs["expand"] == 1.8 and knobs["grid"] == 200 and knobs["patience"] == 1000 and knobs["norm"] == 2.4
    assert knobs["maxshrink"] == pytest.approx(1 - 0.8 / 1.8)
    w = _weight(16, 64)
    spec = ob.QuantSpec("nvfp4")
    qp = _qparams("nvfp4_expanded_mse", w, spec)
    factors = [1 - i / 200 for i in range(int((1 - 0.8 / 1.8) * 200))]
    assert len(factors) == 111 and factors[-1] * 1.8 == pytest.approx(0.81)
    free = ob.QuantSpec("fp4_e2m1", strategy="group", group_size=16)
    low, high = _lc_grid_loop(w, spec, factors, norm=2.4, patience=1000, expand=1.8, search_spec=free)
    assert torch.equal(qp.max_val, high)
    reference = ob.calculate_qparams(low, high, spec)
    assert torch.equal(qp.scale, reference.scale) and torch.equal(qp.global_scale, reference.global_scale)
    assert torch.equal(_qparams("fouroversix", w, spec).scale, qp.scale)


def test_llm_compressor_search_keeps_the_first_of_two_equal_errors():
    """Scales 2 and 1 put this block on the same FP4 values (0.2 rounds to 0 under both): the
    errors are equal and, as in llm-compressor, the first candidate must win."""
    from observers.lc_search import lc_grid_search

    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 6.0, 0.2] + [0.0] * 10])
    spec = ob.QuantSpec("fp4_e2m1", strategy="group", group_size=16)
    flat = ob.flatten(x, spec, "weight")
    for norm in (2.0, 2.4, 3.0):
        low, high = lc_grid_search(flat, spec, [2.0, 1.0], norm, patience=5, expand=1.0, max_working_bytes=1 << 20)
        assert float(high) == 12.0, norm


def test_nvfp4_expanded_mse_can_pick_a_range_wider_than_the_data():
    qp = _qparams("nvfp4_expanded_mse", _weight(32, 64), ob.QuantSpec("nvfp4"))
    amax = _weight(32, 64).abs().reshape(32, 4, 16).amax(-1)
    assert bool((qp.max_val > amax * 1.01).any())


def test_nvfp4_expanded_imatrix_defaults_and_loop():
    knobs = ob.knobs("nvfp4_expanded_imatrix")
    assert (knobs["expand"], knobs["grid"], knobs["patience"], knobs["norm"]) == (1.8, 200.0, 1000, 2.4)
    w, x = _weight(16, 64), _inputs()
    spec = ob.QuantSpec("nvfp4")
    qp = _qparams("nvfp4_expanded_imatrix", w, spec, inputs=x)
    importance = x.reshape(-1, 64).float().pow(2).sum(0) / 60
    weight = ob.flatten((importance / importance.mean()).expand(16, 64), spec, "weight").data
    factors = [1 - i / 200 for i in range(int((1 - 0.8 / 1.8) * 200) + 1)]
    free = ob.QuantSpec("fp4_e2m1", strategy="group", group_size=16)
    _, high = _lc_grid_loop(w, spec, factors, 2.4, 1000, 1.8, weight=weight, search_spec=free)
    assert torch.equal(qp.max_val, high)


def _lc(name: str, w: torch.Tensor, args: dict, inputs: torch.Tensor | None = None):
    import llmcompressor.observers as lc
    from compressed_tensors.quantization import QuantizationArgs

    obs = lc.Observer.load_from_registry(name, base_name="weight", args=QuantizationArgs(**args))
    if inputs is not None:
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        obs.attach(layer)
        layer(inputs)
        obs.detach(layer)
    obs(w)
    return obs.get_qparams()


NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}


@needs_lc
@pytest.mark.parametrize(
    ("name", "args", "spec", "with_inputs"),
    [
        ("imatrix_mse", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}, ("int4", 16), True),
        ("nvfp4_expanded_imatrix", NVFP4_ARGS, ("nvfp4", 16), True),
        ("nvfp4_expanded_mse", NVFP4_ARGS, ("nvfp4", 16), False),
        ("fouroversix", NVFP4_ARGS, ("nvfp4", 16), False),
        ("static_minmax", {"num_bits": 8, "type": "int", "strategy": "channel"}, ("int8", None), False),
    ],
)
def test_llm_compressor_parity(name, args, spec, with_inputs):
    args = dict(args)
    if args["strategy"] == "tensor_group":
        args["scale_dtype"] = torch.float8_e4m3fn
    dtype, group = spec
    ours_spec = ob.QuantSpec(dtype, strategy="group" if group else "channel", group_size=group)
    w, x = _weight(32, 128), _inputs(128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _lc(name, w, args, x if with_inputs else None)
        ours = _qparams(name, w, ours_spec, inputs=x if with_inputs else None)
    assert torch.equal(theirs["scale"].float().reshape(ours.scale.shape), ours.scale)
    if theirs.get("global_scale") is not None:
        assert torch.equal(theirs["global_scale"].float().reshape(1), ours.global_scale)


# ------------------------------------------------------------------ MX compressed-tensors rounding, BFP16 -128


def _ct_exponent(amax: float, emax: int) -> int:
    """compressed-tensors' rule by hand: amax rounded half-up at one mantissa bit, then floor(log2) - emax."""
    mantissa, exponent = math.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - 1 + (1 if mantissa >= 0.875 else 0) - emax


@pytest.mark.parametrize("amax", [1.0, 1.5, 1.74, 1.75, 1.8, 1.9375, 1.99, 3.0, 0.11, 448.0, 449.0, 6.0, 7.0])
@pytest.mark.parametrize("dtype", ["mxfp4", "mxfp8_e4m3", "mxfp6_e2m3"])
def test_mx_compressed_tensors_rounding_by_hand(amax, dtype):
    fmt = ob.get_format(dtype)
    got = shared_exponent(torch.tensor([amax]), fmt, "compressed-tensors")
    assert int(got) == _ct_exponent(amax, fmt.emax)


def test_mx_compressed_tensors_rule_differs_from_even_only_for_wider_mantissas():
    amax = torch.tensor([1.75, 1.8, 1.9, 1.95]) * 4
    fp8 = ob.get_format("mxfp8_e4m3")
    assert shared_exponent(amax, fp8, "compressed-tensors").tolist() == [-5, -5, -5, -5]
    assert shared_exponent(amax, fp8, "even").tolist() == [-6, -6, -6, -5]
    fp4 = ob.get_format("mxfp4")
    assert torch.equal(shared_exponent(amax, fp4, "compressed-tensors"), shared_exponent(amax, fp4, "even"))
    spec = ob.QuantSpec("mxfp8_e4m3", scale_rounding="compressed-tensors")
    assert spec.to_dict()["scale_rounding"] == "compressed-tensors"


@needs_ct
@pytest.mark.parametrize(("dtype", "bits"), [("mxfp4", 4), ("mxfp8_e4m3", 8)])
def test_mx_compressed_tensors_parity(dtype, bits):
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    w = _weight(32, 256) * 3
    codes = _qparams("memoryless_minmax", w, ob.QuantSpec(dtype, scale_rounding="compressed-tensors"))
    theirs = generate_mx_scales(w.abs().reshape(32, -1, 32).amax(-1), bits).clamp(0, 255)
    assert torch.equal(codes.extras["scale_exponent"].float(), theirs)


def test_bfp16_quark_keeps_minus_128_and_bumps_only_on_positive_overflow():
    assert ob.get_format("bfp16_quark").int_range() == (-128, 127)
    assert ob.get_format("bfp16").int_range() == (-127, 127)
    w = torch.zeros(3, 8)
    w[0, :3] = torch.tensor([-127.5 / 64, 0.5, 0.25])  # rounds to -128 at exponent 0
    w[1, :3] = torch.tensor([127.5 / 64, 0.5, 0.25])  # rounds to +128: exponent 1
    w[2, :3] = torch.tensor([-1.0, 1.0, 0.5])
    quark = _qparams("minmax", w, ob.QuantSpec("bfp16_quark"))
    ours = _qparams("minmax", w, ob.QuantSpec("bfp16"))
    assert (quark.extras["scale_exponent"].flatten().int() - 127).tolist() == [0, 1, 0]
    assert (ours.extras["scale_exponent"].flatten().int() - 127).tolist() == [1, 1, 0]
    codes = ob.quantize(w, quark, ob.QuantSpec("bfp16_quark"))
    assert int(codes[0, 0]) == -128 and int(codes[1, 0]) == 64
    lo, hi = ob.representable_range(quark, ob.QuantSpec("bfp16_quark"))
    assert float(lo[0, 0]) == -2.0 and float(hi[0, 0]) == 127 / 64


def test_bfp16_quark_exponent_follows_fp32_log2():
    amax = torch.tensor([1023.99994, 1024.0, 0.75, 3.0])
    exponent = quark_bfp_exponent(-amax * 0, amax)
    assert exponent.tolist() == torch.floor(torch.log2(amax)).int().tolist()
    assert int(quark_bfp_exponent(torch.zeros(1), torch.zeros(1))) == -127


@needs_quark
def test_bfp16_quark_parity():
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_bfp16

    w = _weight(16, 64) * 5
    w[0, :8] = torch.tensor([-127.5 / 64, 0.5, 0.1, 0, 0, 0, 0, 0.2])
    w[1, :8] = torch.tensor([127.5 / 64, 0.5, 0.1, 0, 0, 0, 0, 0.2])
    w[2, :8] = torch.tensor([1023.99994, 1, 2, 3, 4, 5, 6, 7])
    spec = ob.QuantSpec("bfp16_quark")
    ours = ob.fake_quantize(w, _qparams("minmax", w, spec), spec)
    assert torch.equal(ours, fake_quantize_bfp16(w, axis=-1, block_size=8))


# ------------------------------------------------------------------ ModelOpt 0.47


def test_modelopt_multipliers():
    m = multiplier_candidates(0.25, 4.0, 0.1)
    assert m.numel() == 39 and float(m[0]) == 0.25 and float(m[-1]) == 4.0
    assert float(m[1] - m[0]) == pytest.approx(3.75 / 38)
    assert multiplier_candidates(2.0, 1.0, 0.1).tolist() == [2.0]


@pytest.mark.parametrize(
    "spec",
    [
        ob.QuantSpec("int8", strategy="channel", scale_rule="qmax"),
        ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=16),
        ob.QuantSpec("fp8_e4m3"),
    ],
)
def test_modelopt_mse_equals_the_multiplier_loop(spec):
    w = _weight()
    qp = _qparams("modelopt_mse", w, spec)
    flat = ob.flatten(w, spec, "weight")
    low, high = flat.data.amin(dim=(0, -1)), flat.data.amax(dim=(0, -1))
    if spec.symmetric:
        high = torch.maximum(-low, high)
        low = -high
    errors = []
    for m in multiplier_candidates(0.25, 4.0, 0.1).tolist():
        cand = ob.calculate_qparams(low * m, high * m, spec)
        diff = ob.flatten(ob.fake_quantize(w, cand, spec), spec, "weight").data - flat.data
        errors.append(diff.square().sum(dim=(0, -1)))
    best = multiplier_candidates(0.25, 4.0, 0.1)[torch.stack(errors).argmin(0)]
    assert torch.equal(qp.max_val, high * best)


def test_modelopt_mse_on_nvfp4_keeps_the_max_calibrated_global_scale():
    w = _weight(16, 64)
    qp = _qparams("modelopt_mse", w, ob.QuantSpec("nvfp4"))
    assert float(qp.global_scale) == pytest.approx(E4M3_MAX * 6 / float(w.abs().max()), rel=1e-6)


def _nvfp4_sweep_loop(w, hessian=None):
    """Every E4M3 block scale tried per block by a loop over the 126 candidates."""
    spec = ob.QuantSpec("nvfp4")
    global_scale = torch.tensor([E4M3_MAX * 6]) / w.abs().max()
    shape = (w.shape[0], w.shape[1] // 16)
    errors = []
    for value in fp8_scale_candidates().tolist():
        scale = torch.full(shape, value)
        zeros = torch.zeros(shape)
        qp = ob.QParams(scale, zeros.int(), zeros, zeros, global_scale=global_scale)
        diff = (ob.fake_quantize(w, qp, spec) - w).reshape(*shape, 16)
        if hessian is None:
            errors.append(diff.square().sum(-1))
        else:
            errors.append(torch.einsum("obk,bkl,obl->ob", diff, hessian, diff))
    return fp8_scale_candidates()[torch.stack(errors).argmin(0)]


def test_fp8_scale_candidates_are_every_finite_positive_e4m3_value():
    values = fp8_scale_candidates()
    assert values.numel() == 126 and float(values[0]) == 2.0**-9 and float(values[-1]) == 448.0
    assert bool((values[1:] > values[:-1]).all())


def test_nvfp4_fp8_sweep_equals_the_loop_and_never_loses_to_max_calibration():
    w = _weight(16, 64)
    spec = ob.QuantSpec("nvfp4")
    qp = _qparams("nvfp4_fp8_sweep", w, spec)
    assert torch.equal(qp.scale, _nvfp4_sweep_loop(w))
    plain = _qparams("memoryless_minmax", w, spec)
    assert torch.equal(qp.global_scale, plain.global_scale)

    def block_sse(q):
        return (ob.fake_quantize(w, q, spec) - w).reshape(16, 4, 16).square().sum(-1)

    assert bool((block_sse(qp) <= block_sse(plain)).all())


def test_local_hessian_weights_blocks_by_the_input_hessian():
    w, x = _weight(16, 64), _inputs(64)
    hessian = local_hessian(x)
    assert hessian.shape == (4, 16, 16)
    columns = x.reshape(-1, 64)
    assert torch.allclose(hessian[1], columns[:, 16:32].T @ columns[:, 16:32] / 60, rtol=1e-5)
    collected = _qparams("local_hessian", w, ob.QuantSpec("nvfp4"), inputs=x)
    given = _qparams("local_hessian", w, ob.QuantSpec("nvfp4"), hessian=hessian)
    assert torch.equal(collected.scale, given.scale)
    assert torch.equal(given.scale, _nvfp4_sweep_loop(w, hessian))
    identity = torch.eye(16).expand(4, 16, 16).contiguous()
    assert torch.equal(
        _qparams("local_hessian", w, ob.QuantSpec("nvfp4"), hessian=identity).scale, _nvfp4_sweep_loop(w)
    )


def test_local_hessian_without_inputs_falls_back_to_the_plain_sweep():
    w = _weight(16, 64)
    with pytest.warns(UserWarning, match="no inputs"):
        qp = _qparams("local_hessian", w, ob.QuantSpec("nvfp4"))
    assert torch.equal(qp.scale, _nvfp4_sweep_loop(w))
    with pytest.raises(ValueError, match="divisible by 16"):
        ob.create("local_hessian", ob.QuantSpec("nvfp4")).observe_inputs(torch.ones(4, 40))
    with pytest.raises(ValueError, match="shape"):
        ob.create("local_hessian", ob.QuantSpec("nvfp4"), hessian=torch.ones(4, 8, 8))


def test_nvfp4_act_headroom_by_hand():
    # 1000 blocks of 16 with amax 2^-4, 10 blocks with amax 2^3 (the top 1%), then one outlier block.
    x = torch.zeros(1011, 16)
    x[:1000, 0] = 2.0**-4
    x[1000:1010, 0] = 8.0
    x[1010, 0] = 64.0
    spec = ob.QuantSpec("nvfp4")
    obs = ob.create("nvfp4_act_headroom", spec, kind="activation")
    obs.observe(x)
    bin_width = 80 / 512

    def centre(value):
        index = math.floor((math.log2(value) + 40) / bin_width)
        return 2.0 ** (-40 + (index + 0.5) * bin_width)

    # upper = 99.99th percentile: the outlier's bin (1011 blocks: 99.99% of them reach past the 10 at 8.0)
    assert float(obs.global_amax()) == pytest.approx(16384 * centre(2.0**-4), rel=1e-6)
    qp = obs.qparams()
    assert float(qp.global_scale) == pytest.approx(E4M3_MAX * 6 / (16384 * centre(2.0**-4)), rel=1e-6)
    low = ob.create("nvfp4_act_headroom", spec, kind="activation", rho=2.0)
    low.observe(x)
    with pytest.warns(UserWarning, match="no headroom"):
        assert float(low.global_amax()) == pytest.approx(centre(64.0), rel=1e-6)


def _modelopt_nvfp4_qdq(global_amax):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    second = global_amax / (6 * E4M3_MAX)

    def qdq(x, amax):
        per_block = (amax.reshape(*x.shape[:-1], x.shape[-1] // 16).float() / 6.0) / second
        block = NVFP4QTensor._cast_per_block_scale_to_fp8(per_block)
        q, s1, s2 = NVFP4QTensor.quantize(x, 16, block, second)
        return q.dequantize(dtype=torch.float32, scale=s1, double_scale=s2, block_sizes={-1: 16}).reshape(x.shape)

    return qdq


@needs_modelopt
def test_modelopt_parity():
    from modelopt.torch.quantization.calib import MseCalibrator, NVFP4ActHeadroomCalibrator, NVFP4MSECalibrator
    from modelopt.torch.quantization.model_calib import _LocalHessianAccumulator
    from modelopt.torch.quantization.tensor_quant import _tensor_quant, fp8_eager

    w = _weight(32, 128)
    cal = MseCalibrator(
        w.abs().amax(1, keepdim=True), axis=0, quant_func=lambda x, a: _tensor_quant(x, a, 8, False, False)
    )
    cal.collect(w)
    ours = _qparams("modelopt_mse", w, ob.QuantSpec("int8", strategy="channel", scale_rule="qmax"))
    assert torch.equal(cal.compute_amax().reshape(-1), ours.max_val.reshape(-1))
    cal = MseCalibrator(w.abs().amax(), quant_func=fp8_eager)
    cal.collect(w)
    assert float(cal.compute_amax()) == float(_qparams("modelopt_mse", w, ob.QuantSpec("fp8_e4m3")).max_val)

    blocks, global_amax = w.reshape(-1, 16), w.abs().max()
    cal = NVFP4MSECalibrator(blocks.abs().amax(1), global_amax, axis=0, quant_func=_modelopt_nvfp4_qdq(global_amax))
    cal.collect(blocks)
    assert torch.equal(
        cal.compute_amax().reshape(-1), _qparams("nvfp4_fp8_sweep", w, ob.QuantSpec("nvfp4")).max_val.reshape(-1)
    )

    x = _inputs(128)
    accumulator = _LocalHessianAccumulator(32, 128, 16)
    accumulator.accumulate(x)
    error = accumulator.build_error_func()
    cal = NVFP4MSECalibrator(
        blocks.abs().amax(1), global_amax, axis=0, quant_func=_modelopt_nvfp4_qdq(global_amax), error_func=error
    )
    cal.collect(blocks)
    ours = _qparams("local_hessian", w, ob.QuantSpec("nvfp4"), inputs=x)
    assert torch.equal(cal.compute_amax().reshape(-1), ours.max_val.reshape(-1))

    cal = NVFP4ActHeadroomCalibrator(block_size=16)
    obs = ob.create("nvfp4_act_headroom", ob.QuantSpec("nvfp4"), kind="activation")
    for seed in range(3):
        batch = _inputs(128, seed) * torch.exp(torch.randn(128, generator=torch.Generator().manual_seed(seed)))
        cal.collect(batch)
        obs.observe(batch)
    assert float(cal.compute_amax()) == float(obs.global_amax())


# ------------------------------------------------------------------ AIMET SQNR, Quark layer-wise percentile


def _sqnr_by_hand(values: torch.Tensor, steps: int, symmetric: bool, gamma: float = 3.0):
    """AIMET's search on a 2048-bin histogram, as a double loop over candidates and bins (fp64)."""
    counts = torch.histc(values, bins=2048, min=float(values.min()), max=float(values.max())).double()
    lo, hi = float(values.min()), float(values.max())
    width = (hi - lo) / 2048
    centers = [lo + (i + 0.5) * width for i in range(2048)]
    used = [(c, n) for c, n in zip(centers, counts.tolist(), strict=True) if n]
    deltas, offsets = sqnr_candidates(
        values.min().reshape(1), values.max().reshape(1), steps, symmetric, 101 if symmetric else 17, 21
    )
    deltas, offsets = deltas.expand_as(deltas).flatten().tolist(), offsets.expand(deltas.shape).flatten().tolist()
    best, best_pair = math.inf, None
    for d, o in zip(deltas, offsets, strict=True):
        noise = 0.0
        for c, n in used:
            q = round(c / d - o)
            factor = gamma if q < 0 or q > steps else 1.0
            dq = (min(max(q, 0), steps) + o) * d
            noise += n * (dq - c) ** 2 * factor
        if noise < best * (1 - 1e-9):
            best, best_pair = noise, (d, o)
    return best_pair


@pytest.mark.parametrize("symmetric", [True, False])
def test_sqnr_picks_the_grid_of_least_clip_weighted_noise(symmetric):
    g = torch.Generator().manual_seed(3)
    values = torch.cat([torch.randn(2000, generator=g), torch.tensor([9.0, -4.0])])
    spec = ob.QuantSpec("int4", symmetric=symmetric)
    obs = ob.create("sqnr", spec)
    obs.observe(values.reshape(1, -1))
    delta, offset = obs.encodings()
    hand_delta, hand_offset = _sqnr_by_hand(values, 15, symmetric)
    assert float(delta) == pytest.approx(hand_delta, rel=1e-5) and float(offset) == hand_offset
    qp = obs.qparams()
    qmin = spec.int_range[0]
    assert int(qp.zero_point) == qmin - int(offset)
    assert float(qp.min_val) == pytest.approx(float(offset * delta)) and float(qp.scale) == float(delta)


def test_sqnr_symmetric_candidates_reach_one_percent_past_the_data():
    delta, offset = sqnr_candidates(torch.tensor([-2.0]), torch.tensor([1.0]), 255, True, 101, 21)
    assert delta.shape == (1, 101, 1) and float(offset[0, 0, 0]) == -128
    assert float(delta[0, -1, 0]) == pytest.approx(2 * 2.0 / 255 * 101 / 100)


def test_sqnr_gamma_trades_clipping_for_rounding():
    g = torch.Generator().manual_seed(4)
    values = torch.cat([torch.randn(4000, generator=g), torch.tensor([12.0, -12.0])]).reshape(1, -1)
    spec = ob.QuantSpec("int4")
    wide, narrow = ob.create("sqnr", spec, gamma=50.0), ob.create("sqnr", spec, gamma=1.0)
    wide.observe(values)
    narrow.observe(values)
    assert float(wide.qparams().scale) > float(narrow.qparams().scale)


def test_layerwise_percentile_picks_per_tensor_by_histogram_error():
    assert parse_percentiles("99.99, 99.999") == [99.99, 99.999]
    with pytest.raises(ValueError, match="numbers separated by commas"):
        ob.create("layerwise_percentile", ob.QuantSpec("int8"), percentile_candidates="99,abc")
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        ob.create("layerwise_percentile", ob.QuantSpec("int8"), percentile_candidates="101")
    g = torch.Generator().manual_seed(5)
    values = torch.randn(4, 50000, generator=g)
    values[0, :3] = torch.tensor([40.0, -35.0, 30.0])
    spec = ob.QuantSpec("int8", strategy="channel")
    # mean absolute error (Quark's default): rounding error grows with the step, so clipping the
    # outliers of row 0 wins; squared error punishes the clipped outliers more and keeps them.
    mae = ob.create("layerwise_percentile", spec, percentile_candidates="99.99,100")
    mse = ob.create("layerwise_percentile", spec, percentile_candidates="99.99,100", metric="mse")
    mae.observe(values)
    mse.observe(values)
    assert mae.chosen_percentile()[0, 0].item() == pytest.approx(99.99)
    assert mse.chosen_percentile()[0, 0].item() == 100.0
    # 100 is the lower edge of the last bin, as in Quark (searchsorted finds the bin that completes the mass)
    assert float(mae.qparams().max_val[0, 0]) < 30 and float(mse.qparams().max_val[0, 0]) == 40 * 2047 / 2048


def test_layerwise_percentile_range_by_hand():
    # |x| = 0..99 once each: the 99% point of a 100-bin |x| histogram is the lower edge of bin 98.
    values = torch.arange(100.0).reshape(1, -1)
    obs = ob.create("layerwise_percentile", ob.QuantSpec("int8"), percentile_candidates="99", bins=100)
    obs.observe(values)
    low, high = obs._choose_range()
    assert float(high) == pytest.approx(98 * 0.99) and float(low) == 0.0


# ------------------------------------------------------------------ properties every new observer keeps

NEW = {
    "imatrix_mse": ("int4", {"strategy": "group", "group_size": 16}, "weight"),
    "nvfp4_expanded_mse": ("nvfp4", {}, "weight"),
    "nvfp4_expanded_imatrix": ("nvfp4", {}, "weight"),
    "modelopt_mse": ("int8", {"strategy": "channel"}, "weight"),
    "nvfp4_fp8_sweep": ("nvfp4", {}, "weight"),
    "local_hessian": ("nvfp4", {}, "weight"),
    "nvfp4_act_headroom": ("nvfp4", {}, "activation"),
    "sqnr": ("int4", {"symmetric": False, "strategy": "channel"}, "weight"),
    "layerwise_percentile": ("int8", {"strategy": "channel"}, "weight"),
}


@pytest.mark.parametrize("name", sorted(NEW))
@pytest.mark.parametrize("case", ["constant", "zeros", "negative", "ragged", "tiny", "huge"])
def test_new_observers_give_finite_positive_scales(name, case):
    dtype, kw, kind = NEW[name]
    spec = ob.QuantSpec(dtype, **kw)
    g = torch.Generator().manual_seed(6)
    x = {
        "constant": torch.full((5, 37), 0.3),
        "zeros": torch.zeros(5, 37),
        "negative": torch.full((5, 37), -2.0),
        "ragged": torch.randn(5, 37, generator=g),
        "tiny": torch.randn(5, 37, generator=g) * 1e-30,
        "huge": torch.randn(5, 37, generator=g) * 1e30,
    }[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp = _qparams(name, x, spec, kind=kind)
    scale = qp.effective_scale
    assert bool(torch.isfinite(scale).all() and (scale > 0).all())
    assert bool(torch.isfinite(ob.fake_quantize(x, qp, spec)).all())


@pytest.mark.parametrize("name", sorted(NEW))
def test_new_observers_name_nan_inputs(name):
    dtype, kw, kind = NEW[name]
    spec = ob.QuantSpec(dtype, **kw)
    x = torch.randn(4, 32)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="1 non-finite value"):
        ob.create(name, spec, kind=kind).observe(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp = _qparams(name, x, spec, kind=kind, ignore_nonfinite=True)
    assert bool(torch.isfinite(qp.effective_scale).all())


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("nvfp4_fp8_sweep", ob.QuantSpec("int8"), "does not support dtype 'int8'"),
        ("nvfp4_act_headroom", ob.QuantSpec("mxfp4"), "does not support dtype 'mxfp4'"),
        ("sqnr", ob.QuantSpec("fp8_e4m3"), "needs an integer dtype"),
        ("sqnr", ob.QuantSpec("int4", strategy="group", group_size=16), "supports strategy tensor, channel"),
        ("layerwise_percentile", ob.QuantSpec("fp8_e4m3"), "needs an integer dtype"),
        ("local_hessian", ob.QuantSpec("nvfp4", group_size=32), "blocks of 16"),
    ],
)
def test_unsupported_specs_are_named(name, spec, message):
    with pytest.raises(ValueError, match=message):
        ob.create(name, spec)
