"""``observe(x, apart=n)``: ``n`` weights stacked as rows, each getting the qparams it gets observed
alone, in one pass. The searches whose rule reads the whole weight keep them apart: a shrink
grid's early stop (once no group of the weight improves) and the histogram screen's grid (sized
by the row count)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import observers as ob

INT4_G16 = ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=16)
FP4_G16 = ob.QuantSpec(dtype="fp4_e2m1", symmetric=True, strategy="group", group_size=16)
INT4_CHANNEL = ob.QuantSpec(dtype="int4", symmetric=True, strategy="channel")
CASES = [
    ("mse_grid", INT4_G16),
    ("mse_grid_moving_average", INT4_G16),
    ("nvfp4_expanded_mse", INT4_G16),
    ("imatrix_mse", INT4_G16),
    ("mse_grid", FP4_G16),
    ("histogram", INT4_CHANNEL),
    ("memoryless_minmax", INT4_G16),
]
SEEDS = range(40)


def _weights(seed: int, rows: int) -> list[torch.Tensor]:
    """Five small weights with uneven columns: with few groups a shrink grid often stops early."""
    torch.manual_seed(seed)
    return [torch.randn(rows, 32) * torch.rand(1, 32) * 4 for _ in range(5)]


def _qparams(observer: str, spec: ob.QuantSpec, x: torch.Tensor, apart: int = 1) -> ob.QParams:
    knobs = {"importance": torch.linspace(0.5, 2.0, 32)} if "importance" in ob.knobs(observer) else {}
    if observer in ("nvfp4_expanded_mse", "imatrix_mse"):
        knobs["patience"] = 1  # so that its early stop bites on these weights (1000 never stops)
    found = ob.create(observer, spec, "weight", **knobs)
    found.observe(x, apart=apart)
    return found.qparams()


@pytest.mark.parametrize(("observer", "spec"), CASES, ids=lambda c: getattr(c, "dtype", c))
def test_stacked_weights_kept_apart_get_each_the_qparams_it_gets_alone(observer: str, spec: ob.QuantSpec) -> None:
    rows = 4 if observer == "histogram" else 2
    together_differs = 0
    for seed in SEEDS:
        weights = _weights(seed, rows)
        stacked = torch.cat(weights)
        apart = _qparams(observer, spec, stacked, apart=len(weights))
        alone = [_qparams(observer, spec, w) for w in weights]
        assert torch.equal(apart.scale, torch.cat([q.scale for q in alone])), seed
        assert torch.equal(apart.zero_point, torch.cat([q.zero_point for q in alone])), seed
        together_differs += not torch.equal(_qparams(observer, spec, stacked).scale, apart.scale)
    if observer != "memoryless_minmax":  # row-local already: nothing to keep apart
        assert together_differs > 0  # observed as one weight, some stacks would differ: what apart keeps


def test_apart_is_refused_where_it_cannot_hold() -> None:
    x = torch.randn(6, 32)
    with pytest.raises(ValueError, match="6 rows do not split into 4"):
        _qparams("mse_grid", INT4_G16, x, apart=4)
    with pytest.raises(ValueError, match="positive int"):
        _qparams("mse_grid", INT4_G16, x, apart=0)
    tensor = ob.QuantSpec(dtype="int8", symmetric=True, strategy="tensor")
    with pytest.raises(ValueError, match="group or channel spec"):
        _qparams("mse_grid", tensor, x, apart=2)
    activations = ob.create("minmax", ob.QuantSpec(dtype="int8", symmetric=True, strategy="channel"), "activation")
    with pytest.raises(ValueError, match="group or channel spec"):
        activations.observe(x, apart=2)


@pytest.mark.parametrize("observer", ["imatrix_mse", "nvfp4_expanded_imatrix"])
def test_each_stacked_weight_may_have_its_own_importance(observer: str) -> None:
    # an (n, in) importance gives weight i row i, normalized by its own mean, as alone; a row of
    # zeros runs that weight unweighted, as an all-zero importance does alone (with its warning)
    assert "importance" in ob.knobs(observer)
    differs = 0
    for seed in range(20):
        weights = _weights(seed, 2)
        importance = torch.rand(len(weights), 32, generator=torch.Generator().manual_seed(seed)) * 3
        if seed % 4 == 0:
            importance[seed % len(weights)] = 0.0
        apart = ob.create(observer, INT4_G16, "weight", importance=importance, patience=1)
        with _warns_if(seed % 4 == 0):
            apart.observe(torch.cat(weights), apart=len(weights))
        alone = []
        for weight, row in zip(weights, importance, strict=True):
            one = ob.create(observer, INT4_G16, "weight", importance=row, patience=1)
            with _warns_if(not bool((row > 0).any())):
                one.observe(weight)
            alone.append(one.qparams())
        assert torch.equal(apart.qparams().scale, torch.cat([q.scale for q in alone])), seed
        assert torch.equal(apart.qparams().zero_point, torch.cat([q.zero_point for q in alone])), seed
        shared = ob.create(observer, INT4_G16, "weight", importance=importance.mean(0), patience=1)
        shared.observe(torch.cat(weights), apart=len(weights))
        differs += not torch.equal(shared.qparams().scale, apart.qparams().scale)
    assert differs > 0  # one importance for all would give other qparams: each row is read
    with pytest.raises(ValueError, match=r"one row per weight observed apart \(5\)"):
        ob.create(observer, INT4_G16, "weight", importance=torch.ones(4, 32)).observe(torch.cat(weights), apart=5)
    with pytest.raises(ValueError, match=r"\(in,\), or \(n, in\) for n weights observed apart"):
        ob.create(observer, INT4_G16, "weight", importance=torch.ones(2, 2, 32))


@contextlib.contextmanager
def _warns_if(zero: bool):
    """The all-zero importance warning where ``zero``, no warning at all otherwise."""
    if zero:
        with pytest.warns(UserWarning, match="only zeros"):
            yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
