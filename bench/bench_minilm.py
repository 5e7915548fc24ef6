"""Real tensors: MiniLM's pretrained Linear weights and its captured FFN activations.

Weights: every Linear weight of all-MiniLM-L6-v2 (37 tensors, 10.8M parameters; the first 6 with
``--quick``), one observer per weight as a calibration run makes them. Activations: the inputs of
each layer's FFN up and down projections (``intermediate.dense``, ``output.dense``; real outliers,
absmax about 28 vs std 0.7) over 32 x 128 tokens of the built-in calibration text, captured once
before timing; one observer per tensor. References in this process on the same tensors.
"""

from __future__ import annotations

import observers as ob
from bench.common import SETTINGS, measure, observe
from bench.refs import (
    INT4_G128,
    lc_observer_ref,
    modelopt_ref,
    quark_histogram_ref,
    quark_observer_ref,
    tao_histogram_ref,
)
from sample_models import open_model

GROUP = ob.QuantSpec("int4", strategy="group", group_size=128)
INT8 = ob.QuantSpec("int8")
UINT8 = ob.QuantSpec("uint8", symmetric=False)


def _weight_cases(model, device: str) -> list[dict]:
    names = [info.name for info in model.layers() if info.type == "Linear"]
    names = names[:6] if SETTINGS.quick else names
    weights = [model.weight(name) for name in names]
    label = f"MiniLM {len(weights)} Linear weights ({sum(w.numel() for w in weights) / 1e6:.1f}M)"
    read = lambda: [w.sum() for w in weights]
    clone = lambda: [w.clone() for w in weights]
    rows = measure(
        f"{label}: memoryless_minmax int4 g128",
        lambda: [observe("memoryless_minmax", w, GROUP) for w in weights],
        read,
        device,
        [
            lc_observer_ref("memoryless_minmax", weights, INT4_G128),
            quark_observer_ref(
                "PerGroupMinMaxObserver", "Int4PerGroupSpec", weights, {"ch_axis": 1, "group_size": 128}
            ),
        ],
    )
    rows += measure(
        f"{label}: mse_grid int4 g128",
        lambda: [observe("mse_grid", w, GROUP) for w in weights],
        clone,
        device,
        [lc_observer_ref("memoryless_mse", weights, INT4_G128)],
    )
    return rows


def _activation_cases(model, device: str) -> list[dict]:
    layers = range(1) if SETTINGS.quick else range(6)
    names = [f"encoder.layer.{i}.{part}" for i in layers for part in ("intermediate.dense", "output.dense")]
    samples, seq_len = (8, 64) if SETTINGS.quick else (32, 128)
    captured = model.capture(names, samples=samples, seq_len=seq_len)
    acts = [captured[name] for name in names]
    label = f"MiniLM {len(acts)} FFN inputs ({captured.tokens} tokens)"
    read = lambda: [a.sum() for a in acts]

    def per_tensor(name: str, spec: ob.QuantSpec, **knobs):
        return lambda: [observe(name, a, spec, kind="activation", **knobs) for a in acts]

    rows = measure(
        f"{label}: entropy int8",
        per_tensor("entropy", INT8),
        read,
        device,
        [modelopt_ref("entropy", acts)],
    )
    rows += measure(
        f"{label}: histogram uint8 asym",
        per_tensor("histogram", UINT8),
        read,
        device,
        [tao_histogram_ref([[a] for a in acts])],
    )
    rows += measure(
        f"{label}: percentile 99.99 int8",
        per_tensor("percentile", INT8),
        read,
        device,
        [modelopt_ref("percentile", acts, percentile=99.99)],
    )
    rows += measure(
        f"{label}: percentile (Quark's knobs) int8",
        per_tensor("percentile", INT8, percentile=99.99999999, bins=4200),
        read,
        device,
        [quark_histogram_ref("percentile", acts)],
    )
    return rows


def cases(device: str = "cpu") -> list[dict]:
    model = open_model("minilm", device=device)
    return [*_weight_cases(model, device), *_activation_cases(model, device)]
