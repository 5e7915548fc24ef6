"""Block and low-precision formats: MX (fp8/fp6/fp4/int8), NVFP4, BFP16, fp16/bf16 placeholder.

Scale rules are checked on hand-computed blocks and against exact Python arithmetic (fractions),
element rounding against torch's float8 casts, and invariants (finite, lossless export) with
hypothesis.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers import blocks
from observers.formats import FORMATS, formats_table

MX_FLOAT = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
MX = (*MX_FLOAT, "mxint8")
BLOCK = (*MX, "nvfp4", "bfp16")
ROUNDINGS = ("floor", "even", "ceil")
FP32_MAX = float(torch.finfo(torch.float32).max)


def _qparams(x: torch.Tensor, spec: ob.QuantSpec, name: str = "minmax", **knobs) -> ob.QParams:
    obs = ob.create(name, spec, kind="weight", **knobs)
    obs.observe(x)
    return obs.qparams()


def _block(amax: float, size: int = 32, fill: float = 0.0) -> torch.Tensor:
    """One block (a 1 x size weight) whose largest magnitude is ``amax``."""
    x = torch.full((1, size), fill)
    x[0, 0] = amax
    return x


def _exponent(dtype: str, amax: float, rounding: str) -> int:
    spec = ob.QuantSpec(dtype, scale_rounding=rounding)
    return int(_qparams(_block(amax), spec).extras["scale_exponent"].item()) - 127


# ---------------------------------------------------------------- format rows and spec


def test_block_sizes_families_and_table():
    assert {d: ob.QuantSpec(d).group_size for d in BLOCK} == {**dict.fromkeys(MX, 32), "nvfp4": 16, "bfp16": 8}
    assert all(ob.QuantSpec(d).strategy == "group" for d in BLOCK)
    assert ob.QuantSpec("mxfp4", group_size=16).group_size == 16
    families = {name: fmt.family for name, fmt in FORMATS.items()}
    assert [families[d] for d in ("int4", "fp8_e4m3", "mxfp4", "mxint8", "nvfp4", "bfp16", "fp16", "bf16")] == [
        "integer",
        "float",
        "MX",
        "MX",
        "NVFP4",
        "BFP",
        "cast",
        "cast",
    ]
    assert [FORMATS[d].emax for d in MX] == [8, 15, 4, 2, 2, 0]
    rows = {row["name"]: row for row in formats_table()}
    assert set(rows) == set(FORMATS)
    assert rows["mxfp4"] == {
        "name": "mxfp4",
        "family": "MX",
        "element": "E2M1",
        "block_size": 32,
        "scale": "E8M0 (power of two)",
        "max_value": 6.0,
    }
    assert rows["int8"]["max_value"] == 127 and rows["mxint8"]["max_value"] == 127 / 64
    assert rows["nvfp4"]["scale"] == "FP8 E4M3 + fp32 global" and rows["bf16"]["block_size"] is None


def test_block_spec_rejections():
    with pytest.raises(ValueError, match="symmetric"):
        ob.QuantSpec("mxfp4", symmetric=False)
    with pytest.raises(ValueError, match="reduce_range"):
        ob.QuantSpec("mxint8", reduce_range=True)
    with pytest.raises(ValueError, match="plain integer"):
        ob.QuantSpec("bfp16", quant_min=-100, quant_max=100)
    with pytest.raises(ValueError, match="does not support dtype 'nvfp4'"):
        ob.create("mx_exponent_search", ob.QuantSpec("nvfp4"))
    with pytest.raises(ValueError, match="MX dtype"):
        ob.create("mx_exponent_search", ob.QuantSpec("fp16"))
    with pytest.raises(ValueError, match="scope"):
        ob.create("mx_exponent_search", ob.QuantSpec("mxfp4"), scope=-1)
    with pytest.raises(ValueError, match="does not support"):
        ob.create("placeholder", ob.QuantSpec("int8"))


def test_pow2_is_exact_over_the_whole_range():
    exponents = torch.arange(-149, 128)
    assert blocks.pow2(exponents).tolist() == [math.ldexp(1.0, e) for e in range(-149, 128)]


# ---------------------------------------------------------------- MX shared exponent


@pytest.mark.parametrize(
    "dtype, amax, expected",
    [
        # mxfp4 (E2M1, max 6 = 1.5 * 2^2): ceil bumps when the mantissa > 1.5, even when >= 1.75
        ("mxfp4", 7.0, (0, 1, 1)),
        ("mxfp4", 3.5, (-1, 0, 0)),
        ("mxfp4", 3.25, (-1, -1, 0)),
        ("mxfp4", 6.0, (0, 0, 0)),
        ("mxfp4", 4.0, (0, 0, 0)),  # exactly at a binade boundary
        ("mxfp4", 8.0, (1, 1, 1)),
        # mxfp8_e4m3 (max 448 = 1.75 * 2^8): ceil above 1.75, even at >= 1.9375
        ("mxfp8_e4m3", 448.0, (0, 0, 0)),
        ("mxfp8_e4m3", 480.0, (0, 0, 1)),
        ("mxfp8_e4m3", 496.0, (0, 1, 1)),
        ("mxfp8_e4m3", 256.0, (0, 0, 0)),
        # mxint8 (max 127/64 = 1.984375 * 2^0): ceil above 127/64, even at >= 127.5/64
        ("mxint8", 1.99, (0, 0, 1)),
        ("mxint8", 127.5 / 64, (0, 1, 1)),
        ("mxint8", 127 / 64, (0, 0, 0)),
        # mxfp6_e2m3 (max 7.5 = 1.875 * 2^2), mxfp6_e3m2 (max 28 = 1.75 * 2^4), mxfp8_e5m2 (1.75 * 2^15)
        ("mxfp6_e2m3", 7.6, (0, 0, 1)),
        ("mxfp6_e2m3", 7.75, (0, 1, 1)),
        ("mxfp6_e3m2", 30.0, (0, 1, 1)),
        ("mxfp8_e5m2", 60000.0, (0, 0, 1)),
    ],
)
def test_mx_rounding_modes_by_hand(dtype, amax, expected):
    assert tuple(_exponent(dtype, amax, r) for r in ROUNDINGS) == expected


def test_mxfp4_amax_7_block_by_hand():
    x = torch.tensor([[7.0, 1.0, 0.75, -0.25, 2.5, -5.0, 0.0, -0.0] * 4])
    floor = ob.QuantSpec("mxfp4", scale_rounding="floor")
    qp = _qparams(x, floor)
    assert qp.scale.item() == 1.0 and qp.extras["scale_exponent"].item() == 127
    # scale 1: 7 saturates to 6; ties to even: 0.75 -> 1, 0.25 -> 0, 2.5 -> 2, 5 -> 4
    assert ob.fake_quantize(x, qp, floor)[0, :8].tolist() == [6.0, 1.0, 1.0, -0.0, 2.0, -4.0, 0.0, -0.0]
    metrics = ob.error_metrics(x, ob.fake_quantize(x, qp, floor), qp, floor)
    assert metrics["clip_ratio"] == pytest.approx(4 / 32)
    ceil = ob.QuantSpec("mxfp4", scale_rounding="ceil")
    qp = _qparams(x, ceil)
    assert qp.scale.item() == 2.0 and qp.extras["scale_exponent"].item() == 128
    # scale 2: 7/2 = 3.5 -> 4 (tie, even), 1/2 -> 0.5, 0.75/2 = 0.375 -> 0.5, 2.5/2 = 1.25 -> 1
    assert ob.fake_quantize(x, qp, ceil)[0, :6].tolist() == [8.0, 1.0, 1.0, -0.0, 2.0, -4.0]
    assert ob.error_metrics(x, ob.fake_quantize(x, qp, ceil), qp, ceil)["clip_ratio"] == 0.0


def _exact_mx_exponent(amax: float, dtype: str, rounding: str) -> int:
    """Reference from the formulas of the reference doc, in exact rational arithmetic."""
    fmt = FORMATS[dtype]
    if amax == 0 or amax < 2.0**-126:
        return -127
    a = Fraction(amax)
    floor_log2 = math.frexp(amax)[1] - 1
    if rounding == "ceil":  # smallest e with amax <= max_value * 2^e
        e = floor_log2 - fmt.emax - 1
        while a > Fraction(fmt.max_value) * Fraction(2) ** e:
            e += 1
    else:
        if rounding == "even":  # mantissa rounded half-up at man_bits fraction bits carries over
            mantissa = a / Fraction(2) ** floor_log2
            rounded = math.floor(mantissa * 2**fmt.man_bits + Fraction(1, 2))
            floor_log2 += rounded >= 2 ** (fmt.man_bits + 1)
        e = floor_log2 - fmt.emax
    return max(-127, min(127 - fmt.emax, e))


@settings(max_examples=300, deadline=None)
@given(
    st.floats(min_value=0.0, max_value=FP32_MAX, width=32, allow_subnormal=True),
    st.sampled_from(MX),
    st.sampled_from(ROUNDINGS),
)
def test_mx_exponent_matches_exact_formula(amax, dtype, rounding):
    got = blocks.shared_exponent(torch.tensor([amax]), FORMATS[dtype], rounding).item()
    assert got == _exact_mx_exponent(amax, dtype, rounding)


def test_mx_all_zero_block_negative_zero_and_extremes():
    x = torch.zeros(2, 64)
    x[1, 32:] = -0.0
    x[1, :32] = torch.linspace(-1, 1, 32)
    spec = ob.QuantSpec("mxfp4")
    qp = _qparams(x, spec)
    codes = qp.extras["scale_exponent"]
    assert codes.dtype == torch.uint8 and codes[0].tolist() == [0, 0] and codes[1, 1].item() == 0
    assert qp.scale[0, 0].item() == 2.0**-127 > 0
    x_hat = ob.fake_quantize(x, qp, spec)
    assert torch.equal(x_hat[0], x[0]) and torch.isfinite(x_hat).all()
    assert torch.signbit(x_hat[1, 32:]).all(), "negative zero keeps its sign"
    for rounding in ROUNDINGS:  # near fp32 max the exponent is clamped so nothing overflows
        spec = ob.QuantSpec("mxfp4", scale_rounding=rounding)
        big = _block(-FP32_MAX, fill=1e30)
        qp = _qparams(big, spec)
        assert qp.extras["scale_exponent"].item() <= 127 + 125
        assert torch.isfinite(ob.fake_quantize(big, qp, spec)).all()


def test_mx_subnormal_elements_and_outlier_block():
    spec = ob.QuantSpec("mxfp8_e4m3")
    x = torch.tensor([[448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-11] + [0.0] * 27])
    qp = _qparams(x, spec)
    assert qp.scale.item() == 1.0
    # E4M3 subnormal step 2^-9: 2^-10 ties to 0, 3*2^-10 ties to 2^-8 (even), 2^-11 -> 0
    assert ob.fake_quantize(x, qp, spec)[0, :5].tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8, 0.0]
    spec = ob.QuantSpec("mxfp4")
    outlier = torch.tensor([[100.0] + [0.1 * (i % 7 - 3) for i in range(31)]])
    qp = _qparams(outlier, spec)
    assert qp.scale.item() == 16.0  # floor(log2 100) - 2 = 4
    x_hat = ob.fake_quantize(outlier, qp, spec)
    assert x_hat[0, 0].item() == 96.0 and x_hat[0, 1:].abs().max().item() == 0.0  # 0.3/16 < 0.25 -> 0


@pytest.mark.parametrize("dtype, torch_dtype", [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2)])
def test_mx_fp8_elements_equal_torch_float8_cast(dtype, torch_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 3, 256)
    spec = ob.QuantSpec(dtype, scale_rounding="ceil")
    qp = _qparams(x, spec)
    scale = qp.scale.repeat_interleave(32, dim=1)
    fmax = FORMATS[dtype].max_value
    expected = (x / scale).clamp(-fmax, fmax).to(torch_dtype).float() * scale
    assert torch.equal(ob.fake_quantize(x, qp, spec), expected)


def test_mxint8_elements_by_hand():
    spec = ob.QuantSpec("mxint8")
    x = torch.tensor([[1.5, 0.01, -1.5, 0.0078125, 0.0234375] + [0.0] * 27])
    qp = _qparams(x, spec)
    assert qp.scale.item() == 1 / 64 and qp.extras["scale_exponent"].item() == 127
    # codes: 1.5*64 = 96, 0.64 -> 1, 0.5 -> 0 (tie to even), 1.5 -> 2
    assert ob.quantize(x, qp, spec)[0, :5].tolist() == [96, 1, -96, 0, 2]
    top = _block(-1.999)
    qp = _qparams(top, spec)
    assert ob.quantize(top, qp, spec)[0, 0].item() == -127  # -127.94 saturates at -127, not -128
    assert ob.error_metrics(top, ob.fake_quantize(top, qp, spec), qp, spec)["clip_ratio"] == pytest.approx(1 / 32)
    qp = _qparams(top, spec.replace(scale_rounding="even"))
    assert qp.scale.item() == 1 / 32 and ob.quantize(top, qp, spec)[0, 0].item() == -64


# ---------------------------------------------------------------- BFP16


def test_bfp16_exponent_and_per_block_overflow_bump():
    spec = ob.QuantSpec("bfp16")
    x = torch.zeros(1, 24)
    x[0, :8] = torch.tensor([1.99, 0.5, -0.25, 0.01, 0, 0, 0, 0])
    x[0, 8:16] = torch.tensor([-1.995, 0.5, 0.01, 0, 0, 0, 0, 0])
    x[0, 16] = 1.0 / 1024  # ragged last block of one element
    qp = _qparams(x[:, :17], spec)
    # block 0: E = 0, step 1/64, 1.99*64 = 127.36 -> 127, no bump
    # block 1: 1.995*64 = 127.68 rounds to 128 -> bump to E = 1, step 1/32 (that block only)
    # block 2: 2^-10 -> E = -10, step 2^-16
    assert (qp.extras["scale_exponent"].int() - 127).tolist() == [[0, 1, -10]]
    assert qp.scale.tolist() == [[1 / 64, 1 / 32, 2.0**-16]]
    assert ob.quantize(x[:, :17], qp, spec)[0].tolist() == [127, 32, -16, 1, 0, 0, 0, 0, -64, 16, 0, 0, 0, 0, 0, 0, 64]
    x_hat = ob.fake_quantize(x[:, :17], qp, spec)
    assert ob.error_metrics(x[:, :17], x_hat, qp, spec)["clip_ratio"] == 0.0
    qp_ceil = _qparams(x[:, :17], ob.QuantSpec("bfp16", scale_rounding="ceil"))
    assert torch.equal(qp_ceil.scale, qp.scale), "BFP16's bump rule does not depend on scale_rounding"


# ---------------------------------------------------------------- NVFP4


def test_nvfp4_by_hand():
    spec = ob.QuantSpec("nvfp4")
    x = torch.zeros(1, 48)
    x[0, :16] = torch.linspace(-6, 6, 16)
    x[0, 16:32] = torch.linspace(-1, 1, 16)
    qp = _qparams(x, spec)  # block 2 is all zero
    assert qp.global_scale.tolist() == [448.0]  # 448 * 6 / 6
    # block scales: 6/6*448 = 448; 1/6*448 = 74.67 -> E4M3 72 (step 8 in [64, 128)); zero -> 2^-9
    assert qp.scale.tolist() == [[448.0, 72.0, 2.0**-9]]
    assert qp.effective_scale.flatten().tolist() == pytest.approx([1.0, 72 / 448, 2.0**-9 / 448], rel=1e-7)
    x_hat = ob.fake_quantize(x, qp, spec)
    assert x_hat[0, 16].item() == pytest.approx(-6 * 72 / 448)  # -1 / 0.1607 = -6.22 saturates at -6
    assert torch.equal(x_hat[0, 32:], torch.zeros(16))
    assert torch.equal(qp.scale.to(torch.float8_e4m3fn).float(), qp.scale)


def test_nvfp4_all_zero_tensor_is_finite():
    spec = ob.QuantSpec("nvfp4")
    qp = _qparams(torch.zeros(4, 32), spec)
    assert torch.isfinite(qp.global_scale).all() and (qp.global_scale > 0).all()
    assert torch.isfinite(qp.effective_scale).all() and (qp.effective_scale > 0).all()
    assert torch.equal(ob.fake_quantize(torch.zeros(4, 32), qp, spec), torch.zeros(4, 32))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(-20, 30))
def test_nvfp4_block_scales_are_e4m3_values(seed, log_magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 80, generator=g) * torch.rand(8, 80, generator=g).pow(4) * 2.0**log_magnitude
    spec = ob.QuantSpec("nvfp4")
    qp = _qparams(x, spec)
    assert torch.equal(qp.scale.to(torch.float8_e4m3fn).float(), qp.scale)
    assert float(qp.scale.max()) == 448.0 and float(qp.scale.min()) >= 2.0**-9
    x_hat = ob.fake_quantize(x, qp, spec)
    assert float((x_hat - x).abs().max()) <= float(x.abs().max()) / 6 * 2 + 1e-30


# ---------------------------------------------------------------- shared properties


def test_ragged_last_block_matches_separate_blocks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 40, generator=g)
    for dtype in ("mxfp4", "mxint8", "bfp16"):
        spec = ob.QuantSpec(dtype, group_size=32)
        qp = _qparams(x, spec)
        assert qp.scale.shape == (4, 2)
        head = ob.fake_quantize(x[:, :32], _qparams(x[:, :32], spec), spec)
        tail_spec = spec.replace(group_size=8)
        tail = ob.fake_quantize(x[:, 32:], _qparams(x[:, 32:], tail_spec), tail_spec)
        assert torch.equal(ob.fake_quantize(x, qp, spec), torch.cat([head, tail], dim=1))


@pytest.mark.parametrize("dtype", [*BLOCK, "fp16", "bf16"])
def test_qparams_json_round_trip_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 70, generator=g) * torch.logspace(-20, 20, 70)
    spec = ob.QuantSpec(dtype)
    qp = _qparams(x, spec, "placeholder" if FORMATS[dtype].kind == "cast" else "minmax")
    back = ob.QParams.from_dict(json.loads(json.dumps(qp.to_dict())))
    for name in ("scale", "zero_point", "min_val", "max_val", "global_scale"):
        a, b = getattr(qp, name), getattr(back, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))), name
    assert qp.extras.keys() == back.extras.keys()
    assert all(torch.equal(qp.extras[k], back.extras[k]) for k in qp.extras)
    if FORMATS[dtype].scale_kind in ("e8m0", "pow2"):
        exponent = qp.extras["scale_exponent"].int() - 127 - (6 if FORMATS[dtype].kind == "int" else 0)
        assert torch.equal(blocks.pow2(exponent), qp.scale)
    assert torch.equal(ob.fake_quantize(x, back, spec), ob.fake_quantize(x, qp, spec))


finite_rows = st.lists(
    st.floats(allow_nan=False, allow_infinity=False, width=32, allow_subnormal=True), min_size=1, max_size=70
)


@settings(max_examples=150, deadline=None)
@given(finite_rows, st.sampled_from(BLOCK), st.sampled_from(ROUNDINGS))
def test_no_nan_or_inf_for_finite_inputs(values, dtype, rounding):
    x = torch.tensor([values], dtype=torch.float32)
    spec = ob.QuantSpec(dtype, scale_rounding=rounding)
    for name in ("minmax", "mx_exponent_search") if dtype in MX else ("minmax",):
        qp = _qparams(x, spec, name)
        assert torch.isfinite(qp.effective_scale).all() and (qp.effective_scale > 0).all()
        x_hat = ob.fake_quantize(x, qp, spec)
        assert torch.isfinite(x_hat).all()
        metrics = ob.error_metrics(x, x_hat, qp, spec)
        assert math.isfinite(metrics["clip_ratio"]) and math.isfinite(metrics["rmse_over_scale"])
        if float(x.abs().max()) < 1e18:  # beyond that, squares overflow the fp32 sums of compare_tensors
            assert all(math.isfinite(metrics[k]) for k in ("mse", "cosine", "max_abs_error"))
        assert torch.equal(ob.fake_quantize(x_hat, qp, spec), x_hat), "fake-quant is idempotent"


@pytest.mark.parametrize("dtype", BLOCK)
def test_range_observers_work_for_every_block_format(dtype):
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(16, 96, generator=g) * (1 + i) for i in range(3)]
    spec = ob.QuantSpec(dtype)
    names = ["minmax", "memoryless_minmax", "moving_average_minmax", "mse_grid"]
    results = ob.run_suite(batches, spec, names=names, kind="activation")
    assert [r.error for r in results] == [None] * 4
    for r in results:
        assert r.qparams.scale.shape == (96 // spec.group_size,)
        assert math.isfinite(r.metrics["sqnr_db"]) and r.metrics["sqnr_db"] > 5
    by_name = {r.name: r.qparams for r in results}
    if dtype in MX or dtype == "bfp16":  # a shrunk range never raises the exponent
        assert (by_name["mse_grid"].extras["scale_exponent"] <= by_name["minmax"].extras["scale_exponent"]).all()
    if dtype == "nvfp4":
        assert torch.equal(by_name["mse_grid"].scale.to(torch.float8_e4m3fn).float(), by_name["mse_grid"].scale)


# ---------------------------------------------------------------- exponent search


def test_mx_exponent_search_prefers_clipping_the_outlier_by_hand():
    # scale 1: 0.7 -> 0.5 (31 errors of 0.2, SSE 1.24); scale 0.5: 0.7 -> 0.75 (SSE 31 * 0.0025)
    # plus 4.0 -> 3.0 (error 1) = 1.0775: e - 1 wins
    x = torch.tensor([[4.0] + [0.7] * 31, [4.0] + [0.1] * 31])
    spec = ob.QuantSpec("mxfp4")
    qp = _qparams(x, spec, "mx_exponent_search", scope=1)
    assert (qp.extras["scale_exponent"].int() - 127).tolist() == [[-1], [0]]
    assert qp.scale.tolist() == [[0.5], [1.0]]
    assert torch.equal(_qparams(x, spec, "mx_exponent_search", scope=0).scale, _qparams(x, spec).scale)


@pytest.mark.parametrize("dtype, wins", [("mxfp4", True), ("mxint8", True), ("mxfp6_e2m3", False)])
def test_mx_exponent_search_never_worse_than_its_start(dtype, wins):
    g = torch.Generator().manual_seed(4)
    heavy = torch.randn(32, 256, generator=g) / torch.rand(32, 256, generator=g).sqrt()
    # one outlier at 4 per block over values of 0.65..0.75: the case the search is for (for mxfp4 and
    # mxint8; E2M3 already has a fine enough grid there, clipping 4 to 3.75 costs more than it gains)
    outliers = (0.65 + 0.1 * torch.rand(32, 256, generator=g)) * torch.randn(32, 256, generator=g).sign()
    outliers[:, ::32] = 4.0
    spec = ob.QuantSpec(dtype)
    for x in (heavy, outliers):
        searched = _qparams(x, spec, "mx_exponent_search", scope=3)
        start = _qparams(x, spec)
        searched_sse, start_sse = (
            (ob.fake_quantize(x, qp, spec) - x).square().reshape(32, 8, 32).sum(-1) for qp in (searched, start)
        )
        assert (searched_sse <= start_sse).all()
        offset = start.extras["scale_exponent"].int() - searched.extras["scale_exponent"].int()
        assert offset.min() >= 0 and offset.max() <= 3
    assert ((searched_sse < start_sse).float().mean() > 0.5) == wins


# ---------------------------------------------------------------- fp16 / bf16


@pytest.mark.parametrize("dtype, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_placeholder_cast(dtype, torch_dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, 16, generator=g) * 100
    spec = ob.QuantSpec(dtype)
    obs = ob.create("placeholder", spec, kind="activation")
    obs.observe(x)
    obs.observe(x * 2)
    qp = obs.qparams()
    assert qp.scale.tolist() == [1.0] and qp.zero_point.tolist() == [0]
    assert qp.min_val.item() == float((x * 2).min()) and qp.max_val.item() == float((x * 2).max())
    x_hat = ob.fake_quantize(x, qp, spec)
    assert torch.equal(x_hat, x.to(torch_dtype).float())
    metrics = ob.error_metrics(x, x_hat, qp, spec)
    assert metrics["mse"] == pytest.approx(float((x_hat - x).square().mean()))
    assert metrics["rmse_over_scale"] is None and metrics["clip_ratio"] == 0.0
    assert ob.run_one("minmax", x, spec, kind="activation").error is None


def test_round_to_float_grid_matches_frexp_formula():
    """The bit-built reciprocal gives the same grid as the textbook frexp formula, for every float format."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(50_000, generator=g) * torch.logspace(-12, 6, 50_000)
    x[:7] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 0.375])
    for exp_bits, man_bits, max_value in ((4, 3, 448.0), (5, 2, 57344.0), (3, 2, 28.0), (2, 3, 7.5), (2, 1, 6.0)):
        _, exponent = torch.frexp(x.abs())
        step = torch.ldexp(torch.ones_like(x), (exponent - 1).clamp(min=2 - 2 ** (exp_bits - 1)) - man_bits)
        expected = torch.copysign(torch.round(x.abs() / step).mul(step).clamp(max=max_value), x)
        got = ob.formats.round_to_float_grid(x, exp_bits, man_bits, max_value)
        assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))
    transposed = x[:4096].reshape(64, 64).t()
    assert torch.equal(
        ob.formats.round_to_float_grid_(transposed.clone(), 2, 1, 6.0),
        ob.formats.round_to_float_grid(transposed.contiguous(), 2, 1, 6.0),
    )
