"""Knob declarations (``observers.knobs``) and the vocabulary enums (``observers.vocab``)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob

SPECS = {
    "mx_exponent_search": ob.QuantSpec("mxfp4"),
    "placeholder": ob.QuantSpec("fp16"),
    "nvfp4_fp8_sweep": ob.QuantSpec("nvfp4"),
    "local_hessian": ob.QuantSpec("nvfp4"),
    "nvfp4_act_headroom": ob.QuantSpec("nvfp4"),
}


def _spec(name: str) -> ob.QuantSpec:
    """A spec observer ``name`` accepts, so only its knobs can fail."""
    return SPECS.get(name, ob.QuantSpec("int8"))


NUMERIC_KNOBS = sorted(
    {
        (name, knob)
        for name in ob.available()
        for knob, declared in ob.knob_specs(name).items()
        if declared.type in (int, float)
    }
)


def test_every_knob_is_declared_with_a_doc_and_its_default_passes():
    for name in ob.available():
        declared = ob.knob_specs(name)
        assert set(declared) == set(ob.knobs(name))
        for knob, spec in declared.items():
            assert isinstance(spec, ob.Knob)
            assert spec.doc and "\n" not in spec.doc, f"{name}.{knob} has no one-line doc"
            spec.check(knob, spec.default)
            assert ob.knobs(name)[knob] == spec.default
            assert spec.allowed() in spec.describe()
        ob.create(name, _spec(name))


def test_public_api_keeps_defaults_and_adds_declarations():
    assert ob.knobs("moving_average_minmax") == {"ignore_nonfinite": False, "averaging_constant": 0.01}
    assert ob.observer_class("percentile").all_knobs() == ob.knobs("percentile")
    assert ob.observer_class("percentile").knob_specs() == ob.knob_specs("percentile")
    assert not ob.knob_specs("imatrix_mse")["importance"].editable
    assert all(ob.knob_specs(name)["ignore_nonfinite"].type is bool for name in ob.available())


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("percentile", {"percentile": 0}),
        ("percentile", {"percentile": 150}),
        ("percentile", {"percentile": -5}),
        ("percentile", {"percentile": "99"}),
        ("percentile", {"percentile": float("nan")}),
        ("percentile", {"bins": 0}),
        ("histogram", {"bins": 1}),
        ("histogram", {"bins": 2048.0}),
        ("histogram", {"bins": True}),
        ("mse_grid", {"maxshrink": 1.5}),
        ("mse_grid", {"maxshrink": 0}),
        ("mse_grid", {"grid": 0}),
        ("mse_grid", {"patience": 0}),
        ("mse_grid", {"patience": 2.0}),
        ("mse_grid", {"norm": False}),
        ("mse_grid", {"expand": 0.5}),
        ("mse_grid", {"max_working_bytes": 0}),
        ("moving_average_minmax", {"averaging_constant": 0}),
        ("mse_grid_moving_average", {"averaging_constant": 1.01}),
        ("mx_exponent_search", {"scope": 17}),
        ("mx_exponent_search", {"scope": -1}),
        ("mse", {"start_bin": -1}),
        ("entropy", {"start_bin": 0}),
        ("entropy", {"stride": 0}),
        ("entropy", {"flatten_zero_bin": 1}),
        ("minmax", {"ignore_nonfinite": "yes"}),
    ],
)
def test_out_of_bounds_values_raise_naming_the_knob(name, knobs):
    (knob, value), *_ = knobs.items()
    with pytest.raises(ValueError, match=rf"^{knob} must be .*, got {value!r}$"):
        ob.create(name, _spec(name), **knobs)


def test_messages_say_the_allowed_range():
    with pytest.raises(ValueError, match=r"percentile must be a number in \(0, 100\], got 150"):
        ob.create("percentile", ob.QuantSpec("int8"), percentile=150)
    with pytest.raises(ValueError, match=r"scope must be an integer in \[0, 16\], got 17"):
        ob.create("mx_exponent_search", ob.QuantSpec("mxfp4"), scope=17)
    with pytest.raises(ValueError, match="flatten_zero_bin must be a bool"):
        ob.create("entropy", ob.QuantSpec("int8"), flatten_zero_bin=0)


def test_rules_between_knobs_stay_with_the_observer():
    with pytest.raises(ValueError, match="start_bin"):
        ob.create("mse", ob.QuantSpec("int8"), start_bin=64, bins=64)
    ob.create("entropy", ob.QuantSpec("int8"), start_bin=64, bins=64)
    with pytest.raises(ValueError, match="maxshrink·grid"):
        ob.create("mse_grid", ob.QuantSpec("int8"), maxshrink=0.001, grid=100)


def test_an_int_for_a_float_knob_is_accepted_as_a_float():
    obs = ob.create("mse_grid", ob.QuantSpec("int8"), expand=2, grid=50)
    assert obs.expand == 2.0 and isinstance(obs.expand, float) and isinstance(obs.config["grid"], float)
    assert isinstance(ob.create("mse", ob.QuantSpec("int8")).max_working_bytes, int)


def test_knob_declaration_api():
    knob = ob.Knob(0.5, float, low=0, high=1, high_open=True, doc="A fraction.")
    assert knob.allowed() == "a number in [0, 1)"
    assert knob.widget_bounds() == {"min_value": 0.0, "max_value": 1.0}
    assert knob.coerce("f", 0) == 0.0
    assert ob.Knob(3, int, low=0, low_open=True, doc="n").widget_bounds() == {"min_value": 1}
    mode = ob.Knob("a", str, choices=("a", "b"), doc="mode")
    assert mode.allowed() == "one of 'a', 'b'" and mode.widget_bounds() == {}
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b', got 'c'"):
        mode.check("mode", "c")
    with pytest.raises(ValueError, match="must be"):
        ob.Knob(2.0, float, low=0, high=1, doc="default outside its own bounds")
    with pytest.raises(ValueError, match="bounds"):
        ob.Knob(True, bool, low=0, doc="bounds on a bool")


def _inside(knob: ob.Knob, value: float) -> bool:
    """The declared interval, written out independently of ``Knob.accepts``."""
    above = knob.low is None or (value > knob.low if knob.low_open else value >= knob.low)
    below = knob.high is None or (value < knob.high if knob.high_open else value <= knob.high)
    return above and below


def _partners(knob: str, value: float) -> dict[str, float]:
    """Other knobs set so that the rules between knobs hold for an in-bounds ``value``."""
    if knob == "start_bin":
        return {"bins": max(2, value + 1)}
    if knob == "bins":
        return {"start_bin": 1}
    if knob == "maxshrink" and value > 0:
        return {"grid": 2 / value}
    if knob == "grid":
        return {"maxshrink": 1}
    return {}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NUMERIC_KNOBS), st.data())
def test_numeric_knobs_accept_inside_and_reject_outside_their_bounds(name_knob, data):
    name, knob = name_knob
    declared = ob.knob_specs(name)[knob]
    edges = [b for b in (declared.low, declared.high) if b is not None]
    near = st.sampled_from([e + d for e in edges for d in (-1, -0.5, 0, 0.5, 1)])
    if declared.type is int:
        value = data.draw(st.integers(-5, 4096) | near.map(math.floor))
    else:
        value = data.draw(st.floats(-1e3, 1e3, allow_subnormal=False) | st.integers(-5, 200) | near)
    knobs = {k: v for k, v in _partners(knob, value).items() if k in ob.knob_specs(name)} | {knob: value}
    if not _inside(declared, value):
        with pytest.raises(ValueError, match=f"^{knob} must be"):
            ob.create(name, _spec(name), **knobs)
    elif knob == "grid" and value < 1 and "imatrix" not in name:  # maxshrink <= 1 leaves no candidate
        # (llm-compressor's imatrix search always tries at least two)
        with pytest.raises(ValueError, match="maxshrink·grid"):
            ob.create(name, _spec(name), **knobs)
    else:
        assert getattr(ob.create(name, _spec(name), **knobs), knob) == value


def test_enums_are_the_old_strings():
    assert list(ob.Strategy) == ["tensor", "channel", "group", "token", "block"]
    assert list(ob.ObserverKind) == ["weight", "activation", "attention"]
    assert list(ob.ScaleRule) == ["half_range", "qmax"]
    assert list(ob.ScaleRounding) == ["floor", "even", "ceil", "compressed-tensors"]
    assert ob.STRATEGIES_BY_KIND[ob.ObserverKind.ATTENTION] == ("tensor", "channel")
    assert ob.STRATEGIES_BY_KIND["weight"] == ("tensor", "channel", "group", "block")


def test_spec_built_from_members_serializes_plain_strings():
    spec = ob.QuantSpec(strategy=ob.Strategy.GROUP, group_size=32, scale_rounding=ob.ScaleRounding.CEIL)
    data = spec.to_dict()
    assert data["strategy"] == "group" and type(data["strategy"]) is str
    assert type(data["scale_rounding"]) is str and type(data["scale_rule"]) is str
    assert spec == ob.QuantSpec(strategy="group", group_size=32, scale_rounding="ceil")
    assert ob.QuantSpec.from_dict(json.loads(json.dumps(data))) == spec
    assert "Strategy" not in repr(spec)
    obs = ob.create("minmax", spec, kind=ob.ObserverKind.ACTIVATION)
    assert type(obs.kind) is str and obs.kind == "activation"
    with pytest.raises(ValueError, match="strategy='row'.*allowed: tensor, channel, group, token, block"):
        ob.QuantSpec(strategy="row")
