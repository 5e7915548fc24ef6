"""The native pick of AWQ's clip search (observers/clip_kernel.py, csrc/group_clip.c): the eager picks
(``awq.clip_picks`` inside ``kernels.disabled()``) on every variant this CPU runs, but where two ratios'
eager errors tie to a few ulps, symmetric and asymmetric, group sizes 16 to 128, rows that fill no
whole tile, each weight's own Hessian blocks; the variants identical to each other; exact ties and NaN
kept as eager keeps them; a hand-computed pick; and the eager path wherever the kernel cannot run."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from observers import clip_kernel, kernels
from observers.awq import clip_picks, group_output_errors, shrunk

needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(clip_kernel.NAME), reason=f"kernel not in use here: {kernels.status(clip_kernel.NAME)}"
)
RATIOS = [0.5 + 0.05 * i for i in range(11)]


def _case(n: int, rows: int, columns: int, size: int, symmetric: bool, seed: int):
    """``n`` weights ``(rows, columns)``, their min-max qparams shrunk by ``RATIOS``, and each weight's
    own ``(groups, size, size)`` blocks of a random input moment."""
    generator = torch.Generator().manual_seed(seed)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=size, symmetric=symmetric)
    weights = torch.randn(n, rows, columns, generator=generator)
    weights.view(-1)[torch.randperm(weights.numel(), generator=generator)[:7]] *= 20.0
    observer = ob.create("memoryless_minmax", spec, "weight")
    observer.observe(weights.reshape(n * rows, columns))
    blocks = []
    for _ in range(n):
        x = torch.randn(300, columns, generator=generator) * (torch.rand(columns, generator=generator) * 3 + 0.1)
        moment = x.T @ x / 300
        groups = columns // size
        blocks.append(moment.reshape(groups, size, groups, size).diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    return spec, weights, shrunk(observer.qparams(), spec, RATIOS), torch.stack(blocks).contiguous()


def _eager(weights, ranges, blocks, spec) -> torch.Tensor:
    with kernels.disabled():
        return clip_picks(weights, ranges, blocks, spec)


CASES = {
    "symmetric g16, many weights": (20, 64, 256, 16, True, 1),
    "asymmetric g32, 37 rows": (3, 37, 64, 32, False, 2),
    "symmetric g128, 5 rows": (2, 5, 256, 128, True, 3),
    "asymmetric g64": (4, 24, 128, 64, False, 4),
}


def _errors(weights, ranges, blocks, spec) -> torch.Tensor:
    """Every ratio's eager error per row and group, ``(ratios, n·rows, groups)``."""
    n, rows, columns = weights.shape
    flat = weights.reshape(n * rows, columns)
    return torch.stack(
        [
            group_output_errors((flat - ob.fake_quantize(flat, r, spec)).reshape(1, n, rows, columns), blocks)[
                0
            ].reshape(n * rows, -1)
            for r in ranges
        ]
    )


def _agree_but_for_near_ties(picked: torch.Tensor, eager: torch.Tensor, errors: torch.Tensor) -> None:
    """The kernel's picks are eager's, but where eager's errors of the two picks tie to a few float32
    ulps (the forms are summed in another order): then either is a least error."""
    differ = (picked != eager).nonzero().tolist()
    assert len(differ) <= max(1, picked.numel() // 1000)
    for row, group in differ:
        mine, theirs = float(errors[picked[row, group], row, group]), float(errors[eager[row, group], row, group])
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-12)


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_picks_what_eager_picks_on_every_variant(case: str) -> None:
    spec, weights, ranges, blocks = _case(*CASES[case])
    eager = _eager(weights, ranges, blocks, spec)
    errors = _errors(weights, ranges, blocks, spec)
    _agree_but_for_near_ties(clip_picks(weights, ranges, blocks, spec), eager, errors)
    n, rows, columns = weights.shape
    size = blocks.shape[2]
    laid_out = weights.reshape(n, rows, columns // size, size).contiguous()
    steps = torch.stack([r.scale.float() for r in ranges]).contiguous()
    zeros = torch.stack([r.zero_point.float().expand_as(r.scale) for r in ranges]).contiguous()
    qmin, qmax = spec.int_range
    variants = {}
    for isa in kernels.available_isas(clip_kernel.NAME):
        variants[isa] = clip_kernel.group_clip_picks(laid_out, blocks, steps, zeros, float(qmin), float(qmax), isa=isa)
        _agree_but_for_near_ties(variants[isa], eager, errors)
    assert all(picked.equal(variants["avx2"]) for picked in variants.values())  # the same operations per lane
    assert len(set(eager.flatten().tolist())) > 3  # the case moves picks, not only the first ratio


def test_a_hand_case_keeps_the_ratio_of_least_output_error() -> None:
    """One group of four weights, H = diag(1, 0, 0, 0): only the first weight's error counts, so the
    pick is the first ratio whose step puts 1.02 nearest a code, computed here by hand in float64:
    0.85, whose step 0.85·3/7.5 = 0.34 makes 1.02 the code 3."""
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=4, symmetric=True)
    weights = torch.tensor([[[1.02, -3.0, 2.5, 0.25]]])
    observer = ob.create("memoryless_minmax", spec, "weight")
    observer.observe(weights[0])
    ranges = shrunk(observer.qparams(), spec, RATIOS)
    blocks = torch.diag(torch.tensor([1.0, 0.0, 0.0, 0.0])).reshape(1, 1, 4, 4)
    errors = []
    for r in ranges:
        step = float(r.scale)
        code = max(-8.0, min(7.0, float(torch.tensor(1.02 / step).round())))
        errors.append((1.02 - code * step) ** 2)
    expected = min(range(len(errors)), key=lambda i: (errors[i], i))
    assert RATIOS[expected] == pytest.approx(0.85)
    assert clip_picks(weights, ranges, blocks, spec).tolist() == [[expected]]
    assert _eager(weights, ranges, blocks, spec).tolist() == [[expected]]


@needs_kernel
def test_exact_ties_keep_the_first_ratio() -> None:
    """A group of zeros quantizes to zeros at every ratio: every form is 0 and ratio 0 is kept; a group
    whose codes do not move between ratios keeps the first of them."""
    spec, weights, ranges, blocks = _case(1, 16, 64, 16, True, 5)
    weights[0, :, :16] = 0.0
    observer = ob.create("memoryless_minmax", spec, "weight")
    observer.observe(weights[0])
    ranges = shrunk(observer.qparams(), spec, RATIOS)
    picked = clip_picks(weights, ranges, blocks, spec)
    assert picked[:, 0].eq(0).all()
    _agree_but_for_near_ties(picked, _eager(weights, ranges, blocks, spec), _errors(weights, ranges, blocks, spec))


@needs_kernel
def test_a_nan_form_is_kept_and_passed_over_as_eager_keeps_it() -> None:
    """A NaN weight makes its group's form NaN at every ratio: eager keeps ratio 0 (nothing is strictly
    less than NaN); the kernel does the same, and the other groups keep their picks."""
    spec, weights, ranges, blocks = _case(2, 16, 64, 16, False, 6)
    weights[1, 3, 20] = float("nan")
    picked = clip_picks(weights, ranges, blocks, spec)
    eager = _eager(weights, ranges, blocks, spec)
    assert int(picked[16 + 3, 1]) == int(eager[16 + 3, 1]) == 0
    _agree_but_for_near_ties(picked, eager, _errors(weights, ranges, blocks, spec))


def test_the_eager_path_runs_where_the_kernel_cannot() -> None:
    spec, weights, ranges, blocks = _case(2, 8, 64, 16, True, 7)
    steps = torch.stack([r.scale.float() for r in ranges]).contiguous()
    zeros = torch.zeros_like(steps)
    laid_out = weights.reshape(2, 8, 4, 16).contiguous()
    assert clip_kernel.group_clip_picks(laid_out.double(), blocks, steps, zeros, -8.0, 7.0) is None
    assert clip_kernel.group_clip_picks(laid_out, blocks[:1], steps, zeros, -8.0, 7.0) is None  # one weight's blocks
    wide = torch.zeros(1, 1, 1, clip_kernel.MAX_SIZE * 2)
    wide_blocks = torch.zeros(1, 1, clip_kernel.MAX_SIZE * 2, clip_kernel.MAX_SIZE * 2)
    assert clip_kernel.group_clip_picks(wide, wide_blocks, steps[:, :1, :1], zeros[:, :1, :1], -8.0, 7.0) is None
    with kernels.disabled():
        assert clip_kernel.group_clip_picks(laid_out, blocks, steps, zeros, -8.0, 7.0) is None
    half = clip_picks(weights.bfloat16(), ranges, blocks, spec)  # bf16 weights: eager's own rounding, eager path
    assert half.shape == (16, 4)


def test_eager_picks_are_the_least_group_output_error() -> None:
    """The eager pick against the errors written out: every ratio's ``group_output_errors``, the first least."""
    spec, weights, ranges, blocks = _case(2, 8, 64, 16, True, 8)
    assert _eager(weights, ranges, blocks, spec).equal(_errors(weights, ranges, blocks, spec).argmin(dim=0))
