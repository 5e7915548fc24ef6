"""NVIDIA ModelOpt 0.47's search calibrators: the amax-multiplier MSE search, the NVFP4 FP8
block-scale sweep, its local-Hessian variant, and the NVFP4 activation global scale with headroom.

- ``modelopt_mse`` (``MseCalibrator``): every group's max-calibrated amax times each multiplier
  of ``linspace(0.25, 4.0, ceil(3.75 / 0.1) + 1)`` (39 values, so the step is 3.75/38, not 0.1);
  each group keeps the multiplier of least ``Σ (x - fake_quant(x))²`` (first on ties). Unlike
  ``mse_grid`` it also tries ranges *wider* than the data, which can win for formats whose grid
  is not uniform.
- ``nvfp4_fp8_sweep`` (``NVFP4MSECalibrator``, ``mse_calibrate(fp8_scale_sweep=True)``): the global
  scale stays the max-calibrated ``448·6 / amax_tensor``; every block tries all 126 finite positive
  E4M3 values as its block scale and keeps the one of least squared error. Max calibration rounds
  ``amax_block / 6`` to one E4M3 value; the sweep can pick any.
- ``local_hessian`` (``local_hessian_calibrate``): the same sweep, but a block's error is
  ``dwᵀ H dw`` with ``dw = w - fake_quant(w)`` over the block's 16 input columns and ``H`` the
  mean of ``x xᵀ`` of those columns over the captured inputs (``observe_inputs`` or the
  ``hessian`` knob): the error that block adds to the layer output, to second order.
- ``nvfp4_act_headroom`` (``NVFP4ActHeadroomCalibrator``): for NVFP4 activations, the global amax
  is ``max(rho·anchor, upper)`` with ``anchor``/``upper`` percentiles (1, 99.99) of the per-block
  amax distribution (a 512-bin histogram of ``log2`` block amax over [-40, 40], read at bin
  centres), so calibrated blocks sit low in the E4M3 range and larger run-time blocks still fit.

Every candidate is scored by this library's fake quantization (``observers.quantize``), so the
errors are those of the qparams the observer reports; ModelOpt multiplies by ``bound / amax``
where we divide by the scale, which can only flip a pick whose two best errors tie to an ulp.
On fp32 CPU data the picks come from the native kernels (``float_grid_kernel``; for ``local_hessian``
``block_hessian_kernel``) where they take the data: the same codes bit for bit, the errors summed in
another order (a few ulps), the eager torch path otherwise.
"""

from __future__ import annotations

import math
import warnings

import torch

from observers import block_hessian_kernel, float_grid_kernel, mse_kernel
from observers.base import Observer, register
from observers.blocks import E4M3_MAX, NVFP4_MAX_TENSOR_AMAX, _amax, e4m3_block_scales
from observers.fused import GROUP_GLOBAL_SCALE, check_group_global_scale
from observers.granularity import Flat, all_finite, group_rows, reduce_min_max
from observers.knobs import Knob
from observers.mse_grid import MAX_WORKING_BYTES
from observers.pick import first_least
from observers.qparams import QParams, calculate_qparams, range_rule
from observers.quantize import element_codes
from observers.shared import Op, Reduce
from observers.spec import QuantSpec
from observers.vocab import ObserverKind


def fp8_scale_candidates(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 126 finite positive E4M3 values in increasing order (codes 1..126), fp32."""
    codes = torch.arange(1, 127, dtype=torch.uint8, device=device)
    return codes.view(torch.float8_e4m3fn).float()


def multiplier_candidates(start: float, stop: float, step: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """ModelOpt's amax multipliers: ``linspace(start, stop, ceil((stop - start) / step) + 1)``, fp32;
    ``start`` alone when ``stop <= start`` (ModelOpt refuses a stop below the start)."""
    return torch.linspace(start, stop, steps=max(1, math.ceil((stop - start) / step) + 1), device=device)


def candidate_errors(
    flat: Flat,
    spec: QuantSpec,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    max_working_bytes: int,
    hessian: torch.Tensor | None = None,
) -> torch.Tensor:
    """Error of each candidate per qparam group, shape ``(C, *qparam_shape)``.

    ``scale`` (and ``zero_point``, integer formats) are ``(C, *qparam_shape)`` or ``(C,)``: the
    element step of each candidate. The error is ``Σ (x - fake_quant(x))²`` over the group's real
    elements, or with ``hessian`` ``(groups_per_row, K, K)`` the block form ``Σ dwᵀ H dw`` (weights
    whose groups are whole Hessian blocks). Candidates run in chunks of about
    ``max_working_bytes``; each chunk is a few tensor ops over all groups.
    """
    if spec.format.kind == "int" and hessian is None:
        native = _native_squared_errors(flat, spec, scale, zero_point)
        if native is not None:
            return native
    if hessian is None:
        native = _native_float_errors(flat, spec, scale)
        if native is not None:
            return native
    data = flat.data.float()
    count = scale.shape[0]
    shape = (count, 1, *flat.qparam_shape, 1) if scale.ndim > 1 else (count, *([1] * data.ndim))
    scale = scale.reshape(shape)
    zero_point = torch.zeros((), device=data.device) if zero_point is None else zero_point.float().reshape(shape)
    per_chunk = max(1, min(count, max_working_bytes // max(1, data.numel() * 8)))
    errors = []
    for first in range(0, count, per_chunk):
        s = scale[first : first + per_chunk]
        z = zero_point if zero_point.ndim == 0 else zero_point[first : first + per_chunk]
        codes = element_codes(data.unsqueeze(0), s, z, spec)
        dequantized = codes.sub_(z).mul_(s) if spec.format.kind == "int" else codes.mul_(s)
        diff = torch.sub(data.unsqueeze(0), dequantized, out=dequantized)
        if hessian is not None:
            errors.append(_hessian_error(diff, hessian))
            continue
        square = diff.square_()
        if flat.valid is not None:
            square.mul_(flat.valid)
        errors.append(square.sum(dim=(1, square.ndim - 1)))
    return torch.cat(errors)


def _native_squared_errors(
    flat: Flat, spec: QuantSpec, scale: torch.Tensor, zero_point: torch.Tensor | None
) -> torch.Tensor | None:
    """``candidate_errors`` for integer formats through ``observers.mse_kernel`` (one read of each
    group for all candidates), or None when that kernel does not take the data. The kernel
    measures ``Σ (code - x/s)²`` in steps with the codes of ``fake_quantize``; times ``s²`` that
    is the squared error up to fp32 rounding, which can only flip a pick whose two best
    candidates tie to a few ulps."""
    data, weight = group_rows(flat)
    groups = data.shape[1]
    count = scale.shape[0]
    step = scale.float().reshape(count, -1).expand(count, groups).contiguous()
    qmin, qmax = spec.int_range
    if zero_point is None:
        low, high = float(qmin), float(qmax)
    else:
        zero = zero_point.float().reshape(count, -1).expand(count, groups)
        low, high = (qmin - zero).contiguous(), (qmax - zero).contiguous()
    errors = mse_kernel.candidate_errors(data, weight, step, low, high, 2.0)
    if errors is None:
        return None
    return errors.mul_(step.square()).reshape(count, *flat.qparam_shape)


def best_candidates(
    flat: Flat,
    spec: QuantSpec,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    max_working_bytes: int,
    hessian: torch.Tensor | None = None,
) -> torch.Tensor:
    """``first_least(candidate_errors(...), 0)``: each group's first candidate of least error,
    ``(*qparam_shape)``. Float element grids on one observation of fp32 CPU data take the kernel's
    pick (``float_grid_kernel.candidate_picks``), which never writes the ``(C, Q)`` errors: for the
    FP8 sweep's 126 candidates that table and its scan cost more than the errors. With a Hessian
    (``local_hessian``) the pick is ``block_hessian_kernel``'s when it takes the data. The errors are
    never NaN here (finite data, positive steps), where the pick and ``argmin`` would differ."""
    if hessian is not None:
        picked = _native_hessian_picks(flat, spec, scale, hessian)
        if picked is not None:
            return picked
    elif float_grid_kernel.covers(spec.format):
        data, weight = group_rows(flat)
        count = scale.shape[0]
        step = scale.float().reshape(count) if scale.ndim == 1 else scale.float().reshape(count, data.shape[1])
        picked = float_grid_kernel.candidate_picks(data, weight, step, spec.format, 2.0, direct=True)
        if picked is not None:
            return picked[1].reshape(flat.qparam_shape)
    return first_least(candidate_errors(flat, spec, scale, zero_point, max_working_bytes, hessian), 0)


def _native_hessian_picks(
    flat: Flat, spec: QuantSpec, scale: torch.Tensor, hessian: torch.Tensor
) -> torch.Tensor | None:
    """``local_hessian``'s pick through ``block_hessian_kernel`` (the form ``dwᵀ H_b dw`` of every
    candidate per row and block, without the ``(C, rows, blocks)`` errors), or None when it does not
    take the data: one observation of whole blocks (no padding) and one step per candidate."""
    if flat.data.shape[0] != 1 or flat.valid is not None or scale.ndim != 1:
        return None
    blocks, size = flat.data.shape[-2:]
    data = flat.data.float().reshape(-1, blocks, size)
    picked = block_hessian_kernel.hessian_picks(data, hessian.float(), scale.float(), spec.format)
    return None if picked is None else picked[1].reshape(flat.qparam_shape)


def _nvfp4_picks(
    flat: Flat, spec: QuantSpec, amax: torch.Tensor, multipliers: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor | None:
    """``modelopt_mse``'s NVFP4 pick with the kernel computing every candidate's block scale itself,
    ``e4m3_block_scales(m·amax, global_scale) / global_scale`` in the same fp32 operations (the E4M3
    cast inside the candidate loop), or None when it does not take the data. Why: the ``(C, Q)``
    step table (39 multipliers over every block) costs more to build than the errors."""
    data, weight = group_rows(flat)
    if not float_grid_kernel.pickable(data, weight, spec.format):
        return None
    count = multipliers.numel()
    global_scale = global_scale.float().reshape(1).expand(count)
    rule = float_grid_kernel.StepRule(
        "e4m3", amax.reshape(-1), multipliers, spec.format.max_value, global_scale=global_scale
    )
    picked = float_grid_kernel.candidate_picks(data, weight, rule, spec.format, 2.0, direct=True)
    return None if picked is None else picked[1].reshape(flat.qparam_shape)


def _native_float_errors(flat: Flat, spec: QuantSpec, scale: torch.Tensor) -> torch.Tensor | None:
    """``candidate_errors`` for float element grids (FP8, FP4, NVFP4's E2M1 with its E4M3 block
    scales already in ``scale``) through ``observers.float_grid_kernel``, or None when it does not
    take the data. The kernel measures ``(grid(x/s)·s - x)²`` directly, with the codes and
    dequantized values of ``fake_quantize`` and an exact square; only the fp32 sums run in another
    order. A ``(C,)`` scale (the FP8 sweep's one step per candidate) is read once per candidate."""
    if not float_grid_kernel.covers(spec.format):
        return None
    data, weight = group_rows(flat)
    count = scale.shape[0]
    step = (
        scale.float().reshape(count)
        if scale.ndim == 1
        else scale.float().reshape(count, -1).expand(count, data.shape[1])
    )
    errors = float_grid_kernel.candidate_errors(data, weight, step, spec.format, 2.0, direct=True)
    return None if errors is None else errors.reshape(count, *flat.qparam_shape)


def _hessian_error(diff: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """``Σ_n dwᵀ H_b dw`` per candidate, row and block: ``diff`` ``(C, N, Q, B, K)``, ``hessian``
    ``(B, K, K)`` -> ``(C, Q, B)``: one batched matmul over the blocks, then a row-wise dot."""
    count, observations, rows, blocks, size = diff.shape
    by_block = diff.permute(3, 0, 1, 2, 4).reshape(blocks, -1, size)
    weighted = torch.bmm(by_block, hessian).mul_(by_block).sum(dim=-1)
    return weighted.reshape(blocks, count, observations, rows).sum(dim=2).permute(1, 2, 0)


def nvfp4_global_scale(global_amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """NVFP4's global scale of a chosen global amax (not necessarily the blocks' max),
    ``448·max / global_amax``, one fp32 element."""
    return (E4M3_MAX * fmt_max / global_amax.clamp(max=NVFP4_MAX_TENSOR_AMAX)).reshape(1).float()


def nvfp4_qparams(
    block_scale: torch.Tensor, global_scale: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor
) -> QParams:
    """NVFP4 QParams from E4M3 block scale values and a global scale; the element step is
    ``block_scale / global_scale``."""
    zero_point = torch.zeros_like(block_scale, dtype=torch.int32)
    return QParams(block_scale, zero_point, min_val, max_val, global_scale=global_scale.float().reshape(1))


_MULTIPLIER_KNOBS = {
    "start_multiplier": Knob(0.25, float, low=0, low_open=True, doc="Smallest amax multiplier tried"),
    "stop_multiplier": Knob(4.0, float, low=0, low_open=True, doc="Largest amax multiplier tried"),
    "step_size": Knob(
        0.1, float, low=0, low_open=True, doc="Multiplier step: ceil((stop - start) / step) + 1 evenly spaced values"
    ),
    "max_working_bytes": MAX_WORKING_BYTES,
    "group_global_scale": GROUP_GLOBAL_SCALE,
}


@register
class ModelOptMSEObserver(Observer):
    """ModelOpt's amax-multiplier MSE search: each group's amax times 0.25 … 4.0, least squared error.

    Rule: ``amax`` per group from the observed ``(min, max)``; candidates ``m·(min, max)`` for
    ``m`` in ``linspace(start_multiplier, stop_multiplier, ceil((stop - start) / step_size) + 1)``
    (defaults 0.25, 4.0, 0.1: 39 multipliers; only ``start`` when ``stop <= start``); each group
    keeps the ``m`` with least ``Σ (x - fake_quant(x))²``, the first on ties. Symmetric specs
    search ``±m·amax``, asymmetric ones scale both ends. Memoryless (ModelOpt refines weights, observed once).
    Knobs: ``start_multiplier`` 0.25, ``stop_multiplier`` 4.0, ``step_size`` 0.1, ``max_working_bytes``;
    on NVFP4 ``group_global_scale``, the global scale of the fused group the weight is served in,
    which the search then runs under instead of the weight's own (``observers.fused``).
    Reference: ModelOpt 0.47 ``MseCalibrator`` (``mse_calibrate``, no ``fp8_scale_sweep``).
    For ModelOpt's own integer scales use ``QuantSpec(scale_rule="qmax")``.
    """

    name = "modelopt_mse"
    description = "Group amax times 39 multipliers from 0.25 to 4.0, least squared error (ModelOpt 0.47 MseCalibrator)"
    knobs = dict(_MULTIPLIER_KNOBS)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None
        self.global_amax: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        check_group_global_scale(self.group_global_scale, self.spec)

    def _reset_statistics(self) -> None:
        self.min_val = self.max_val = self.global_amax = None

    def _observe(self, flat: Flat) -> None:
        low, high = reduce_min_max(flat)
        if self.spec.symmetric or self.spec.format.kind != "int":
            high = _amax(low, high)
            low = -high
        self.global_amax = high.max().clamp(min=self.spec.eps)
        multipliers = multiplier_candidates(self.start_multiplier, self.stop_multiplier, self.step_size, low.device)
        picks = None
        if self.spec.format.scale_kind == "e4m3":
            picks = _nvfp4_picks(flat, self.spec, high, multipliers, self._global_scale())
        if picks is None:
            factor = multipliers.reshape(-1, *([1] * low.ndim))
            scale, zero_point = self._candidate_steps(low.unsqueeze(0) * factor, high.unsqueeze(0) * factor)
            picks = best_candidates(flat, self.spec, scale, zero_point, self.max_working_bytes)
        best = multipliers[picks]
        self.min_val, self.max_val = low * best, high * best

    def _candidate_steps(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Element step and zero point of every candidate range, ``(C, *qparam_shape)``: one call of
        the spec's range rule over all candidates, except NVFP4, whose global scale stays the
        max-calibrated one while the block amaxes move (as ModelOpt keeps ``global_amax``)."""
        if self.spec.format.scale_kind == "e4m3":
            global_scale = self._global_scale()
            scale = e4m3_block_scales(high, global_scale, self.spec.format.max_value) / global_scale
            return scale, torch.zeros_like(scale, dtype=torch.int32)
        qp = range_rule(low, high, self.spec)
        return qp.effective_scale.expand_as(low), qp.zero_point.expand_as(low)

    def _global_scale(self) -> torch.Tensor:
        """The weight's own max-calibrated global scale, or its fused group's when given."""
        if self.group_global_scale is not None:
            return self.group_global_scale.float().reshape(1).to(self.global_amax.device)
        return nvfp4_global_scale(self.global_amax, self.spec.format.max_value)

    def _qparams(self) -> QParams:
        if self.spec.format.scale_kind != "e4m3":
            return calculate_qparams(self.min_val, self.max_val, self.spec)
        global_scale = self._global_scale()
        scale = e4m3_block_scales(self.max_val, global_scale, self.spec.format.max_value)
        return nvfp4_qparams(scale, global_scale, self.min_val, self.max_val)

    def _choose_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val


class _NVFP4SweepBase(Observer):
    """Shared NVFP4 FP8 scale sweep: fixed max-calibrated global scale, every E4M3 block scale tried."""

    kinds = (ObserverKind.WEIGHT,)
    scale_kinds = ("e4m3",)
    knobs = {"max_working_bytes": MAX_WORKING_BYTES, "group_global_scale": GROUP_GLOBAL_SCALE}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block_scale: torch.Tensor | None = None
        self.global_amax: torch.Tensor | None = None
        self.global_scale: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        if self.spec.format.scale_kind != "e4m3":
            raise ValueError(f"observer {self.name!r} needs dtype 'nvfp4', not {self.spec.dtype!r}")
        check_group_global_scale(self.group_global_scale, self.spec)

    def _reset_statistics(self) -> None:
        self.block_scale = self.global_amax = self.global_scale = None

    def _hessian(self, flat: Flat) -> torch.Tensor | None:
        return None

    def _observe(self, flat: Flat) -> None:
        low, high = reduce_min_max(flat)
        fmt_max = self.spec.format.max_value
        if self.group_global_scale is None:
            self.global_amax = _amax(low, high).max().clamp(min=self.spec.eps)
            self.global_scale = nvfp4_global_scale(self.global_amax, fmt_max)
        else:
            self.global_scale = self.group_global_scale.float().reshape(1).to(low.device)
            self.global_amax = (E4M3_MAX * fmt_max / self.global_scale).reshape(())
        candidates = fp8_scale_candidates(low.device)
        picks = best_candidates(
            flat, self.spec, candidates / self.global_scale, None, self.max_working_bytes, self._hessian(flat)
        )
        self.block_scale = candidates[picks]

    def _qparams(self) -> QParams:
        amax = self.global_amax * (self.block_scale / E4M3_MAX)  # ModelOpt's global_amax · candidate
        return nvfp4_qparams(self.block_scale, self.global_scale, -amax, amax)


@register
class NVFP4FP8SweepObserver(_NVFP4SweepBase):
    """NVFP4 weights: every block tries all 126 E4M3 block scales, least squared error.

    Rule: the global scale is the max-calibrated ``448·6 / max|w|``; for each block of 16 the
    candidates are the block scales ``v`` over all finite positive E4M3 values (element step
    ``v / global_scale``, i.e. block amax ``max|w|·v/448``); each block keeps the ``v`` of least
    ``Σ (w - fake_quant(w))²``, the smallest on ties. Memoryless; weights only, dtype nvfp4.
    Reference: ModelOpt 0.47 ``NVFP4MSECalibrator`` (``mse_calibrate(fp8_scale_sweep=True)``);
    ModelOpt's sweep runs a Triton kernel (CUDA) or its Python reference sweep, which this follows.
    """

    name = "nvfp4_fp8_sweep"
    description = "NVFP4: every block tries all 126 E4M3 scales, least squared error (ModelOpt 0.47 NVFP4MSECalibrator)"


@register
class LocalHessianObserver(_NVFP4SweepBase):
    """``nvfp4_fp8_sweep`` with each block's error weighted by the local Hessian of its inputs.

    Rule: as ``nvfp4_fp8_sweep``, block error ``dwᵀ H_b dw`` (``dw = w - fake_quant(w)`` over the
    block's 16 input columns, ``H_b`` the mean of ``x_b x_bᵀ`` over the captured input tokens), the
    second-order estimate of the error the block adds to the layer's output. ``H`` comes from the
    ``hessian`` knob (``(in/16, 16, 16)``, e.g. ``observers.modelopt_search.local_hessian(inputs)``)
    or from ``observe_inputs(x)`` calls (summed ``xᵀx`` over all batches, divided by the token
    count). Without inputs, or when ``in`` is not a multiple of 16, it warns and runs the plain
    sweep, as ModelOpt falls back to plain MSE. Memoryless; weights only, dtype nvfp4 (group 16).
    Reference: ModelOpt 0.47 ``local_hessian_calibrate`` (``fp8_scale_sweep=True``, block 16).
    """

    name = "local_hessian"
    description = (
        "NVFP4 E4M3 scale sweep, block error dwᵀ·H·dw with H = mean x·xᵀ of inputs (ModelOpt 0.47 local_hessian)"
    )
    knobs = {
        **_NVFP4SweepBase.knobs,
        "hessian": Knob(
            None,
            torch.Tensor,
            optional=True,
            editable=False,
            expects="a float tensor of shape (in/16, 16, 16)",
            doc="Per-block input Hessian mean(x·xᵀ); None uses what observe_inputs collected",
        ),
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._input_products: torch.Tensor | None = None
        self._input_count = 0

    def validate_knobs(self) -> None:
        super().validate_knobs()
        if self.spec.group_size != 16:
            raise ValueError(f"local_hessian needs NVFP4 blocks of 16, got group_size={self.spec.group_size}")
        h = self.hessian
        if h is not None and (h.ndim != 3 or h.shape[1:] != (16, 16) or not h.dtype.is_floating_point):
            raise ValueError(f"hessian must be a float tensor of shape (in/16, 16, 16), got {tuple(h.shape)} {h.dtype}")
        if h is not None and not all_finite(h):
            raise ValueError("hessian must be finite")

    def observe_inputs(self, x: torch.Tensor) -> None:
        """Add one batch of the layer's inputs ``(..., in)`` to the per-block ``Σ x xᵀ`` (fp32)."""
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.numel() == 0 or not x.dtype.is_floating_point:
            raise ValueError("observe_inputs needs a non-empty floating-point tensor shaped (..., in_features)")
        if not all_finite(x):
            raise ValueError(f"observe_inputs got {int((~torch.isfinite(x)).sum())} non-finite value(s)")
        products, tokens = _block_products(x, 16)
        if products is None:
            raise ValueError(f"observe_inputs needs in_features divisible by 16, got {x.shape[-1]}")
        if self._input_products is not None and self._input_products.shape != products.shape:
            raise ValueError(f"observe_inputs got {x.shape[-1]} columns, earlier batches had another count")
        self._input_products = products if self._input_products is None else self._input_products + products
        self._input_count += tokens

    def _hessian(self, flat: Flat) -> torch.Tensor | None:
        hessian = self.hessian
        if hessian is None and self._input_products is not None:
            hessian = self._input_products / self._input_count
        if hessian is None or flat.valid is not None:
            reason = "no inputs were observed" if hessian is None else "the input width is not a multiple of 16"
            warnings.warn(f"local_hessian: {reason}; running the plain NVFP4 sweep", stacklevel=4)
            return None
        blocks = flat.qparam_shape[-1]
        if hessian.shape[0] != blocks:
            raise ValueError(f"hessian has {hessian.shape[0]} blocks but the weight has {blocks} blocks of 16")
        return hessian.to(device=flat.data.device, dtype=torch.float32)


def _block_products(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor | None, int]:
    """``(Σ x_b x_bᵀ per block of input columns, tokens)``: ``(in/bs, bs, bs)`` fp32, or None when
    ``in`` is not a multiple of ``block_size``."""
    columns = x.shape[-1]
    if columns % block_size:
        return None, 0
    rows = x.reshape(-1, columns).float().t().reshape(columns // block_size, block_size, -1)
    return rows @ rows.transpose(-1, -2), x.numel() // columns


def local_hessian(inputs: torch.Tensor, block_size: int = 16, across: Reduce | None = None) -> torch.Tensor:
    """Per-block input Hessian ``mean over tokens of x_b x_bᵀ``, ``(in/bs, bs, bs)`` fp32, the
    ``hessian`` knob of ``local_hessian`` (ModelOpt's ``_LocalHessianAccumulator``). ``across``:
    ``inputs`` is one rank's part (``observers.shared``; it may be empty), the mean is over
    every rank's tokens."""
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0 or (inputs.numel() == 0 and across is None):
        raise ValueError("local_hessian needs a non-empty tensor shaped (..., in_features)")
    products, tokens = _block_products(inputs, block_size)
    if products is None:
        raise ValueError(f"local_hessian needs in_features divisible by {block_size}, got {inputs.shape[-1]}")
    if across is not None:
        products = across(products.double(), Op.SUM).float()
        tokens = int(across(torch.tensor([tokens], device=inputs.device), Op.SUM))
        if tokens == 0:
            raise ValueError("local_hessian needs inputs: no rank has any token")
    return products / tokens


_FP8_NORMAL_RANGE = 448.0 / 2.0**-6
"""E4M3's normal dynamic range (448 / 2^-6 = 28672): ``rho`` must stay below it."""
_ANCHOR_FLOOR_RATIO = 1e6


@register
class NVFP4ActHeadroomObserver(Observer):
    """NVFP4 activations: global amax placed with headroom above the calibrated block amaxes.

    Rule: a 512-bin histogram of ``log2`` of every block's amax (per token and block of 16, zero
    blocks skipped) over [-40, 40], and the running max. ``upper`` is the value at
    ``upper_percentile`` (99.99; 100 takes the running max), ``anchor`` the value at
    ``anchor_percentile`` (1) among blocks above ``upper / 1e6``, each read at its bin's centre
    (the first bin where the cumulative count reaches the target). Global amax
    ``= rho·anchor`` (``rho`` 16384) when that exceeds ``upper``, else ``upper`` (with a warning);
    the running max when the percentiles collapse. Block scales (the static summary of each block
    column; at run time NVFP4 activations recompute them) are the running per-block amax through
    the NVFP4 rule with that global scale, so blocks above ``upper`` clip.
    Knobs: ``anchor_percentile`` 1, ``upper_percentile`` 99.99, ``rho`` 16384, ``bins`` 512,
    ``log2_min`` -40, ``log2_max`` 40. Dtype nvfp4; meant for activations (ModelOpt applies it to
    input quantizers), accepted on weights too.
    Reference: ModelOpt 0.47 ``NVFP4ActHeadroomCalibrator`` (``nvfp4_act_headroom``).
    """

    name = "nvfp4_act_headroom"
    description = "NVFP4 activations: global amax = max(rho·p1, p99.99) of log2 block amaxes (ModelOpt 0.47 headroom)"
    scale_kinds = ("e4m3",)
    shares_statistics = True
    merge_rule = "exact: the ranks' log2 block-amax counts summed (SUM), their block maxima combined (MAX)"
    knobs = {
        "anchor_percentile": Knob(
            1.0, float, low=0, high=100, low_open=True, doc="Percentile of block amaxes used as the anchor"
        ),
        "upper_percentile": Knob(
            99.99, float, low=0, high=100, low_open=True, doc="Percentile of block amaxes kept unclipped (100: max)"
        ),
        "rho": Knob(
            16384.0,
            float,
            low=0,
            high=_FP8_NORMAL_RANGE,
            low_open=True,
            high_open=True,
            doc="Headroom factor on the anchor",
        ),
        "bins": Knob(512, int, low=1, doc="Bins of the log2 block-amax histogram"),
        "log2_min": Knob(-40.0, float, low=-160, high=0, high_open=True, doc="Low end of the log2 histogram range"),
        "log2_max": Knob(40.0, float, low=0, high=160, low_open=True, doc="High end of the log2 histogram range"),
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: torch.Tensor | None = None
        self.running_max: torch.Tensor | None = None
        self.block_max: torch.Tensor | None = None

    def validate_knobs(self) -> None:
        if self.spec.format.scale_kind != "e4m3":
            raise ValueError(f"observer {self.name!r} needs dtype 'nvfp4', not {self.spec.dtype!r}")

    def _reset_statistics(self) -> None:
        self.counts = self.running_max = self.block_max = None

    def _bin_index(self, log2_values: torch.Tensor) -> torch.Tensor:
        position = (log2_values - self.log2_min) / (self.log2_max - self.log2_min)
        return (position * self.bins).floor().long().clamp_(0, self.bins - 1)

    def _observe(self, flat: Flat) -> None:
        data = flat.data.float().abs()
        if flat.valid is not None:
            data = data * flat.valid
        block_amax = data.amax(dim=-1) if data.numel() else data.sum(dim=-1)
        column_max = (
            block_amax.amax(dim=0) if block_amax.numel() else torch.zeros(flat.qparam_shape, device=data.device)
        )
        column_max = self._reduce(column_max, Op.MAX)
        self.block_max = column_max if self.block_max is None else torch.maximum(self.block_max, column_max)
        batch_max = column_max.max()
        self.running_max = batch_max if self.running_max is None else torch.maximum(self.running_max, batch_max)
        nonzero = block_amax[block_amax > 0]
        counts = torch.bincount(self._bin_index(torch.log2(nonzero)), minlength=self.bins)
        counts = self._reduce(counts, Op.SUM)
        self.counts = counts if self.counts is None else self.counts + counts

    def _percentile(self, percentile: float, floor_value: float | None = None) -> float | None:
        counts = self.counts.float()
        if floor_value is not None and floor_value > 0:
            floor_bin = int(self._bin_index(torch.log2(torch.tensor(floor_value))))
            counts[:floor_bin] = 0
        total = counts.sum()
        if total <= 0:
            return None
        cdf = torch.cumsum(counts, dim=0)
        index = int(torch.searchsorted(cdf, percentile / 100.0 * total).clamp(0, self.bins - 1))
        return float(2.0 ** (self.log2_min + (index + 0.5) / self.bins * (self.log2_max - self.log2_min)))

    def global_amax(self) -> torch.Tensor:
        """The headroom global amax (ModelOpt's ``compute_amax``), a 0-d fp32 tensor."""
        running = float(self.running_max)
        upper = running if self.upper_percentile >= 100.0 else self._percentile(self.upper_percentile)
        anchor = self._percentile(self.anchor_percentile, upper / _ANCHOR_FLOOR_RATIO) if upper else None
        if not upper or upper <= 0 or not anchor or anchor <= 0:
            return self.running_max.clone().float()
        amax = self.rho * anchor
        if amax <= upper:
            warnings.warn(
                f"nvfp4_act_headroom: block amax span {upper / anchor:.1f} leaves no headroom at rho={self.rho:g}; "
                "the global amax falls back to the upper percentile",
                stacklevel=3,
            )
            amax = upper
        return torch.tensor(amax, dtype=torch.float32, device=self.running_max.device)

    def _qparams(self) -> QParams:
        fmt = self.spec.format
        global_scale = nvfp4_global_scale(self.global_amax().clamp(min=self.spec.eps), fmt.max_value)
        amax = self.block_max.reshape(self._qparam_shape)
        scale = e4m3_block_scales(amax, global_scale, fmt.max_value)
        return nvfp4_qparams(scale, global_scale, -amax, amax)
