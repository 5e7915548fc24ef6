"""``lab.analyse.tools``: each tool's default observer and conventions for a scheme ("as each tool would run it").

The facts are checked against hand-computed scales (the reference packages are not installed in
CI); torch.ao ships with torch, so its weight observer is compared directly, and the other
references are compared only where importable.
"""

from __future__ import annotations

import pytest
import torch

import observers as ob
from lab.analyse import tools
from lab.analyse.tools import Tool
from lab.vocab import observer_kind
from observers.spec import FLOAT32_EPS

CASES = {
    "int8 weight channel": ("weight", ob.QuantSpec("int8", strategy="channel")),
    "int8 input tensor": ("input", ob.QuantSpec("int8")),
    "fp8 input": ("input", ob.QuantSpec("fp8_e4m3")),
    "nvfp4 weight": ("weight", ob.QuantSpec("nvfp4")),
    "mxfp4 weight": ("weight", ob.QuantSpec("mxfp4")),
    "int4 group 128 weight": ("weight", ob.QuantSpec("int4", strategy="group", group_size=128)),
    "fp8 kv": ("k", ob.QuantSpec("fp8_e4m3")),
}
TORCH_AO_REFUSES = {"fp8 input", "nvfp4 weight", "mxfp4 weight", "int4 group 128 weight", "fp8 kv"}


def _data(tensor: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if tensor == "weight":
        return [torch.randn(16, 256, generator=gen)]
    if tensor in ("k", "v"):
        return [torch.randn(2, 4, 8, 32, generator=gen) for _ in range(2)]
    return [torch.randn(8, 256, generator=gen) * 2 for _ in range(3)]


def _scale(tool: str, tensor: str, spec: ob.QuantSpec, batches: list[torch.Tensor]) -> torch.Tensor:
    p = tools.profile(tool, tensor, spec)
    obs = ob.create(p.observer, p.spec, kind=observer_kind(tensor), **p.knobs)
    for batch in batches:
        obs.observe(batch)
    return obs.qparams().scale.reshape(-1)


@pytest.mark.parametrize("tool", list(Tool))
@pytest.mark.parametrize("case", list(CASES))
def test_every_tool_runs_or_refuses_each_scheme(tool: str, case: str) -> None:
    tensor, spec = CASES[case]
    if tool == Tool.TORCH_AO and case in TORCH_AO_REFUSES:
        with pytest.raises(ValueError, match=r"^torch\.ao cannot express this scheme: "):
            tools.profile(tool, tensor, spec)
        return
    p = tools.profile(tool, tensor, spec)
    assert p.tool == tool and p.notes and all(isinstance(note, str) for note in p.notes)
    assert p.observer in ob.available()
    kind = observer_kind(tensor)
    ob.create(p.observer, p.spec, kind=kind, **p.knobs)
    result = ob.run_one(p.observer, _data(tensor), p.spec, kind, **p.knobs)
    assert result.error is None
    assert (p.spec.dtype, p.spec.strategy, p.spec.group_size) == (spec.dtype, spec.strategy, spec.group_size)


def test_default_observers_per_tool() -> None:
    int8, fp8 = ob.QuantSpec("int8"), ob.QuantSpec("fp8_e4m3")
    lc = Tool.LLM_COMPRESSOR
    assert tools.profile(lc, "weight", int8).observer == "memoryless_minmax"
    ema = tools.profile(lc, "input", int8)
    assert (ema.observer, ema.knobs) == ("moving_average_minmax", {"averaging_constant": 0.01})
    assert tools.profile(lc, "input", fp8).observer == "minmax"  # FP8 preset: static_minmax
    assert tools.profile(lc, "output", fp8).observer == "moving_average_minmax"
    assert tools.profile(lc, "k", fp8).observer == "moving_average_minmax"
    assert tools.profile(lc, "input", ob.QuantSpec("nvfp4", dynamic=True)).observer == "minmax"
    dynamic = ob.QuantSpec("fp8_e4m3", strategy="token", dynamic=True)
    assert tools.profile(lc, "input", dynamic).observer == "memoryless_minmax"
    for tool in (Tool.MODELOPT, Tool.QUARK):
        assert {tools.profile(tool, t, int8).observer for t in ("weight", "input", "k")} == {"minmax"}
    hist = tools.profile(Tool.TORCH_AO, "input", int8)
    assert (hist.observer, hist.knobs) == ("histogram", {"bins": 2048})
    assert tools.profile(Tool.TORCH_AO, "weight", int8).observer == "minmax"


def test_int8_scale_rule_is_qmax_only_in_modelopt() -> None:
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    amax = w.abs().amax(1)
    spec = ob.QuantSpec("int8", strategy="channel")
    for tool in Tool:
        divisor = 127.0 if tool == Tool.MODELOPT else 127.5
        torch.testing.assert_close(_scale(tool, "weight", spec, [w]), amax / divisor)
    modelopt = tools.profile(Tool.MODELOPT, "weight", spec).spec
    assert modelopt.scale_rule == "qmax" and modelopt.int_range == (-128, 127)  # narrow_range defaults to False


def test_torch_ao_reduces_the_activation_range_only() -> None:
    for tensor, expected in (("weight", (-128, 127)), ("input", (-64, 63)), ("output", (-64, 63)), ("v", (-64, 63))):
        spec = tools.profile(Tool.TORCH_AO, tensor, ob.QuantSpec("int8")).spec
        assert spec.int_range == expected
    custom = ob.QuantSpec("int8", quant_min=-8, quant_max=7)
    assert tools.profile(Tool.TORCH_AO, "input", custom).spec.int_range == (-4, 3)  # torch.ao halves custom ranges
    for tool in (Tool.LLM_COMPRESSOR, Tool.MODELOPT, Tool.QUARK):
        assert tools.profile(tool, "input", ob.QuantSpec("int8", reduce_range=True)).spec.int_range == (-128, 127)


@pytest.mark.parametrize(
    ("dtype", "amax", "expected"),
    [
        # mxfp4 (emax 2): 6.5 = 1.625·4 keeps its binade at one mantissa bit; ceil(log2(6.5/6)) = 1
        ("mxfp4", 6.5, {Tool.LLM_COMPRESSOR: 1.0, Tool.QUARK: 1.0, Tool.MODELOPT: 2.0}),
        # 7.5 = 1.875·4 rounds up to 8 at one mantissa bit: every tool's rule moves to scale 2
        ("mxfp4", 7.5, {Tool.LLM_COMPRESSOR: 2.0, Tool.QUARK: 2.0, Tool.MODELOPT: 2.0}),
        # mxfp8 (emax 8): 460.8 = 1.8·256 rounds up at one bit (compressed-tensors), not at three (Quark)
        ("mxfp8_e4m3", 460.8, {Tool.LLM_COMPRESSOR: 2.0, Tool.QUARK: 1.0, Tool.MODELOPT: 2.0}),
    ],
)
def test_mx_exponent_rounding_differs_between_tools(dtype: str, amax: float, expected: dict) -> None:
    block = torch.full((1, 32), 0.25)
    block[0, 3] = -amax
    rounding = {Tool.LLM_COMPRESSOR: "compressed-tensors", Tool.QUARK: "even", Tool.MODELOPT: "ceil"}
    for tool, scale in expected.items():
        assert tools.profile(tool, "weight", ob.QuantSpec(dtype)).spec.scale_rounding == rounding[tool]
        assert _scale(tool, "weight", ob.QuantSpec(dtype), [block]).item() == scale


def test_block_floating_point_only_in_quark_with_its_minus_128_code() -> None:
    found, refused = tools.profiles(None, "weight", ob.QuantSpec("bfp16"))
    assert [(p.tool, p.spec.dtype) for p in found] == [("quark", "bfp16_quark")]
    assert [line.split(" ")[0] for line in refused] == ["llm-compressor", "modelopt", "torch.ao"]


def test_nvfp4_notes_give_each_tools_global_scale_convention() -> None:
    spec = ob.QuantSpec("nvfp4")
    assert any("amax/(448·6)" in n and "weight_scale_2" in n for n in tools.profile("modelopt", "weight", spec).notes)
    assert any("448·6/amax" in n for n in tools.profile("llm-compressor", "weight", spec).notes)


def test_llm_compressor_ema_follows_its_formula() -> None:
    first, second = torch.full((2, 8), 1.0), torch.full((2, 8), 3.0)
    first[0, 0], second[0, 0] = -2.0, -4.0
    ema_amax = 2.0 + 0.01 * (4.0 - 2.0)  # symmetric: max(|min|, max) of the averaged min/max
    torch.testing.assert_close(
        _scale("llm-compressor", "input", ob.QuantSpec("int8"), [first, second]).item(), ema_amax / 127.5
    )


def test_unsigned_runs_as_signed_int_in_llm_compressor_on_the_same_grid() -> None:
    spec = ob.QuantSpec("uint8", symmetric=False)
    x = torch.linspace(-1.3, 2.9, 97).reshape(1, 97)
    p = tools.profile("llm-compressor", "input", spec)
    assert p.spec.dtype == "int8" and not p.spec.symmetric
    mine = ob.create("minmax", p.spec, kind="activation")
    theirs = ob.create("minmax", spec, kind="activation")
    mine.observe(x), theirs.observe(x)
    torch.testing.assert_close(ob.fake_quantize(x, mine.qparams(), p.spec), ob.fake_quantize(x, theirs.qparams(), spec))


def test_every_profile_uses_float32_eps() -> None:
    spec = ob.QuantSpec("int8", eps=1e-3)
    found, _ = tools.profiles(None, "weight", spec)
    assert len(found) == 4 and {p.spec.eps for p in found} == {FLOAT32_EPS}


@pytest.mark.parametrize(
    ("tool", "tensor", "spec", "lacks"),
    [
        ("llm-compressor", "input", ob.QuantSpec("int8", strategy="token"), "static per-token"),
        ("llm-compressor", "weight", ob.QuantSpec("mxfp6_e3m2"), "mxfp6_e3m2"),
        ("modelopt", "input", ob.QuantSpec("int8", symmetric=False), "asymmetric"),
        ("modelopt", "input", ob.QuantSpec("uint8", symmetric=False), "unsigned"),
        ("torch.ao", "input", ob.QuantSpec("uint8"), "reduce_range"),
        ("quark", "weight", ob.QuantSpec("int8", quant_min=-127, quant_max=127), "quant_min"),
    ],
)
def test_refusals_are_one_line_naming_tool_and_lack(tool: str, tensor: str, spec: ob.QuantSpec, lacks: str) -> None:
    with pytest.raises(ValueError) as err:
        tools.profile(tool, tensor, spec)
    message = str(err.value)
    assert message.startswith(f"{tool} cannot express this scheme: ") and lacks in message and "\n" not in message


def test_profiles_notes_refusals_instead_of_raising() -> None:
    found, refused = tools.profiles(["torch.ao", "quark"], "weight", ob.QuantSpec("mxfp4"))
    assert [p.tool for p in found] == ["quark"]
    assert len(refused) == 1 and refused[0].startswith("torch.ao cannot express")


def test_unknown_tool_or_tensor_names_the_allowed_ones() -> None:
    for call in (
        lambda: tools.profile("gptq", "weight", ob.QuantSpec()),
        lambda: tools.profiles(["gptq"], "weight", ob.QuantSpec()),
    ):
        with pytest.raises(ValueError, match="unknown tool 'gptq'; allowed: llm-compressor, modelopt, quark, torch.ao"):
            call()
    with pytest.raises(ValueError, match="unknown tensor kind 'bias'"):
        tools.profile("quark", "bias", ob.QuantSpec())


def test_torch_ao_weight_scales_equal_its_default_x86_weight_observer() -> None:
    qconfig = pytest.importorskip("torch.ao.quantization").get_default_qconfig("x86")
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    reference = qconfig.weight()
    reference(w)
    scale, _ = reference.calculate_qparams()
    assert torch.equal(_scale("torch.ao", "weight", ob.QuantSpec("int8", strategy="channel"), [w]), scale.float())


def test_mxfp4_scales_equal_compressed_tensors_when_installed() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales, maybe_convert_from_mx_exp

    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
    reference = maybe_convert_from_mx_exp(args, generate_mx_scales(w.reshape(8, 4, 32).abs().amax(-1), 4))
    assert torch.equal(_scale("llm-compressor", "weight", ob.QuantSpec("mxfp4"), [w]), reference.reshape(-1).float())
