"""Observer Lab's observer library: quantization observers as small, vectorized torch code.

Typical use::

    import observers as ob
    spec = ob.QuantSpec(dtype="int4", symmetric=True, strategy=ob.Strategy.GROUP, group_size=128)
    obs = ob.create("minmax", spec, kind="weight")   # ob.knob_specs("minmax"): its knobs' declarations
    obs.observe(w)
    qp = obs.qparams()
    w_hat = ob.fake_quantize(w, qp, spec)
    ob.error_metrics(w, w_hat, qp, spec)

This package imports torch only (no UI libraries).
"""

from observers import minmax  # noqa: F401, I001  (registers the min-max family; registry order is display order)
from observers import histogram, mse_grid  # noqa: F401  (registers the distribution-based observers)
from observers import blocks  # noqa: F401  (MX/NVFP4/BFP/cast scale rules and their observers)
from observers import nvfp4_search  # noqa: F401  (LC 0.14's NVFP4 searches, the aliases fouroversix/static_minmax)
from observers import modelopt_search  # noqa: F401  (ModelOpt 0.47 MSE, FP8 scale sweep, local Hessian, headroom)
from observers import sqnr_search, lwp_search  # noqa: F401  (AIMET SQNR, Quark layer-wise percentile)
from observers.actorder import activation_order_g_idx, column_importance
from observers.modelopt_search import local_hessian
from observers.base import (
    Observer,
    aliases,
    applicable,
    available,
    create,
    describe,
    knob_specs,
    knobs,
    merge_rule,
    observer_class,
    once_form,
    register,
)
from observers import awq  # noqa: F401  (AWQ's scale and clip candidates, issue 41)
from observers.awq import AWQ_KNOBS, AWQSpec
from observers.dynamic import dynamic_error_metrics, dynamic_fake_quantize, dynamic_qparams, dynamic_view_spec
from observers.formats import FORMATS, ElementFormat, get_format
from observers.granularity import Flat, flatten
from observers.gptq import (
    GPTQResult,
    GPTQSpec,
    HessianAccumulator,
    check_gptq_spec,
    gptq_quantize,
    gptq_quantize_fixed,
    hessian_of_rows,
    layer_output_error,
    output_energy,
)
from observers.knobs import Knob
from observers.metrics import HIGHER_IS_BETTER, METRIC_KEYS, compare_tensors, error_metrics, quantization_metrics
from observers.presets import PRESET_NAMES, preset
from observers.qparams import QParams, calculate_qparams, representable_range
from observers.quantize import dequantize, fake_quantize, quantize
from observers.spec import QuantSpec
from observers.suite import SuiteResult, results_frame, run_one, run_suite
from observers.transforms import TransformKind, TransformSpec, transform_layer, transform_states
from observers.vocab import STRATEGIES_BY_KIND, ObserverKind, ScaleRounding, ScaleRule, Strategy

__version__ = "0.1.0"

__all__ = [
    "AWQ_KNOBS",
    "AWQSpec",
    "FORMATS",
    "HIGHER_IS_BETTER",
    "METRIC_KEYS",
    "PRESET_NAMES",
    "STRATEGIES_BY_KIND",
    "ElementFormat",
    "Flat",
    "GPTQResult",
    "GPTQSpec",
    "HessianAccumulator",
    "Knob",
    "Observer",
    "ObserverKind",
    "QParams",
    "QuantSpec",
    "ScaleRounding",
    "ScaleRule",
    "Strategy",
    "SuiteResult",
    "TransformKind",
    "TransformSpec",
    "activation_order_g_idx",
    "aliases",
    "applicable",
    "available",
    "calculate_qparams",
    "check_gptq_spec",
    "column_importance",
    "compare_tensors",
    "create",
    "dequantize",
    "describe",
    "dynamic_error_metrics",
    "dynamic_fake_quantize",
    "dynamic_qparams",
    "dynamic_view_spec",
    "error_metrics",
    "quantization_metrics",
    "fake_quantize",
    "flatten",
    "get_format",
    "gptq_quantize",
    "gptq_quantize_fixed",
    "hessian_of_rows",
    "knob_specs",
    "knobs",
    "layer_output_error",
    "local_hessian",
    "merge_rule",
    "observer_class",
    "once_form",
    "output_energy",
    "preset",
    "quantize",
    "register",
    "representable_range",
    "results_frame",
    "run_one",
    "run_suite",
    "transform_layer",
    "transform_states",
]
