"""Calibration as users run it (issue 24): their own records, streamed through the observers.

- MiniLM, the inputs of its 12 FFN layers, records of a JSONL the bench writes (one record per
  sample, 128 tokens): peak RSS of a 512-record run against a 32-record one (each in a fresh
  process, imports excluded; target: at most 150 MB more), and the calibration time against a
  plain forward pass over the same batches (targets: at most 1.5x with ``minmax``, 3x with the
  default activation observers).
- A generated 8-block Llama checkpoint (about 580 MB), every layer's weight and input, swept in one
  layer-by-layer pass under a 250 MB budget against one whole-model run of the same layers
  (targets: at most 1.4x the time, peak RSS within the budget plus 150 MB); skipped with ``--quick``.
- Agreement: our ``minmax`` int8 input scales against llm-compressor's own ``oneshot``
  (``static_minmax``, batch size 1, no shuffling) over the same records of a small JSONL.

    python -m bench --only calibration [--quick]
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
from bench.common import PEAK_CLI, SETTINGS, case, import_rss, interleaved_medians
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from sample_models import builtin_texts, open_model
from sample_models.calibration import make_batches
from sample_models.calibration_sets import CalibrationSource

ROOT = Path(__file__).resolve().parents[1]
INT8 = ob.QuantSpec("int8")
FFN = [f"encoder.layer.{i}.{name}" for i in range(6) for name in ("intermediate.dense", "output.dense")]
MiB = 2**20
PEAK = """
import json, sys, time
import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from sample_models import open_model
from sample_models.calibration_sets import CalibrationSource

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

path, samples, layers = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
model = open_model("minilm")
model.module()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
config = RunConfig(specs={"input": ob.QuantSpec("int8")}, observers=("minmax",), samples=samples, seq_len=128,
                   dataset=CalibrationSource(path))
analysis = analyse(model, layers, config)
print(json.dumps({"growth": status("VmHWM") - before, "tokens": analysis.calibration["tokens"]}))
"""


def write_records(path: Path, count: int) -> Path:
    """``count`` distinct records, each a few of the built-in paragraphs (over 128 tokens)."""
    texts = builtin_texts()
    with path.open("w", encoding="utf-8") as handle:
        for i in range(count):
            record = " ".join(texts[(i + k) % len(texts)] for k in range(3))
            handle.write(json.dumps({"text": f"Record {i}. {record}"}) + "\n")
    return path


def _peak_growth(path: Path, samples: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), str(samples), ",".join(FFN)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _minilm_rows(folder: Path, device: str) -> list[dict]:
    records = write_records(folder / "records.jsonl", 512)
    small, large = _peak_growth(records, 32), _peak_growth(records, 512)
    extra = (large["growth"] - small["growth"]) / MiB
    label = f"MiniLM 12 FFN inputs, JSONL 512 x 128 tokens ({large['tokens']:,} tokens) vs 32 records"
    rows = [
        case(
            f"{label}: peak RSS growth",
            0.0,
            agreement=f"+{large['growth'] / MiB:.0f} MiB vs +{small['growth'] / MiB:.0f} MiB: {extra:+.0f} MiB "
            f"(target <= 150 MB: {'met' if extra * MiB <= 150e6 else 'NOT met'})",
        )
    ]
    model = open_model("minilm", device=device)
    samples = 128 if SETTINGS.quick else 512
    source = CalibrationSource(str(records))
    windows = model.calibration_set(source, samples, 128).windows
    batches = make_batches(model.tokenizer(), windows, 8, model.device)
    module = model.module()

    def forward() -> None:
        with torch.no_grad():
            for ids, mask in batches:
                module(input_ids=ids, attention_mask=mask)

    runs = {
        "forward": forward,
        "minmax": lambda: analyse(model, FFN, _config(("minmax",), samples, source)),
        "default": lambda: analyse(model, FFN, _config(None, samples, source)),
    }
    times = interleaved_medians(runs, device, repeats=2, warmup=0)
    observers = len(_config(None, samples, source).observers_for("input"))
    for name, target, what in (("minmax", 1.5, "minmax"), ("default", 3.0, f"the {observers} default observers")):
        ratio = times[name] / times["forward"]
        rows.append(
            case(
                f"MiniLM 12 FFN inputs, {samples} records x 128 tokens streamed through {what}",
                times[name],
                reference_s=times["forward"],
                reference="a plain forward pass over the same batches",
                agreement=f"{ratio:.2f}x the forward pass (target <= {target}x: {_met(ratio <= target)})",
            )
        )
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _config(observers, samples: int, source: CalibrationSource) -> RunConfig:
    return RunConfig(specs={"input": INT8}, observers=observers, samples=samples, seq_len=128, dataset=source)


def cases(device: str = "cpu") -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for part in (_minilm_rows, _llama_rows, _agreement_rows):
            try:
                rows += part(Path(folder), device)
            except Exception as err:  # one part failing keeps the others' rows
                rows.append(case(f"{part.__name__.strip('_')}: failed", 0.0, agreement=f"{type(err).__name__}: {err}"))
    return rows


# ------------------------------------------------------------------ the 8-block Llama checkpoint

SWEEP = ["--layers", "all", "--kinds", "weight,input", "--format", "int8", "--observers", "minmax", "--quiet"]
SWEEP += ["--samples", "32", "--seq-len", "128"]


def _llama_rows(folder: Path, device: str) -> list[dict]:
    if SETTINGS.quick:
        return [case("8-block Llama sweep, layer by layer under 250 MB", 0.0, agreement="skipped with --quick")]
    from transformers import LlamaConfig

    from sample_models.synthetic import write_llama_checkpoint

    cache = Path(os.environ.get("OBSERVER_LAB_BENCH_CACHE", Path.home() / ".cache" / "observer-lab"))
    directory = cache / "llama-8-blocks"
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    if not (directory / "config.json").exists():
        write_llama_checkpoint(directory, config)
    size = sum(f.stat().st_size for f in directory.rglob("*.safetensors"))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    runs = {}
    for name, how in (("sequential", ["--sequential", "--max-memory", "250MB"]), ("whole", ["--whole-model"])):
        out = folder / f"{name}.json"
        start = time.perf_counter()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                PEAK_CLI,
                "run",
                str(directory),
                *SWEEP,
                *how,
                "--device",
                device,
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        if measured["code"] != 0:
            raise RuntimeError(f"the {name} sweep exited with {measured['code']}: {done.stderr.strip()[-300:]}")
        runs[name] = (time.perf_counter() - start, measured["peak"], out)
    same = [e["qparams"] for e in json.loads(runs["sequential"][2].read_text())["entries"]] == [
        e["qparams"] for e in json.loads(runs["whole"][2].read_text())["entries"]
    ]
    ratio = runs["sequential"][0] / runs["whole"][0]
    budget_rss = (runs["sequential"][1] - import_rss(env)) / MiB
    label = f"8-block Llama checkpoint ({size / 1e6:.0f} MB), every layer's weight and input, 32 x 128 tokens"
    return [
        case(
            f"{label}: one sequential pass under 250 MB vs one whole-model run",
            runs["sequential"][0],
            reference_s=runs["whole"][0],
            reference="the same sweep, whole model in memory",
            agreement=f"{ratio:.2f}x (target <= 1.4x: {'met' if ratio <= 1.4 else 'NOT met'}); peak RSS "
            f"{runs['sequential'][1] / MiB:.0f} MiB, imports + {budget_rss:.0f} MiB (target <= 250 MB + 150 MB: "
            f"{'met' if budget_rss * MiB <= 400e6 else 'NOT met'}); whole model {runs['whole'][1] / MiB:.0f} MiB; "
            f"qparams {'identical' if same else 'DIFFER'}",
        )
    ]


# ------------------------------------------------------------------ agreement with llm-compressor

AGREEMENT_RECORDS = 16


def _agreement_rows(folder: Path, device: str) -> list[dict]:
    label = f"minmax int8 input scales vs llm-compressor oneshot static_minmax, {AGREEMENT_RECORDS} records x 64 tokens"
    try:
        import llmcompressor  # noqa: F401
    except ImportError:
        return [case(label, 0.0, reference="missing: llmcompressor not installed")]
    try:
        return [_agreement(folder, label)]
    except Exception as err:  # a reference that breaks is reported, never hidden
        return [case(label, 0.0, reference=f"reference failed: {type(err).__name__}: {str(err)[:160]}")]


def _agreement(folder: Path, label: str) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    records = write_records(folder / "agreement.jsonl", AGREEMENT_RECORDS)
    model = open_model("tiny-llama")
    layers = [info.name for info in model.layers() if info.type == "Linear" and info.name != "lm_head"]
    source = CalibrationSource(str(records))
    ours = analyse(
        model,
        layers,
        RunConfig(
            specs={"input": INT8},
            observers=("minmax",),
            samples=AGREEMENT_RECORDS,
            seq_len=64,
            batch_size=1,
            dataset=source,
        ),
    )
    windows = model.calibration_set(source, AGREEMENT_RECORDS, 64).windows
    dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    theirs_model = model.module()
    # oneshot reads the model's config again by its name_or_path, which a model built in memory lacks
    theirs_model.config.save_pretrained(folder / "tiny-llama")
    theirs_model.config._name_or_path = str(folder / "tiny-llama")
    scheme = {
        "targets": ["Linear"],
        "input_activations": {
            "num_bits": 8,
            "type": "int",
            "strategy": "tensor",
            "symmetric": True,
            "dynamic": False,
            "observer": "static_minmax",
        },
    }
    recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    start = time.perf_counter()
    oneshot(
        model=theirs_model,
        dataset=dataset,
        recipe=recipe,
        processor=model.tokenizer(),
        num_calibration_samples=AGREEMENT_RECORDS,
        max_seq_length=64,
        shuffle_calibration_samples=False,
        batch_size=1,
    )
    seconds = time.perf_counter() - start
    worst = 0.0
    for layer in layers:
        scale = theirs_model.get_submodule(layer).input_scale.detach().float().reshape(-1)
        mine = ours.entry(layer, "input").result("minmax").qparams.scale.float().reshape(-1)
        worst = max(worst, float(((scale - mine).abs() / scale.abs()).max()))
    return case(
        label,
        ours.seconds,
        reference_s=seconds,
        reference="llm-compressor oneshot (QuantizationModifier, static_minmax, batch size 1)",
        agreement=f"{len(layers)} layers, max rel diff {worst:.1e} ({'identical' if worst == 0 else 'differ'})",
    )
