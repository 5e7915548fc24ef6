"""The native pick of the local_hessian sweep (observers/block_hessian_kernel.py, csrc/block_hessian.c):
the eager picks (first least of ``dwᵀ H_b dw``) and forms to a few ulps on every variant this CPU runs, the
variants identical to each other, exact ties kept first, the eager quotient where v*(1/s) would overflow;
the observer giving the eager block scales through it, and the eager fallback wherever it cannot run."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from bench.common import llm_weight
from observers import block_hessian_kernel, kernels, modelopt_search
from observers.formats import FORMATS
from observers.granularity import flatten
from observers.modelopt_search import candidate_errors, fp8_scale_candidates, local_hessian

needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(block_hessian_kernel.NAME),
    reason=f"kernel not in use here: {kernels.status(block_hessian_kernel.NAME)}",
)
SPEC = ob.QuantSpec("nvfp4")
FMT = SPEC.format


def _inputs(columns: int, tokens: int, seed: int, outliers: bool = False) -> torch.Tensor:
    """Random layer inputs ``(tokens, columns)``; with ``outliers`` a few channels 100x larger."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, columns, generator=generator)
    if outliers:
        x[:, torch.randperm(columns, generator=generator)[:3]] *= 100.0
    return x


def _weight(rows: int, columns: int, seed: int, outliers: bool = False) -> torch.Tensor:
    w = llm_weight(rows, columns, seed=seed)
    if outliers:
        w.view(-1)[torch.randperm(w.numel(), generator=torch.Generator().manual_seed(seed))[:5]] *= 50.0
    return w


CASES = {
    "full rank": (_weight(37, 64, 1), local_hessian(_inputs(64, 200, 1))),
    "rank deficient": (_weight(50, 96, 2), local_hessian(_inputs(96, 5, 2))),
    "outliers": (_weight(21, 128, 3, outliers=True), local_hessian(_inputs(128, 300, 3, outliers=True))),
    "whole tiles": (_weight(32, 48, 4), local_hessian(_inputs(48, 64, 4))),
}


def _steps(w: torch.Tensor) -> torch.Tensor:
    """The sweep's candidate steps for ``w``: every E4M3 block scale over the max-calibrated global scale."""
    return (fp8_scale_candidates() / (448.0 * FMT.max_value / w.abs().max())).float()


def _eager(w: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager forms' least value and ``argmin`` per row and block (candidate_errors with the Hessian)."""
    with kernels.disabled():
        errors = candidate_errors(flatten(w, SPEC, "weight"), SPEC, steps, None, 1 << 26, hessian)
    return errors.amin(dim=0), errors.argmin(dim=0)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, 16)


@needs_kernel
@pytest.mark.parametrize("case", CASES)
def test_picks_and_forms_are_the_eager_ones_on_every_variant(case):
    w, hessian = CASES[case]
    steps = _steps(w)
    value, index = _eager(w, hessian, steps)
    results = []
    for isa in kernels.available_isas(block_hessian_kernel.NAME):
        picked = block_hessian_kernel.hessian_picks(_blocks(w), hessian, steps, FMT, isa=isa)
        assert picked is not None, isa
        assert torch.equal(picked[1], index), isa
        torch.testing.assert_close(picked[0], value, rtol=1e-5, atol=0)
        results.append(picked)
    for other in results[1:]:  # every variant runs the same operations per lane
        assert torch.equal(other[0], results[0][0]) and torch.equal(other[1], results[0][1])


def _tie_block() -> torch.Tensor:
    """One row, one block whose values dequantize identically with steps 1 and 1.5 (7 -> 6·1 = 4·1.5,
    3 -> 3·1 = 2·1.5, 1.5 -> 1.5·1 = 1·1.5, small values -> 0), both better than step 8."""
    values = torch.tensor([7.0, 3.0, 1.5, 0.1, -7.0, -3.0, 0.2, 0.0, 1.5, -1.5, 3.0, 0.05, 7.0, -0.1, 0.0, 3.0])
    return values.reshape(1, 1, 16)


@needs_kernel
def test_candidates_dequantizing_alike_tie_exactly_and_the_first_is_kept():
    data = _tie_block()
    hessian = local_hessian(_inputs(16, 40, 5))
    for isa in kernels.available_isas(block_hessian_kernel.NAME):
        forms = []
        for order in ([8.0, 1.0, 1.5], [8.0, 1.5, 1.0]):
            steps = torch.tensor(order)
            value, index = block_hessian_kernel.hessian_picks(data, hessian, steps, FMT, isa=isa)
            assert int(index) == 1, (isa, order)
            assert torch.equal(_eager(data.reshape(1, 16), hessian, steps)[1], index)
            forms.append(value)
        assert torch.equal(forms[0], forms[1]), isa


@needs_kernel
def test_zero_blocks_keep_the_first_candidate_like_eager():
    """An all-zero block gives form 0 for every candidate: an exact tie over all 126, the first kept."""
    w, hessian = CASES["full rank"]
    w = w.clone()
    w[5] = 0.0
    picked = block_hessian_kernel.hessian_picks(_blocks(w), hessian, _steps(w), FMT)
    assert bool((picked[1][5] == 0).all()) and bool((picked[0][5] == 0).all())
    assert torch.equal(picked[1], _eager(w, hessian, _steps(w))[1])


@needs_kernel
def test_quotients_that_would_overflow_take_the_divide():
    """1e15 / 2^-120 overflows: the divide gives inf (the grid clamps it to 6), as eager; v·(1/s) corrected
    by an fma would give NaN, read as +inf, and the other candidate (the same dequantized block) would win."""
    data = torch.zeros(1, 1, 16)
    data[0, 0, 3] = 1e15
    steps = torch.tensor([2.0**-120, 1.0])
    hessian = torch.eye(16).unsqueeze(0)
    eager_value, eager_index = _eager(data.reshape(1, 16), hessian, steps)
    for isa in kernels.available_isas(block_hessian_kernel.NAME):
        value, index = block_hessian_kernel.hessian_picks(data, hessian, steps, FMT, isa=isa)
        assert int(index) == int(eager_index) == 0, isa
        assert torch.equal(value, eager_value), isa


@needs_kernel
def test_nan_forms_read_as_infinity():
    data = _tie_block().clone()
    data[0, 0, 2] = float("nan")
    value, index = block_hessian_kernel.hessian_picks(data, torch.eye(16).unsqueeze(0), torch.tensor([1.0, 2.0]), FMT)
    assert float(value) == float("inf") and int(index) == 0


def _observer_scale(w: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    observer = ob.create("local_hessian", SPEC, hessian=hessian)
    observer.observe(w)
    return observer.qparams().scale


@needs_kernel
@pytest.mark.parametrize("case", CASES)
def test_the_observer_takes_the_kernel_and_gives_the_eager_block_scales(case, monkeypatch):
    w, hessian = CASES[case]
    picks = []
    real = block_hessian_kernel.hessian_picks
    monkeypatch.setattr(block_hessian_kernel, "hessian_picks", lambda *a, **k: picks.append(real(*a, **k)) or picks[-1])
    native = _observer_scale(w, hessian)
    assert len(picks) == 1 and picks[0] is not None
    with kernels.disabled():
        eager = _observer_scale(w, hessian)
    assert picks[1] is None
    assert torch.equal(native, eager)


def test_shapes_and_tensors_it_does_not_take_fall_back_to_eager():
    data, hessian, steps = torch.randn(20, 3, 16), torch.eye(16).expand(3, 16, 16).contiguous(), torch.rand(5) + 0.1
    picks = block_hessian_kernel.hessian_picks
    assert picks(data.double(), hessian, steps, FMT) is None
    assert picks(data.transpose(0, 1), hessian, steps, FMT) is None  # not contiguous
    assert picks(data, hessian.transpose(1, 2), steps, FMT) is None
    assert picks(data, hessian[:2], steps, FMT) is None
    assert picks(data.reshape(20, 6, 8), hessian, steps, FMT) is None
    assert picks(data, hessian, steps.reshape(5, 1), FMT) is None
    assert picks(data, hessian, steps, FORMATS["int4"]) is None
    assert picks(data.to("meta"), hessian, steps, FMT) is None  # any device but the CPU (CUDA too)
    with kernels.disabled():
        assert picks(data, hessian, steps, FMT) is None


@needs_kernel
def test_padded_blocks_take_the_eager_path(monkeypatch):
    """Inputs not a multiple of 16 have no Hessian blocks: the plain sweep runs and never asks the kernel."""
    calls = []
    monkeypatch.setattr(modelopt_search.block_hessian_kernel, "hessian_picks", lambda *a, **k: calls.append(1))
    with pytest.warns(UserWarning, match="not a multiple of 16"):
        observer = ob.create("local_hessian", SPEC)
        observer.observe_inputs(torch.randn(8, 48))
        observer.observe(llm_weight(16, 40, seed=6))
    assert not calls
