"""Block and low-precision formats: the scale rules of MX, NVFP4 and BFP16, and their observers.

The format rows live in ``observers.formats`` (``family`` MX, NVFP4, BFP, cast); this module adds
the rule that turns a per-block range into ``QParams`` for each new ``scale_kind`` and registers it
in ``qparams.SCALE_RULES``, so every range observer (minmax family, mse_grid, histogram) works on
block formats unchanged. Blocks run along the last dim (the input dim of weights, the hidden dim
of activations); ``QuantSpec`` makes block formats ``strategy="group"`` with ``group_size`` =
the format's block size (MX 32, NVFP4 16, BFP16 8), overridable; a ragged last block is padded.

Rules (section 6 of the reference doc):

- ``e8m0`` (MX): one power-of-two scale ``2^e`` per block. ``e`` follows ``spec.scale_rounding``:
  ``floor`` (OCP) ``e = floor(log2 amax) - emax``; ``even`` (Quark) the same after rounding amax
  up to the next binade when its mantissa rounds over at the element precision; ``ceil``
  (ModelOpt) ``e = ceil(log2(amax / max_value))``, which never clips. ``e`` is clamped to
  ``[-127, 127 - emax]`` (the upper bound keeps the largest element a finite fp32; it only
  matters for ``|x| >= 2^127``); an all-zero block gets ``e = -127``.
  MXINT8 elements are int8 codes worth ``code * 2^-6`` of ``2^e``, range ±127, so ``emax = 0``
  and its ``QParams.scale`` is the code step ``2^(e-6)``. ``QParams.extras["scale_exponent"]``
  holds the E8M0 codes ``e + 127`` as uint8.
- ``e4m3`` (NVFP4): fp32 global scale ``448 * 6 / amax_tensor`` and per-block scales
  ``cast_e4m3(amax_block / 6 * global)``, both in ``QParams`` (``scale`` holds the exact fp32
  values of E4M3 numbers; the element step is ``scale / global_scale``). ``amax_tensor`` is
  clamped to ``[spec.eps, 2^127]`` and block scales to at least the smallest E4M3 subnormal
  ``2^-9``, so an all-zero tensor or block gives finite positive scales and no dequantized value
  overflows fp32 (values beyond 2^127 saturate).
- ``pow2`` (BFP16): shared exponent ``E = floor(log2 amax)``, 8-bit mantissas with step
  ``2^(E - 6)``; when the block's largest value would round to 128 (mantissa >= 127.5/64) ``E``
  goes up by one for that block only (the overflow bump, which is the ``even`` rule at 6 fraction
  bits), so codes stay in ±127. ``extras["scale_exponent"]`` holds ``E + 127`` as uint8.
  ``bfp16_quark`` is Quark's own convention: codes -128..127, ``E`` from fp32 ``log2``, bumped only
  when the block's positive max rounds to 128 (``quark_bfp_exponent``).
- ``none`` (fp16/bf16): a plain cast; qparams are scale 1, zero point 0 and the observed range.
"""

from __future__ import annotations

import torch

from observers.base import Observer, register
from observers.formats import ElementFormat
from observers.granularity import Flat
from observers.knobs import Knob
from observers.pick import first_least
from observers.qparams import SCALE_RULES, QParams, exact_divisor
from observers.quantize import element_codes
from observers.shared import EXACT_MIN_MAX, Op, part_min_max, shared_min_max
from observers.spec import QuantSpec
from observers.vocab import ScaleRounding

E8M0_BIAS = 127
E8M0_MIN_EXPONENT = -127
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
NVFP4_MAX_TENSOR_AMAX = 2.0**127
CT_ROUNDING_MAN_BITS = 1
"""compressed-tensors rounds every MX block amax at FP4 E2M1's one mantissa bit (``round_to_power_2``)."""
_MANTISSA_MASK = 0x007FFFFF


def _amax(min_val: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of a range that includes zero."""
    return torch.maximum(-min_val.clamp(max=0.0), max_val.clamp(min=0.0))


def _fp32_bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^exponent`` for integer exponents in ``[-149, 127]``, built from the bits."""
    exponent = exponent.to(torch.int32)
    normal = (exponent.clamp(min=-126) + 127) << 23
    subnormal = torch.bitwise_left_shift(torch.ones_like(exponent), exponent.clamp(-149, -127) + 149)
    return torch.where(exponent >= -126, normal, subnormal).view(torch.float32)


def shared_exponent(amax: torch.Tensor, fmt: ElementFormat, rounding: str) -> torch.Tensor:
    """Per-block MX exponent ``e`` (int32) of ``amax`` under ``rounding`` (floor, even or ceil).

    Exact: ``floor(log2 amax)`` is the fp32 exponent field, and the bumps compare mantissa bits
    (``even``: the mantissa rounded half-up to ``fmt.man_bits`` bits carries into the next binade;
    ``compressed-tensors``: the same at one mantissa bit for every element format, so MXFP8
    exponents differ from ``even`` in blocks whose amax mantissa is in [1.75, 1.9375);
    ``ceil``: the mantissa exceeds that of ``fmt.max_value``). Zero and fp32-subnormal amax take
    the smallest exponent. Clamped to ``[-127, 127 - emax]``.
    """
    allowed = [member.value for member in ScaleRounding]
    if rounding not in allowed:
        raise ValueError(f"scale rounding {rounding!r} is not valid; allowed: {', '.join(allowed)}")
    bits = amax.float().contiguous().view(torch.int32)
    field = bits >> 23
    mantissa = bits & _MANTISSA_MASK
    exponent = field - E8M0_BIAS
    normal = field > 0
    if rounding in (ScaleRounding.EVEN, ScaleRounding.COMPRESSED_TENSORS):
        man_bits = fmt.man_bits if rounding == ScaleRounding.EVEN else CT_ROUNDING_MAN_BITS
        threshold = (1 << 23) - (1 << (22 - man_bits))
        exponent = exponent + (normal & (mantissa >= threshold)).to(torch.int32)
    elif rounding == ScaleRounding.CEIL:
        max_mantissa = _fp32_bits(fmt.max_value) & _MANTISSA_MASK
        exponent = exponent + (normal & (mantissa > max_mantissa)).to(torch.int32)
    return (exponent - fmt.emax).clamp(E8M0_MIN_EXPONENT, E8M0_BIAS - fmt.emax)


def qparams_from_exponent(
    exponent: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, fmt: ElementFormat
) -> QParams:
    """QParams of power-of-two block scales ``2^exponent`` (MX, BFP).

    Integer elements (MXINT8, BFP16) get ``scale`` = the code step ``2^(exponent - man_bits)``; the
    uint8 code ``exponent + 127`` goes to ``extras["scale_exponent"]`` for a lossless export.
    """
    step_exponent = exponent - fmt.man_bits if fmt.kind == "int" else exponent
    scale = pow2(step_exponent).reshape(min_val.shape)
    codes = (exponent + E8M0_BIAS).to(torch.uint8).reshape(min_val.shape)
    zero_point = torch.zeros_like(scale, dtype=torch.int32)
    return QParams(scale, zero_point, min_val, max_val, extras={"scale_exponent": codes})


def e8m0_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """MX rule: one E8M0 exponent per block, rounded by ``spec.scale_rounding``."""
    exponent = shared_exponent(_amax(min_val, max_val), spec.format, spec.scale_rounding)
    return qparams_from_exponent(exponent, min_val, max_val, spec.format)


def pow2_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """BFP16 rule: shared exponent with the per-block overflow bump (``spec.scale_rounding`` unused);
    ``bfp16_quark`` (a format whose codes reach -128) takes Quark's rule instead."""
    if not spec.format.narrow_range:
        return qparams_from_exponent(quark_bfp_exponent(min_val, max_val), min_val, max_val, spec.format)
    exponent = shared_exponent(_amax(min_val, max_val), spec.format, ScaleRounding.EVEN)
    return qparams_from_exponent(exponent, min_val, max_val, spec.format)


def quark_bfp_exponent(min_val: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Quark's BFP16 shared exponent (``fake_quantize_bfp16``), int32 per block.

    ``E = floor(log2 amax)`` computed as Quark does, with fp32 ``log2`` (for an amax a few ulps
    below a power of two it gives the next binade); the code step is ``2^(E-6)``; ``E`` goes up by
    one only when a *positive* value rounds to code 128. A negative value never needs the bump:
    it may take code -128, which the format keeps (``bfp16`` instead bumps on either side so its
    codes stay in ±127). An all-zero block gets the smallest exponent.
    """
    amax = _amax(min_val, max_val)
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    exponent = torch.floor(torch.log2(safe))
    step = pow2((exponent - 6).clamp(min=-149))
    bump = torch.round(max_val.clamp(min=0.0) / step) >= 128
    exponent = torch.floor(torch.log2(torch.where(bump, safe * 2, safe)))
    exponent = torch.where(nonzero, exponent, torch.full_like(exponent, E8M0_MIN_EXPONENT))
    return exponent.clamp(E8M0_MIN_EXPONENT, E8M0_BIAS).to(torch.int32)


def e4m3_block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """NVFP4's block scales ``cast_e4m3(amax / max · global_scale)``, clamped to [2^-9, 448], as the
    exact fp32 values of E4M3 numbers (the one place of this rule; the searches call it too)."""
    raw = (block_amax / exact_divisor(fmt_max, block_amax) * global_scale).clamp_(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    return raw.to(torch.float8_e4m3fn).float()


def e4m3_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """NVFP4 rule: fp32 global scale per tensor, E4M3 scale per block (values exact in fp32)."""
    fmt = spec.format
    amax = _amax(min_val, max_val)
    tensor_amax = amax.max().clamp(min=spec.eps, max=NVFP4_MAX_TENSOR_AMAX)
    global_scale = (E4M3_MAX * fmt.max_value / tensor_amax).reshape(1)
    scale = e4m3_block_scales(amax, global_scale, fmt.max_value)
    zero_point = torch.zeros_like(scale, dtype=torch.int32)
    return QParams(scale, zero_point, min_val, max_val, global_scale=global_scale)


def cast_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec) -> QParams:
    """fp16/bf16: no scale (1) and no zero point; the range is kept for display."""
    scale = torch.ones_like(min_val)
    return QParams(scale, torch.zeros_like(scale, dtype=torch.int32), min_val, max_val)


SCALE_RULES.update({"e8m0": e8m0_qparams, "e4m3": e4m3_qparams, "pow2": pow2_qparams, "none": cast_qparams})


@register
class PlaceholderObserver(Observer):
    """No range estimation: fp16/bf16 are plain casts (Quark ``PlaceholderObserver``).

    ``qparams()`` gives scale 1, zero point 0 and the running min/max of everything observed,
    shape ``(1,)``, so the suite still reports the cast's error metrics. Only cast dtypes.
    """

    name = "placeholder"
    description = "fp16/bf16 cast only: no scale, reports the data's min/max (Quark PlaceholderObserver)"
    scale_kinds = ()
    shares_statistics = True
    merge_rule = EXACT_MIN_MAX

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def _observe(self, flat: Flat) -> None:
        low = torch.full((1,), torch.inf, device=flat.data.device)
        high = -low
        if flat.data.numel():
            low, high = flat.data.amin().float().reshape(1), flat.data.amax().float().reshape(1)
        low, high = shared_min_max(low, high, self._across)
        if self.min_val is not None:
            low, high = torch.minimum(self.min_val, low), torch.maximum(self.max_val, high)
        self.min_val, self.max_val = low, high

    def _reset_statistics(self) -> None:
        self.min_val = self.max_val = None

    def _qparams(self) -> QParams:
        return cast_qparams(self.min_val, self.max_val, self.spec)


@register
class MXExponentSearchObserver(Observer):
    """MX shared exponent chosen by error: per block try ``e, e-1, ..., e-scope`` and keep the lowest SSE.

    ``e`` is the exponent of ``spec.scale_rounding`` (floor by default); a smaller exponent halves
    the step and clips the block's top values, which wins when a block has one outlier and many
    small values. All candidates are fake-quantized at once (memory: ``scope + 1`` copies of the
    batch); ties keep the larger exponent. Memoryless: the qparams describe the last ``observe``
    call, like llm-compressor's ``memoryless_mse`` (weights are observed once).
    Knob: ``scope`` (default 2, at most 16). Reference: Quark ``PerBlockMXDiffsObserver``.
    MX dtypes only.
    """

    name = "mx_exponent_search"
    description = "MX: per block, try shared exponents e..e-scope and keep the lowest SSE (Quark PerBlockMXDiffs)"
    knobs = {
        "scope": Knob(
            2, int, low=0, high=16, doc="How many exponents below the rounded one are tried (memory: scope + 1 copies)"
        )
    }
    scale_kinds = ("e8m0",)
    shares_statistics = True
    merge_rule = "exact up to float rounding: block range agreed (MIN/MAX), each exponent's error summed (SUM)"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exponent: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        if self.spec.format.scale_kind != "e8m0":
            raise ValueError(f"observer {self.name!r} needs an MX dtype, not {self.spec.dtype!r}")

    def _reset_statistics(self) -> None:
        self.exponent = None

    def _observe(self, flat: Flat) -> None:
        fmt = self.spec.format
        self.min_val, self.max_val = shared_min_max(*part_min_max(flat), self._across)
        base = shared_exponent(_amax(self.min_val, self.max_val), fmt, self.spec.scale_rounding)
        offsets = torch.arange(self.scope + 1, device=base.device, dtype=torch.int32)
        candidates = (base.unsqueeze(0) - offsets.reshape(-1, *([1] * base.ndim))).clamp(min=E8M0_MIN_EXPONENT)
        sse = self._reduce(self._candidate_sse(flat, candidates), Op.SUM)
        best = first_least(sse, 0, keepdim=True)
        self.exponent = candidates.gather(0, best).squeeze(0)

    def _candidate_sse(self, flat: Flat, candidates: torch.Tensor) -> torch.Tensor:
        """Sum of squared errors per candidate and block, shape ``candidates.shape``."""
        fmt = self.spec.format
        count = candidates.shape[0]
        step_exponent = candidates - fmt.man_bits if fmt.kind == "int" else candidates
        scale = pow2(step_exponent).reshape(count, 1, *flat.qparam_shape, 1)
        data = flat.data.float().unsqueeze(0)
        codes = element_codes(data, scale, torch.zeros((), device=data.device), self.spec)
        error = codes.mul_(scale).sub_(data).square_()
        if flat.valid is not None:
            error.mul_(flat.valid)
        return error.sum(dim=(1, error.ndim - 1))

    def _qparams(self) -> QParams:
        return qparams_from_exponent(self.exponent, self.min_val, self.max_val, self.spec.format)
