"""The llm-compressor recipe export (issue 25 item 2) run by llm-compressor itself.

MiniLM, two weights with different chosen observers (``mse_grid`` on the attention query,
``minmax`` on the first FFN layer), int4 groups of 32 and int8 per output channel: the lab's
recipe (``lab.export.recipe``, one config group per choice) goes to llm-compressor's ``oneshot``
as a file, and the ``weight_scale`` llm-compressor writes on each layer is compared with the lab's
scale of that layer's chosen observer (maximum relative difference). The row also says whether
llm-compressor attached the observer of each layer's own group, and on how many scales the other
observer differs, so agreement shows the per-layer choice was kept, not that the observers agree.
Weights need no calibration data, so ``oneshot`` runs without a dataset.

Beside it, the compressed checkpoint of a big model: the generated 4.4 GB Llama-shaped checkpoint
(``bench_sequential``'s, TinyLlama-1.1B shapes, 7 weight files), every Linear weight's ``minmax``
int4 group-128 choice from a weights-only sweep, then ``python -m observers export ... --checkpoint``
in a fresh process: its time, its peak RSS above the imports (one weight file at a time: the target
is the largest file plus what is held of the model) and the checkpoint's size. Skipped with
``--quick`` or ``OBSERVER_LAB_BENCH_LARGE=0``.

    python -m bench --only recipe
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import observers as ob
from bench.bench_sequential import LARGE_FLAG, large_checkpoint
from bench.common import PEAK_CLI, SETTINGS, case, import_rss
from lab.analyse.analysis import Analysis
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import recipe
from sample_models import open_model

CHOICES = {
    "encoder.layer.0.attention.self.query": "mse_grid",
    "encoder.layer.0.intermediate.dense": "minmax",
}
SPECS = {
    "int4 group 32": ob.QuantSpec("int4", strategy="group", group_size=32),
    "int8 channel": ob.QuantSpec("int8", strategy="channel"),
}
OBSERVERS = ("minmax", "mse_grid")
ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def cases(device: str = "cpu") -> list[dict]:
    rows = [_large_export_row(device)]
    for name, spec in SPECS.items():
        label = f"MiniLM recipe, {name} weights, query mse_grid + FFN minmax: weight_scale vs llm-compressor oneshot"
        try:
            import llmcompressor  # noqa: F401
        except ImportError:
            rows.append(case(label, 0.0, reference="missing: llmcompressor not installed"))
            continue
        try:
            rows.append(_agreement(label, spec, device))
        except Exception as err:  # a reference that breaks is reported, never hidden
            rows.append(case(label, 0.0, reference=f"reference failed: {type(err).__name__}: {str(err)[:160]}"))
    return rows


def _large_export_row(device: str) -> dict:
    label = "compressed checkpoint of the generated 4.4 GB Llama (int4 g128 minmax, every Linear weight): export"
    if SETTINGS.quick or os.environ.get(LARGE_FLAG) == "0":
        return case(label, 0.0, agreement=f"skipped (--quick or {LARGE_FLAG}=0)")
    directory = large_checkpoint()
    threads = str(torch.get_num_threads())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads}
    with tempfile.TemporaryDirectory() as folder:
        choices = Path(folder) / "choices.json"
        sweep = ["run", str(directory), "--layers", "all", "--kinds", "weight", "--format", "int4", "--strategy"]
        sweep += ["group", "--group-size", "128", "--observers", "minmax", "--quiet", "--out", str(choices)]
        subprocess.run([sys.executable, "-m", "observers", *sweep, "--device", device], env=env, check=True, cwd=ROOT)
        out = Path(folder) / "checkpoint"
        start = time.perf_counter()
        export = ["export", str(choices), "--model", str(directory), "--checkpoint", str(out), "--device", device]
        done = subprocess.run(
            [sys.executable, "-c", PEAK_CLI, *export], env=env, capture_output=True, text=True, check=True, cwd=ROOT
        )
        seconds = time.perf_counter() - start
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        if measured["code"] != 0:
            raise RuntimeError(f"export exited with {measured['code']}: {done.stderr.strip()[-300:]}")
        growth = measured["peak"] - import_rss(env)
        largest = max(f.stat().st_size for f in directory.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    source = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return case(
        label,
        seconds,
        agreement=f"peak RSS imports + {growth / MiB:.0f} MiB (largest weight file {largest / MiB:.0f} MiB); "
        f"{source / 1e9:.2f} GB -> {size / 1e9:.2f} GB",
    )


def _rel_diff(theirs: torch.Tensor, mine: torch.Tensor) -> float:
    theirs, mine = theirs.detach().float().cpu().reshape(-1), mine.detach().float().cpu().reshape(-1)
    if theirs.shape != mine.shape:
        raise ValueError(f"scale shapes differ: llm-compressor {tuple(theirs.shape)}, lab {tuple(mine.shape)}")
    return float(((theirs - mine).abs() / theirs.abs()).max())


def _agreement(label: str, spec: ob.QuantSpec, device: str) -> dict:
    from llmcompressor import oneshot

    model = open_model("minilm", device=device)
    ours: Analysis = analyse(model, list(CHOICES), RunConfig(specs={"weight": spec}, observers=OBSERVERS))
    built = recipe.build(ours, {(layer, "weight"): observer for layer, observer in CHOICES.items()})
    module = model.module()
    with tempfile.TemporaryDirectory() as folder:
        path = built.write(Path(folder) / recipe.RECIPE_FILE)
        start = time.perf_counter()
        oneshot(model=module, recipe=path)
        seconds = time.perf_counter() - start
    expected = {target: g["weights"]["observer"] for g in built.config_groups.values() for target in g["targets"]}
    worst, attached, other_differs, scales = 0.0, {}, 0, 0
    for layer, observer in CHOICES.items():
        entry = ours.entry(layer, "weight")
        mine = entry.result(observer).qparams.scale
        submodule = module.get_submodule(layer)
        worst = max(worst, _rel_diff(submodule.weight_scale, mine))
        attached[layer] = submodule.quantization_scheme.weights.observer
        other = next(name for name in OBSERVERS if name != observer)
        other_differs += int((entry.result(other).qparams.scale.cpu() != mine.cpu()).sum())
        scales += mine.numel()
    return case(
        label,
        ours.seconds,
        reference_s=seconds,
        reference=f"llm-compressor oneshot with the exported recipe ({len(built.config_groups)} config groups)",
        agreement=f"{len(CHOICES)} layers, observers {'/'.join(attached.values())} "
        f"({'as the recipe' if attached == expected else 'NOT as the recipe'}), "
        f"max rel diff {worst:.1e} ({'identical' if worst == 0 else 'differ'}); "
        f"the unchosen observer differs on {other_differs} of {scales} scales",
    )
