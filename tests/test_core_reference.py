"""Parity of the min-max family with torch.ao.quantization, checked directly against torch."""

import pytest
import torch
from torch.ao.quantization.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

import observers as ob

TORCH_DTYPES = {"int8": torch.qint8, "uint8": torch.quint8}
CASES = [
    (dtype, symmetric, reduce_range)
    for dtype in ("int8", "uint8")
    for symmetric in (True, False)
    for reduce_range in (False, True)
    if not (dtype == "uint8" and symmetric and reduce_range)
]


def _batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 64, generator=g) * (i + 1) + 0.3 * i for i in range(4)]


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours.flatten().double(), theirs.flatten().double(), rtol=1e-6, atol=0)


def _spec(dtype, symmetric, reduce_range, **kw):
    return ob.QuantSpec(dtype=dtype, symmetric=symmetric, reduce_range=reduce_range, **kw)


def _qscheme(symmetric: bool, per_channel: bool):
    if per_channel:
        return torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    return torch.per_tensor_symmetric if symmetric else torch.per_tensor_affine


@pytest.mark.parametrize("dtype,symmetric,reduce_range", CASES)
def test_minmax_matches_torch_ao(dtype, symmetric, reduce_range):
    ref = MinMaxObserver(dtype=TORCH_DTYPES[dtype], qscheme=_qscheme(symmetric, False), reduce_range=reduce_range)
    obs = ob.create("minmax", _spec(dtype, symmetric, reduce_range), kind="activation")
    for batch in _batches():
        ref(batch)
        obs.observe(batch)
    scale, zero_point = ref.calculate_qparams()
    qp = obs.qparams()
    _assert_close(qp.scale, scale)
    assert qp.zero_point.flatten().tolist() == zero_point.flatten().tolist()


@pytest.mark.parametrize("dtype,symmetric,reduce_range", CASES)
@pytest.mark.parametrize("averaging_constant", [0.01, 0.3, 1.0])
def test_moving_average_matches_torch_ao(dtype, symmetric, reduce_range, averaging_constant):
    ref = MovingAverageMinMaxObserver(
        averaging_constant=averaging_constant,
        dtype=TORCH_DTYPES[dtype],
        qscheme=_qscheme(symmetric, False),
        reduce_range=reduce_range,
    )
    spec = _spec(dtype, symmetric, reduce_range)
    obs = ob.create("moving_average_minmax", spec, kind="activation", averaging_constant=averaging_constant)
    for batch in _batches(1):
        ref(batch)
        obs.observe(batch)
    scale, zero_point = ref.calculate_qparams()
    qp = obs.qparams()
    _assert_close(qp.scale, scale)
    assert qp.zero_point.flatten().tolist() == zero_point.flatten().tolist()


@pytest.mark.parametrize("dtype,symmetric,reduce_range", CASES)
def test_per_channel_matches_torch_ao(dtype, symmetric, reduce_range):
    ref = PerChannelMinMaxObserver(
        ch_axis=0, dtype=TORCH_DTYPES[dtype], qscheme=_qscheme(symmetric, True), reduce_range=reduce_range
    )
    obs = ob.create("minmax", _spec(dtype, symmetric, reduce_range, strategy="channel"), kind="weight")
    for batch in _batches(2):
        ref(batch)
        obs.observe(batch)
    scale, zero_point = ref.calculate_qparams()
    qp = obs.qparams()
    assert qp.scale.shape == (16, 1)
    _assert_close(qp.scale, scale)
    assert qp.zero_point.flatten().tolist() == zero_point.flatten().tolist()


@pytest.mark.parametrize("symmetric", [True, False])
def test_moving_average_per_channel_matches_torch_ao(symmetric):
    ref = MovingAveragePerChannelMinMaxObserver(
        averaging_constant=0.1, ch_axis=0, dtype=torch.qint8, qscheme=_qscheme(symmetric, True)
    )
    spec = _spec("int8", symmetric, False, strategy="channel")
    obs = ob.create("moving_average_minmax", spec, kind="weight", averaging_constant=0.1)
    for batch in _batches(3):
        ref(batch)
        obs.observe(batch)
    scale, _ = ref.calculate_qparams()
    _assert_close(obs.qparams().scale, scale)


def test_custom_range_matches_torch_ao():
    ref = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, quant_min=0, quant_max=15)
    obs = ob.create("minmax", ob.QuantSpec("uint8", quant_min=0, quant_max=15), kind="activation")
    x = _batches(4)[0]
    ref(x)
    obs.observe(x)
    scale, zero_point = ref.calculate_qparams()
    _assert_close(obs.qparams().scale, scale)
    assert obs.qparams().zero_point.item() == zero_point.item()


def test_fake_quantize_matches_torch_fake_quantize():
    x = _batches(5)[0]
    spec = ob.QuantSpec("uint8", symmetric=False)
    obs = ob.create("minmax", spec, kind="activation")
    obs.observe(x)
    qp = obs.qparams()
    expected = torch.fake_quantize_per_tensor_affine(x, qp.scale.item(), int(qp.zero_point.item()), 0, 255)
    torch.testing.assert_close(ob.fake_quantize(x, qp, spec), expected, rtol=0, atol=1e-6)


def test_per_channel_fake_quantize_matches_torch():
    w = _batches(6)[0]
    spec = ob.QuantSpec("int8", strategy="channel")
    obs = ob.create("memoryless_minmax", spec)
    obs.observe(w)
    qp = obs.qparams()
    expected = torch.fake_quantize_per_channel_affine(w, qp.scale.flatten(), qp.zero_point.flatten(), 0, -128, 127)
    torch.testing.assert_close(ob.fake_quantize(w, qp, spec), expected, rtol=0, atol=1e-6)


def test_symmetric_unsigned_reduce_range_is_rejected_like_torch_ao():
    with pytest.raises(NotImplementedError):
        MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, reduce_range=True)
    with pytest.raises(ValueError, match="reduce_range"):
        ob.QuantSpec("uint8", symmetric=True, reduce_range=True)
