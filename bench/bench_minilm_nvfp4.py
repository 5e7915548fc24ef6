"""Whole-MiniLM NVFP4 weight sweep (issue 26): every Linear weight of all-MiniLM-L6-v2 (37 tensors,
10.8M parameters; the first 6 with ``--quick``) through the observers a lab run on an NVFP4 weight
spec compares by default (``lab.analyse.run_config.default_observers``: every registered observer
that takes an NVFP4 weight and is not tuned for another format), one observer per weight, each
observer a row, and their sum.

The references run on layer 0's six weights (1.8M), labelled: our eager path (``kernels.disabled()``,
all observers in one call, scales compared exactly) takes about a minute a pass there, and
llm-compressor's ``nvfp4_expanded_mse`` about 5 s per million weights; the whole model would take
each of them tens of minutes per timed run. The observers that read the layer's inputs get them as
the lab gives them (``lab.calibrate.observed.INPUT_STATISTICS``: the ``importance`` and ``hessian``
knobs, from 32 x 128 tokens of the built-in calibration text captured once before timing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import observers as ob
from bench.common import SETTINGS, Ref, case, measure, scales_agree
from bench.refs import LC_NVFP4_ARGS, lc_observer_ref
from lab.analyse.run_config import default_observers
from lab.calibrate.observed import INPUT_STATISTICS
from observers import kernels
from sample_models import open_model

NVFP4 = ob.QuantSpec("nvfp4")
EAGER = "ours, eager path (kernels.disabled())"


def _input_knobs(model, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per layer, every input statistic the lab would fill (``{layer: {knob: tensor}}``)."""
    samples, seq_len = (8, 64) if SETTINGS.quick else (32, 128)
    captured = model.capture(names, samples=samples, seq_len=seq_len)
    return {name: {knob: stat(captured[name]) for knob, stat in INPUT_STATISTICS.items()} for name in names}


def _sweep(observer: str, weights: list[torch.Tensor], knobs: list[dict]) -> Callable[[], list[ob.QParams]]:
    """One fresh ``observer`` per weight with that layer's input knobs it takes: observe, qparams."""
    taken = set(ob.knobs(observer))
    per_layer = [{k: v for k, v in layer.items() if k in taken} for layer in knobs]

    def run() -> list[ob.QParams]:
        out = []
        for w, layer_knobs in zip(weights, per_layer, strict=True):
            obs = ob.create(observer, NVFP4, **layer_knobs)
            obs.observe(w)
            out.append(obs.qparams())
        return out

    return run


def _same_scales(ours: list[ob.QParams], theirs: list[ob.QParams]) -> str:
    """Exact comparison with the eager path over every weight."""
    a = torch.cat([qp.scale.flatten() for qp in ours])
    b = torch.cat([qp.scale.flatten() for qp in theirs])
    same = float((a == b).float().mean())
    return "identical scales" if same == 1.0 else f"{same:.4%} identical scales"


def _eager(run: Callable[[], list[ob.QParams]]) -> Ref:
    def eager() -> list[ob.QParams]:
        with kernels.disabled():
            return run()

    return Ref(EAGER, eager, _same_scales)


def _layer0(names: list[str], weights: list[torch.Tensor], knobs: list[dict]) -> tuple[str, list, list]:
    """Layer 0's weights and knobs, and their label."""
    kept = [i for i, name in enumerate(names) if name.startswith("encoder.layer.0.")]
    subset = [weights[i] for i in kept]
    label = f"MiniLM layer 0's {len(subset)} Linear weights ({sum(w.numel() for w in subset) / 1e6:.2f}M)"
    return label, subset, [knobs[i] for i in kept]


def _reference_rows(label: str, subset: list[torch.Tensor], knobs: list[dict], device: str) -> list[dict]:
    """On layer 0: every default observer native against eager, and ``nvfp4_expanded_mse`` against
    llm-compressor."""
    observers = default_observers({"weight": NVFP4})
    runs = [_sweep(observer, subset, knobs) for observer in observers]

    def everything() -> list[ob.QParams]:
        return [qp for run in runs for qp in run()]

    rows = measure(
        f"{label}: all {len(observers)} default NVFP4 observers",
        everything,
        None,
        device,
        [_eager(everything)] if device == "cpu" else [],
    )

    def agree(ours: list[ob.QParams], theirs: torch.Tensor) -> str:
        return scales_agree(torch.cat([qp.scale.flatten() for qp in ours]), theirs)

    run = _sweep("nvfp4_expanded_mse", subset, [{}] * len(subset))
    ref = lc_observer_ref("nvfp4_expanded_mse", subset, LC_NVFP4_ARGS, agree)
    return rows + measure(f"{label}: nvfp4_expanded_mse nvfp4", run, None, device, [ref])


def cases(device: str = "cpu") -> list[dict]:
    model = open_model("minilm", device=device)
    names = [info.name for info in model.layers() if info.type == "Linear"]
    names = names[:6] if SETTINGS.quick else names
    weights = [model.weight(name) for name in names]
    knobs = _input_knobs(model, names)
    layer_knobs = [knobs[name] for name in names]
    label = f"MiniLM {len(weights)} Linear weights ({sum(w.numel() for w in weights) / 1e6:.1f}M)"
    observers = default_observers({"weight": NVFP4})
    rows = []
    for observer in observers:
        rows += measure(f"{label}: {observer} nvfp4", _sweep(observer, weights, layer_knobs), None, device)
    total = case(
        f"{label}: all {len(observers)} default NVFP4 observers (sum of the rows above)", sum(r["ours_s"] for r in rows)
    )
    return [*rows, total, *_reference_rows(*_layer0(names, weights, layer_knobs), device)]
