"""'As each tool would run it': the observer, knobs and conventions a quantization tool applies by
default to a scheme, so one run shows side by side what each tool would produce for a layer.

A ``QuantSpec`` says *what* scheme (format, granularity, symmetry, static or dynamic); each tool
decides *how*: the range estimator, the integer scale divisor, the MX exponent rounding, where the
NVFP4 global scale lives. ``profile`` keeps the scheme and swaps in those decisions, or refuses in
one line. Sources (installed code, paraphrased; the table is ``docs/tool_defaults.md``):

- llm-compressor 0.14.0.1 + compressed-tensors 0.19.0: ``QuantizationArgs.observer`` is None by
  default and ``calibration.initialize_observer`` picks ``memoryless_minmax`` for weights (forcing
  it over ``minmax``/``static_minmax``) and ``minmax`` (EMA, ``averaging_constant`` 0.01: our
  ``moving_average_minmax``) for inputs, outputs and k/v; the FP8 and NVFP4 presets
  (``quant_scheme``) name ``static_minmax`` (our ``minmax``) for inputs; dynamic args get no
  observer. ``calculate_qparams``: ``amax / ((qmax - qmin) / 2)`` on the signed INT range, zero
  scales set to eps; ``generate_mx_scales`` rounds amax at E2M1's one mantissa bit;
  ``generate_gparam``: NVFP4 global_scale = 448*6/amax. Types: INT 2-8, FP8 E4M3, FP4, MXFP4/8.
- ModelOpt 0.47.0: ``QuantizerAttributeConfig`` defaults ``calibrator="max"`` (running amax, no
  zero point), ``narrow_range=False``; ``tensor_quant._tensor_quant`` scales by amax/(2^(b-1)-1)
  and clamps to -2^(b-1)..2^(b-1)-1. Recipe numerics: NVFP4/MX blocks are ``type: dynamic``;
  ``qtensor.mxfp4_tensor``/``mxfp8_tensor``: exponent ``ceil(log2(amax / elem_max))``; NVFP4
  exports ``weight_scale_2 = amax / (448*6)``.
- AMD Quark 0.13: ``config.Int8PerTensorSpec`` & co. use ``observer_method="min_max"`` (running
  min/max; channel, group, MX and BFP observers keep running maxima too);
  ``calculate_int_quant_params``: ``amax / ((qmax - qmin) / 2)`` clamped at float32 eps;
  ``OCP_MX*Spec`` ``scale_calculation_mode="even"``; ``PerBlockBFPObserver`` keeps code -128;
  NVFP4 is ``FP4PerGroupSpec(scale_format="e4m3")``; fp16/bf16 use ``PlaceholderObserver``.
- torch.ao (torch 2.13): ``get_default_qconfig("x86")``: ``HistogramObserver(reduce_range=True)``
  for activations, ``PerChannelMinMaxObserver`` qint8 symmetric for weights, scale
  ``amax / ((qmax - qmin) / 2)`` clamped at float32 eps; dynamic linear quantizes its input per
  tensor with ``reduce_range=True``. No group/token/block observers in its qconfigs; float8 dtypes
  get an integer 0..15 range, so no float/MX/NVFP4/BFP format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import observers as ob
from lab.vocab import SPEC_KEYS, TensorKind, observer_kind
from observers.spec import FLOAT32_EPS


class Tool(StrEnum):
    """The tools whose defaults the lab can reproduce."""

    LLM_COMPRESSOR = "llm-compressor"
    MODELOPT = "modelopt"
    QUARK = "quark"
    TORCH_AO = "torch.ao"


@dataclass(frozen=True)
class ToolProfile:
    """What ``tool`` runs for one tensor: our observer reproducing its default, knob overrides,
    the person's spec with the tool's conventions applied, and short notes on what differs."""

    tool: str
    observer: str
    knobs: dict[str, Any]
    spec: ob.QuantSpec
    notes: tuple[str, ...]


_CT_FORMATS = {"fp8_e4m3", "fp4_e2m1", "nvfp4", "mxfp4", "mxfp8_e4m3"}


def _tool(name: str) -> Tool:
    try:
        return Tool(name)
    except ValueError:
        raise ValueError(f"unknown tool {name!r}; allowed: {', '.join(t.value for t in Tool)}") from None


def _kind(tensor: str) -> str:
    allowed = dict.fromkeys(str(kind) for kind in [*TensorKind, *SPEC_KEYS])
    if tensor not in allowed:
        raise ValueError(f"unknown tensor kind {tensor!r}; allowed: {', '.join(allowed)}")
    return observer_kind(tensor)


class _Refusal(ValueError):  # the tool cannot express the scheme: ``profiles`` makes it a note
    pass


def _refuse(tool: Tool, lacks: str) -> None:
    raise _Refusal(f"{tool.value} cannot express this scheme: {lacks}")


def _int_note(spec: ob.QuantSpec) -> str:
    lo, hi = spec.int_range
    return f"scale = amax/((qmax-qmin)/2) (int8: amax/127.5), range {lo}..{hi}"


def _llm_compressor(tensor: str, kind: str, spec: ob.QuantSpec) -> tuple[str, dict, dict, list[str]]:
    fmt, tool = spec.format, Tool.LLM_COMPRESSOR
    if fmt.kind == "cast":
        _refuse(tool, "no 16-bit cast scheme in compressed-tensors (leave the tensor unquantized)")
    if (fmt.kind != "int" and spec.dtype not in _CT_FORMATS) or (fmt.is_block and fmt.kind == "int"):
        _refuse(tool, f"no {spec.dtype} in compressed-tensors 0.19 (INT2-8, FP8 E4M3, FP4, NVFP4, MXFP4, MXFP8)")
    if spec.has_custom_range:
        _refuse(tool, "no custom quant_min/quant_max in QuantizationArgs")
    if spec.strategy == "token" and not spec.dynamic:
        _refuse(tool, "static per-token ranges (compressed-tensors requires dynamic=True for 'token')")
    if spec.dynamic and spec.strategy in ("channel", "block"):
        _refuse(tool, f"dynamic {spec.strategy!r} (dynamic supports tensor, token, group)")
    changes: dict[str, Any] = {"scale_rule": "half_range", "reduce_range": False}
    notes = []
    if fmt.kind == "int" and not fmt.signed:
        changes["dtype"] = f"int{fmt.bits}"
        notes.append(f"no unsigned type: {spec.dtype} runs as int{fmt.bits} (same grid, zero point shifted)")
    if fmt.family == "MX":
        changes["scale_rounding"] = "compressed-tensors"
        notes.append("E8M0 exponent of amax rounded half-up at one mantissa bit, minus emax")
    if spec.dtype == "nvfp4":
        notes.append("global_scale = 448·6/amax (element step = scale/global_scale); q/k/v, gate/up share it")
    fp8_static = spec.dtype == "fp8_e4m3" and spec.strategy == "tensor" and not spec.dynamic
    if fmt.kind == "int":
        notes.append(_int_note(spec.replace(**changes)))
    if kind == "weight":
        return "memoryless_minmax", {}, changes, [*notes, "weights: memoryless_minmax (forced over static ones)"]
    if tensor == "input" and (fp8_static or spec.dtype == "nvfp4" and spec.dynamic):
        return "minmax", {}, changes, [*notes, "FP8/NVFP4 preset input observer: static_minmax (running min/max)"]
    if spec.dynamic:
        return "memoryless_minmax", {}, changes, [*notes, "dynamic: no observer attached; range from each call"]
    return "moving_average_minmax", {"averaging_constant": 0.01}, changes, [*notes, "default 'minmax': EMA, 0.01"]


def _modelopt(tensor: str, kind: str, spec: ob.QuantSpec) -> tuple[str, dict, dict, list[str]]:
    fmt, tool = spec.format, Tool.MODELOPT
    if fmt.kind == "cast":
        _refuse(tool, "no 16-bit cast quantizer (a disabled quantizer leaves the model dtype)")
    if fmt.family == "BFP":
        _refuse(tool, "no block floating point (BFP16) format")
    if fmt.kind == "int" and not fmt.signed:
        _refuse(tool, "no zero point: its unsigned integers clip negatives to 0, unlike an affine uint")
    if not spec.symmetric:
        _refuse(tool, "asymmetric integers (its quantizers calibrate one amax, no zero point)")
    if spec.has_custom_range:
        _refuse(tool, "no custom quant_min/quant_max (only num_bits, narrow_range, unsigned)")
    changes: dict[str, Any] = {"scale_rule": "qmax", "reduce_range": False}
    notes = []
    if fmt.kind == "int" and not fmt.is_block:
        lo, hi = fmt.int_range()
        notes.append(f"scale = amax/qmax (int8: amax/127), range {lo}..{hi} (narrow_range off); amax<=2^-24 -> 0")
    if fmt.family == "MX":
        changes["scale_rounding"] = "ceil"
        notes.append("E8M0 exponent = ceil(log2(amax/elem_max)): never clips; block scales at run time")
    if spec.dtype == "nvfp4":
        notes.append("global scale stored as amax/(448·6) (weight_scale_2); block scales at run time")
    if spec.dynamic:
        return "memoryless_minmax", {}, changes, [*notes, "dynamic: amax taken from each call"]
    notes.append("default calibrator 'max': running max of |x| over calibration batches")
    return "minmax", {}, changes, notes


def _quark(tensor: str, kind: str, spec: ob.QuantSpec) -> tuple[str, dict, dict, list[str]]:
    fmt = spec.format
    if spec.has_custom_range:
        _refuse(Tool.QUARK, "no custom quant_min/quant_max (fixed ranges per dtype spec)")
    if fmt.kind == "cast":
        return "placeholder", {}, {}, ["Float16Spec/Bfloat16Spec: PlaceholderObserver, a plain cast"]
    if spec.dtype in ("fp4_e2m1", "fp6_e3m2", "fp6_e2m3") and spec.strategy != "group":
        _refuse(Tool.QUARK, f"{spec.dtype} only per group (FP4PerGroupSpec/FP6*PerGroupSpec)")
    changes: dict[str, Any] = {"scale_rule": "half_range", "reduce_range": False}
    notes = []
    if fmt.kind == "int" and not fmt.is_block:
        notes.append(_int_note(spec.replace(reduce_range=False)))
    if fmt.family == "MX":
        changes["scale_rounding"] = "even"
        notes.append("scale_calculation_mode 'even': amax rounded at the element's mantissa, then its exponent")
    if fmt.family == "BFP":
        changes["dtype"] = "bfp16_quark"
        notes.append("BFP16 keeps code -128; exponent bumped only when the positive max overflows")
    if spec.strategy == "token":
        notes.append("no per-token qscheme: written as a dynamic per-channel spec over the token axis")
    if spec.dtype == "nvfp4":
        notes.append("FP4PerGroupSpec scale_format e4m3: block scales under 448·6/max block amax, folded in")
    if spec.dynamic:
        return "memoryless_minmax", {}, changes, [*notes, "dynamic: range taken from each call"]
    notes.append("observer_method 'min_max': running min/max over calibration batches")
    return "minmax", {}, changes, notes


def _torch_ao(tensor: str, kind: str, spec: ob.QuantSpec) -> tuple[str, dict, dict, list[str]]:
    fmt, tool = spec.format, Tool.TORCH_AO
    if fmt.kind == "cast":
        return "placeholder", {}, {}, ["float16 qconfig: PlaceholderObserver, a plain cast"]
    if fmt.kind != "int" or fmt.is_block:
        _refuse(tool, f"no {spec.dtype}: its observers compute integer ranges only (no float/MX/NVFP4/BFP)")
    if spec.strategy not in ("tensor", "channel"):
        _refuse(tool, f"no per-{spec.strategy} observer in torch.ao.quantization qconfigs (tensor, channel)")
    changes: dict[str, Any] = {"scale_rule": "half_range", "reduce_range": kind != "weight"}
    notes = []
    if kind != "weight" and spec.has_custom_range:
        changes |= {"reduce_range": False, "quant_min": spec.quant_min // 2, "quant_max": spec.quant_max // 2}
        notes.append("reduce_range halves the custom quant_min/quant_max")
    try:
        tool_spec = spec.replace(**changes)
    except ValueError as err:
        _refuse(tool, f"its default activation reduce_range with this spec ({err})")
    notes.append(_int_note(tool_spec) + (" (reduce_range)" if tool_spec.reduce_range else ""))
    if kind == "weight":
        notes.append("x86 qconfig weight: PerChannelMinMaxObserver qint8 symmetric (MinMaxObserver per tensor)")
        return "minmax", {}, changes, notes
    if spec.dynamic:
        return "memoryless_minmax", {}, changes, [*notes, "dynamic qconfig: per-call min/max, reduce_range=True"]
    notes.append("x86 qconfig activation is quint8 affine; the spec's dtype and symmetry are kept")
    if spec.strategy == "channel":
        notes.append("HistogramObserver is per tensor; per-channel activations need PerChannelMinMaxObserver")
        return "minmax", {}, changes, notes
    return "histogram", {"bins": 2048}, changes, [*notes, "HistogramObserver: 2048 bins, least L2 error range"]


_BUILDERS = dict(zip(Tool, (_llm_compressor, _modelopt, _quark, _torch_ao), strict=True))


def profile(tool: str, tensor: str, spec: ob.QuantSpec) -> ToolProfile:
    """What ``tool`` would run by default for ``tensor`` (weight, input, output, k, v or kv) under
    ``spec``: the scheme is kept, the tool's observer and conventions replace the person's (eps is
    float32 eps for every tool). A ``ValueError`` (one line naming the tool and what it lacks)
    when the tool cannot express the scheme, the tool or tensor is unknown, or the strategy does
    not apply to the tensor."""
    which, kind = _tool(tool), _kind(tensor)
    spec.check_kind(kind)
    observer, knobs, changes, notes = _BUILDERS[which](str(tensor), kind, spec)
    tool_spec = spec.replace(**changes, eps=FLOAT32_EPS)
    return ToolProfile(which.value, observer, dict(knobs), tool_spec, tuple(notes))


def profiles(tools: Iterable[str] | None, tensor: str, spec: ob.QuantSpec) -> tuple[list[ToolProfile], list[str]]:
    """The profiles of ``tools`` (all when None) that can express ``spec`` for ``tensor``, and one
    note per tool that cannot, so a side-by-side view shows every tool without failing on one.
    An unknown tool name is still an error: it is a typo, not a limit of the tool."""
    chosen = list(Tool) if tools is None else [_tool(name) for name in tools]
    spec.check_kind(_kind(tensor))
    found, refused = [], []
    for tool in chosen:
        try:
            found.append(profile(tool, tensor, spec))
        except _Refusal as err:
            refused.append(str(err))
    return found, refused
