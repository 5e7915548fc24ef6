"""Budgeted allocation (issue 34) on MiniLM: every Linear layer (37), the schemes NVFP4, W4A16 (int4
group 128), FP8 and none, the budgets 4.5, 5 and 6 bits per weight, every default weight observer,
the built-in calibration paragraphs (``SAMPLES`` windows of 128 tokens) and the built-in held-out
paragraphs split in two (``lab.allocate.held_out``: scores on alternate paragraphs, the frontier
measured on the others and in sample), run in this process as
``python -m observers allocate`` runs it (``lab.allocate.command.run``: the same flags, parsed by
the CLI's own parser).

Rows, each against the issue's target:

- **scoring**: the ``score()`` call, analyses included (every scheme's weight and input analyses
  and one model run per distinct quantized layer): under 3 minutes on this 2-core machine. The
  float pass (``Evaluator``) and the frontier's end-to-end runs are timed beside it.
- **budgets**: at each budget, the allocation's measured embedding cosine (every choice applied at
  once, on the measuring part) is at least that of every uniform scheme that fits the budget.
- **rule**: the allocation is at least as good as the rule "first and last encoder blocks in FP8,
  the rest NVFP4" at the rule's own size: the allocation solved at exactly the rule's checkpoint
  bytes (a size budget, so that no float rounding of bits per weight drops the rule itself out of
  its own budget) and measured.
- **spearman**: the rank correlation of predicted (the sum of the layers' scores, scoring part) and
  measured damage (measuring part) over the frontier (the budgets' allocations and the uniform
  schemes) is at least 0.9.
- **ModelOpt**: NVIDIA ModelOpt's ``auto_quantize`` on the same model, formats and budgets
  (``NVFP4_DEFAULT_CFG``, ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, ``FP8_DEFAULT_CFG``; its
  ``effective_bits``). Its NVFP4 fake quantization needs CUDA (``tensor_quant.py`` asserts a CUDA
  amax, then runs a Triton kernel or a CUDA extension): the row says where it stops. What runs on
  CPU runs: ModelOpt with W4A16 and FP8 against the lab's allocation over W4A16, FP8 and none at
  the same checkpoint size (the lab's byte count of what ModelOpt chose), ModelOpt scoring on the
  lab's scoring part and both measured on its measuring part (mean-pooled ``last_hidden_state``
  against the float model's).
- **oneshot**: llm-compressor's ``oneshot`` with the allocation's recipe (``lab.export.recipe``)
  gives each layer the scheme the allocation gave it.

Times (each once): the scoring row's is the ``score()`` call; a budget row's and a ModelOpt row's
solving and measuring the allocation; the rule row's measuring the rule and solving and measuring
at its size; the frontier row's the whole frontier; the oneshot row's writing the JSON and the
recipe. The references do other work than ours (ModelOpt scores one calibrator per format, the lab
every observer; ``oneshot`` calibrates), so their times are in the agreement text, not in the
reference column: ``auto_quantize``'s first budget pays its calibration and scoring, the next
restore them from its search checkpoint. ``--quick``: the first encoder block only (6 layers; the
rule is then every layer in FP8), and no ModelOpt or oneshot rows.

    python -m bench --only allocate [--device cpu] [--quick]
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import SETTINGS, case, reference

SCHEMES = "NVFP4,W4A16,FP8,none"
BUDGETS = ("4.5", "5", "6")
SAMPLES, SEQ_LEN = 16, 128
SCORING_TARGET_S = 180.0
SPEARMAN_TARGET = 0.9
RULE = "first and last encoder blocks FP8, the rest NVFP4"
MODELOPT = "ModelOpt auto_quantize"
MODELOPT_FORMATS = ("NVFP4_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "FP8_DEFAULT_CFG")
MODELOPT_CPU_FORMATS = {"INT4_BLOCKWISE_WEIGHT_ONLY_CFG": "W4A16", "FP8_DEFAULT_CFG": "FP8"}
SIMILARITY_SCALE = 20.0
"""all-MiniLM-L6-v2's training scale of cosine similarities (MultipleNegativesRankingLoss): the
"logits" ModelOpt's KL scoring compares are each sentence's scaled similarities to the float
embeddings of the held-out sentences."""


@dataclass
class LabRun:
    """What the allocation stage made, kept for the comparisons."""

    model: Any
    layers: list[str]
    held_out: Any
    scores: Any
    options: dict
    sizes: Any
    groups: list
    frontier: Any
    float_s: float
    score_s: float
    score_cpu_s: float
    frontier_s: float
    schemes: list
    load: tuple[float, float]


def _cli_args(layers: Sequence[str], device: str) -> Any:
    """The ``allocate`` command's namespace, parsed by the CLI's own parser, so the bench runs with
    the CLI's defaults for everything it does not name."""
    from lab.allocate import command
    from lab.cli_args import build_parser

    argv = ["allocate", "minilm", "--layers", ",".join(layers), "--schemes", SCHEMES]
    argv += ["--budgets", ",".join(BUDGETS), "--out", "unused.json", "--samples", str(SAMPLES)]
    argv += ["--seq-len", str(SEQ_LEN), "--device", device, "--quiet"]
    return build_parser(extra=(command.add_parser,)).parse_args(argv)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lab_allocation(device: str) -> LabRun:
    """``allocate``'s flow (``lab.allocate.command.run``) up to the measured frontier, timed."""
    from lab.allocate import command, frontier
    from lab.allocate.held_out import split
    from lab.allocate.score import score
    from lab.analyse.pipeline import analyse
    from lab.runtime.fusion import fused_groups
    from lab.scheme.cost import LayerSizes
    from sample_models import open_model

    model = open_model("minilm", device=device)
    layers = [i.name for i in model.layers() if i.type == "Linear"]
    if SETTINGS.quick:
        layers = [name for name in layers if name.startswith("encoder.layer.0.")]
    args = _cli_args(layers, device)
    request = command.check(args)
    sizes, groups = LayerSizes.of(model, layers), fused_groups(layers)
    mine = frontier.scheme_layers(sizes, request.schemes)
    frontier.check_budgets(sizes, request.schemes, request.budgets)
    base = command.base_config(args, next(s for s in request.schemes if not s.dense))
    start = time.perf_counter()
    held_out = split(model, sequential=args.sequential, max_memory=base.max_memory)
    float_s = time.perf_counter() - start
    start, cpu, load = time.perf_counter(), _cpu_s(), os.getloadavg()[0]
    scores = score(held_out, mine, request.schemes, base, lambda scheme, config, chosen: analyse(model, chosen, config))
    score_s, score_cpu_s, load = time.perf_counter() - start, _cpu_s() - cpu, (load, os.getloadavg()[0])
    options = frontier.layer_options(scores, sizes, request.schemes)
    start = time.perf_counter()
    measured = frontier.frontier(held_out, scores, options, groups, sizes, request.budgets)
    frontier_s = time.perf_counter() - start
    return LabRun(
        model, layers, held_out, scores, options, sizes, groups, measured, float_s, score_s, score_cpu_s,
        frontier_s, request.schemes, load,
    )  # fmt: skip


def _mix(point: Any) -> str:
    counts: dict[str, int] = {}
    for choice in point.choices:
        counts[choice.scheme] = counts.get(choice.scheme, 0) + 1
    return " + ".join(f"{count} {scheme}" for scheme, count in counts.items())


def _cosine(point: Any) -> float:
    return float(point.measured["cosine"])


def _described(point: Any) -> str:
    return f"cosine {_cosine(point):.5f} at {point.bits_per_weight:.3f} bits ({_mix(point)})"


def scoring_row(run: LabRun) -> dict:
    scores = run.scores
    passed = run.score_s < SCORING_TARGET_S
    observers = scores.frame["observer"].nunique()
    held = run.held_out.scoring.held_out
    note = (
        f"{'PASS' if passed else 'FAIL'}: score() {run.score_s:.1f} s against the target < {SCORING_TARGET_S:.0f} s "
        f"({run.score_cpu_s:.0f} CPU s); {scores.runs} (layer, scheme, observer) scores, {scores.unique_runs} "
        f"distinct runs, {observers} weight observers; float pass {run.float_s:.1f} s; frontier "
        f"({len(run.frontier.points)} points measured end to end) {run.frontier_s:.1f} s; load average "
        f"{run.load[0]:.1f} before scoring, {run.load[1]:.1f} after (2 cores; other processes share them)"
    )
    label = (
        f"allocate scoring, MiniLM {len(run.layers)} Linear x {SCHEMES}, {SAMPLES}x{SEQ_LEN} calibration tokens, "
        f"{held['batches']} held-out batches / {held['tokens']} tokens (the scoring part)"
    )
    return case(label, run.score_s, agreement=note)


def budget_rows(run: LabRun) -> list[dict]:
    """Per budget: the allocation against every uniform scheme that fits it."""
    rows = []
    uniforms = sorted(run.frontier.uniforms, key=lambda p: p.bits_per_weight)
    for point in run.frontier.allocations:
        limit = float(point.budget)
        fitting = [u for u in uniforms if u.bits_per_weight <= limit]
        beaten = [u for u in fitting if _cosine(u) > _cosine(point)]
        passed = not beaten
        against = "; ".join(f"{u.name} {_cosine(u):.5f} ({u.bits_per_weight:.3f} bits)" for u in fitting)
        above = [u for u in uniforms if u.bits_per_weight > limit]
        note = (
            f"{'PASS' if passed else 'FAIL'}: {_described(point)}, predicted 1-cos {point.predicted:.4g}, measured "
            f"{point.measured_score:.4g}; uniform schemes within the budget: {against or 'none'}"
        )
        if beaten:
            note += f"; beaten by {', '.join(u.name for u in beaten)}"
        if above:
            note += "; over the budget: " + ", ".join(f"{u.name} {u.bits_per_weight:.3f} bits" for u in above)
        timed = _solve_and_measure_s(run, point.budget)
        rows.append(case(f"allocate budget {point.budget} bits/weight vs uniform schemes", timed, agreement=note))
    return rows


def _solve_and_measure_s(run: LabRun, text: str) -> float:
    """Seconds to solve one budget and measure its allocation end to end (the frontier's work per
    budget)."""
    from lab.allocate.frontier import allocate, measure
    from lab.allocate.schemes import parse_budget

    start = time.perf_counter()
    measure(allocate(run.options, run.groups, run.sizes, parse_budget(text)), run.held_out, run.scores)
    return time.perf_counter() - start


def _rule_scheme(layers: Sequence[str]) -> Callable[[str], str]:
    blocks = sorted({int(name.split(".")[2]) for name in layers if name.startswith("encoder.layer.")})
    ends = {f"encoder.layer.{blocks[0]}.", f"encoder.layer.{blocks[-1]}."}
    return lambda layer: "FP8" if any(layer.startswith(end) for end in ends) else "NVFP4"


def rule_row(run: LabRun) -> dict:
    """The rule, and the allocation solved at exactly the rule's size, both measured."""
    from lab.allocate.frontier import allocate, fixed, measure
    from lab.allocate.schemes import Budget

    start = time.perf_counter()
    rule = measure(fixed(run.options, run.sizes, RULE, _rule_scheme(run.layers)), run.held_out, run.scores)
    budget = Budget(f"{rule.checkpoint_bytes}B (the rule's size)", checkpoint_bytes=rule.checkpoint_bytes)
    ours = measure(allocate(run.options, run.groups, run.sizes, budget), run.held_out, run.scores)
    seconds = time.perf_counter() - start
    passed = _cosine(ours) >= _cosine(rule) and ours.layer_bytes <= rule.layer_bytes
    note = (
        f"{'PASS' if passed else 'FAIL'}: allocation at the rule's size {_described(ours)} against the rule "
        f"{_described(rule)}; predicted 1-cos {ours.predicted:.4g} vs {rule.predicted:.4g}"
    )
    return case(f"allocate vs rule '{RULE}', same size", seconds, agreement=note)


def spearman_row(run: LabRun) -> dict:
    value = run.frontier.spearman
    passed = value is not None and value >= SPEARMAN_TARGET
    points = run.frontier.points
    pairs = "; ".join(f"{p.name} {p.predicted:.3g}/{p.measured_score:.3g}" for p in points)
    shown = "n/a" if value is None else f"{value:.3f}"
    note = (
        f"{'PASS' if passed else 'FAIL'}: Spearman {shown} over {len(points)} points (target >= {SPEARMAN_TARGET}); "
        f"predicted/measured 1-cos: {pairs}"
    )
    if run.frontier.notes:
        note += "; notes: " + " | ".join(run.frontier.notes)
    return case("allocate frontier: predicted vs measured rank correlation", run.frontier_s, agreement=note)


# ---------------------------------------------------------------- ModelOpt auto_quantize


class _TwoPhaseData:
    """ModelOpt's one ``data_loader`` for its two phases: calibration (``calibrate`` runs in
    ``no_grad``) takes the lab's calibration windows, scoring (the KL searcher's
    ``estimate_sensitivity_scores`` runs in ``inference_mode``) the held-out batches the lab scores
    on (its scoring part), so each side calibrates and chooses on the same text. ``passes`` counts each phase's."""

    def __init__(self, calibration: list[dict], held_out: list[dict]) -> None:
        self.calibration, self.held_out = calibration, held_out
        self.passes = {"calibration": 0, "scoring": 0}

    def __iter__(self) -> Iterator[dict]:
        scoring = torch.is_inference_mode_enabled()
        self.passes["scoring" if scoring else "calibration"] += 1
        return iter(self.held_out if scoring else self.calibration)


def _embed(model: Any, batch: dict) -> torch.Tensor:
    """The sentence embedding the lab compares (``EffectRunner._tail``): the mean of the last
    hidden states over real tokens."""
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def _bert(device: str | torch.device = "cpu") -> Any:
    from transformers import BertModel

    from sample_models.builtin import minilm_dir

    return BertModel.from_pretrained(str(minilm_dir()), dtype=torch.float32).eval().to(device)


@dataclass
class ModelOptRun:
    """What ModelOpt chose per layer (the lab's scheme names), its own effective bits, its model's
    held-out metrics, the seconds ``auto_quantize`` took and its data passes per phase."""

    effective_bits: float
    schemes: dict[str, str]
    metrics: dict[str, float]
    seconds: float
    constraint_met: bool
    passes: dict[str, int]


def _where_modelopt_stops(error: BaseException) -> str:
    """The error and the deepest line of ModelOpt's own code in its traceback."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/modelopt/" in f.filename]
    where = ""
    if frames:
        frame = frames[-1]
        line = (frame.line or "").strip()
        where = f" at modelopt/{frame.filename.split('/modelopt/', 1)[1]}:{frame.lineno} `{line}`"
    return f"{type(error).__name__}: {str(error)[:160]}{where}"


MODELOPT_BITS = {"NVFP4": 4.5, "W4A16": 4.0, "FP8": 8.0, "none": 16.0}
"""ModelOpt's own accounting of a layer's bits (``estimate_quant_compression``: NVFP4's
``effective_bits`` 4.5, otherwise ``num_bits``, with FP8's (4, 3) as 8, and 16 unquantized)."""


class ModelOptBench:
    """ModelOpt's ``auto_quantize`` on MiniLM's Linear layers, KL scoring (``method="kl_div"``) on
    the held-out sentences the lab scores on (its scoring part), calibrated on the lab's calibration
    windows, its model measured on the lab's measuring part."""

    def __init__(self, run: LabRun, scratch: Path) -> None:
        self.run = run
        self.scratch = scratch
        scoring, measuring = run.held_out.scoring.runner, run.held_out.measuring.runner
        self.device = scoring.batches[0].input_ids.device
        self.scoring = [{"input_ids": b.input_ids, "attention_mask": b.attention_mask} for b in scoring.batches]
        self.measuring = [{"input_ids": b.input_ids, "attention_mask": b.attention_mask} for b in measuring.batches]
        windows = run.model.calibration_set(None, SAMPLES, SEQ_LEN).windows
        ids = [torch.tensor([w], device=self.device) for w in windows]
        self.calibration = [{"input_ids": t, "attention_mask": torch.ones_like(t)} for t in ids]
        self.anchors = torch.nn.functional.normalize(torch.cat(scoring.float_outputs).float(), dim=-1)
        self.float_cosine = self.held_out_metrics(_bert(self.device))["cosine"]
        """The float BertModel through ``_embed`` against the lab's float outputs: 1 when the two
        paths embed alike, so that ModelOpt's cosine and the lab's are the same measurement."""

    def forward_step(self, model: Any, batch: dict) -> torch.Tensor:
        """ModelOpt's "logits" for its KL: each sentence's scaled cosine similarities to the float
        embeddings of every scoring-part sentence (the model's retrieval distribution)."""
        embedded = torch.nn.functional.normalize(_embed(model, batch), dim=-1)
        return SIMILARITY_SCALE * embedded @ self.anchors.T

    def held_out_metrics(self, model: Any) -> dict[str, float]:
        from lab.effect.metrics import encoder_metrics

        with torch.no_grad():
            embedded = [_embed(model, batch) for batch in self.measuring]
        return encoder_metrics(self.run.held_out.measuring.runner.float_outputs, embedded)

    def auto_quantize(self, formats: Sequence[str], bits: float, checkpoint: Path) -> ModelOptRun:
        """``auto_quantize`` at ``bits`` effective bits; ``checkpoint`` keeps its calibration and
        scores, so a second budget with the same formats only searches."""
        import modelopt.torch.quantization as mtq

        model = _bert(self.device)
        data = _TwoPhaseData(self.calibration, self.scoring)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            model, state = mtq.auto_quantize(
                model,
                constraints={"effective_bits": bits},
                quantization_formats=[getattr(mtq, name) for name in formats],
                data_loader=data,
                forward_step=self.forward_step,
                num_calib_steps=len(self.calibration),
                num_score_steps=len(self.scoring),
                method="kl_div",
                checkpoint=str(checkpoint),
            )
        seconds = time.perf_counter() - start
        schemes = _lab_schemes(state["best"]["recipe"])
        return ModelOptRun(
            self._effective_bits(schemes), schemes, self.held_out_metrics(model), seconds,
            bool(state["best"].get("is_satisfied", True)), data.passes,
        )  # fmt: skip

    def _effective_bits(self, schemes: dict[str, str]) -> float:
        weights = {layer: rows * columns for layer, (rows, columns) in self.run.sizes.shapes.items()}
        total = sum(MODELOPT_BITS[schemes.get(layer, "none")] * count for layer, count in weights.items())
        return total / sum(weights.values())


def _lab_schemes(recipes: dict) -> dict[str, str]:
    """ModelOpt's best recipe per layer (``"<layer>.quant_recipe": INT4_..._CFG(effective-bits:
    4.0)``) in the lab's scheme names; a recipe of no listed format is ``none``."""
    names = {"NVFP4_DEFAULT_CFG": "NVFP4", **MODELOPT_CPU_FORMATS}
    chosen = {}
    for key, recipe in recipes.items():
        text = str(recipe)
        found = [lab for fmt, lab in names.items() if text.startswith(f"{fmt}(")]
        chosen[key.removesuffix(".quant_recipe")] = found[0] if found else "none"
    return chosen


def _against_modelopt(bench: ModelOptBench, formats: Sequence[str], bits: str, checkpoint: Path) -> dict:
    """ModelOpt at ``bits`` effective bits with ``formats``, and the lab's allocation over the same
    formats (and none) at exactly the checkpoint bytes of ModelOpt's choice, both measured on the
    held-out text's measuring part."""
    from lab.allocate.frontier import allocate, fixed, measure
    from lab.allocate.schemes import Budget

    run = bench.run
    names = {"NVFP4_DEFAULT_CFG": "NVFP4", **MODELOPT_CPU_FORMATS}
    allowed = {"none", *(names[fmt] for fmt in formats)}
    options = {layer: {s: c for s, c in found.items() if s in allowed} for layer, found in run.options.items()}
    theirs = bench.auto_quantize(formats, float(bits), checkpoint)
    picked = fixed(options, run.sizes, f"{MODELOPT} {bits}", lambda layer: theirs.schemes.get(layer, "none"))
    as_lab = measure(picked, run.held_out, run.scores)  # ModelOpt's schemes with the lab's qparams
    budget = Budget(f"{as_lab.checkpoint_bytes}B", checkpoint_bytes=as_lab.checkpoint_bytes)
    start = time.perf_counter()
    ours = measure(allocate(options, run.groups, run.sizes, budget), run.held_out, run.scores)
    ours_s = time.perf_counter() - start
    cosine = theirs.metrics["cosine"]
    note = (
        f"{'PASS' if _cosine(ours) >= cosine else 'FAIL'}: allocate ({', '.join(sorted(allowed))}) at ModelOpt's "
        f"size {_described(ours)}; ModelOpt's model cosine {cosine:.5f} (spearman {theirs.metrics['spearman']:.4f}), "
        f"{theirs.effective_bits:.3f} effective bits in its accounting (int4 4, NVFP4 4.5, FP8 8, unquantized 16), "
        f"{as_lab.bits_per_weight:.3f} in the checkpoint's bytes ({_mix(as_lab)}); ModelOpt's choice with the "
        f"lab's observers: cosine {_cosine(as_lab):.5f}; auto_quantize {theirs.seconds:.1f} s (passes over the data: "
        f"{theirs.passes['calibration']} calibration, {theirs.passes['scoring']} scoring; 0: restored from its "
        f"checkpoint); the float model through the same embedding: cosine {bench.float_cosine:.5f}"
    )
    if not theirs.constraint_met:
        note += "; ModelOpt says its constraint was not met"
    label = f"{MODELOPT} vs allocate, MiniLM {len(run.layers)} Linear: {' + '.join(sorted(allowed - {'none'}))}"
    reference_name = f"{MODELOPT} ({', '.join(formats)}), kl_div"
    return case(f"{label}, effective bits {bits}", ours_s, None, reference_name, agreement=note)


def modelopt_rows(run: LabRun, scratch: Path) -> list[dict]:
    """ModelOpt with the issue's three formats, or where it stops; then, on a machine where NVFP4
    cannot run, the two formats that do against the lab's allocation over the same two."""
    found = reference("modelopt.torch.quantization")
    label = f"{MODELOPT} vs allocate, MiniLM {len(run.layers)} Linear"
    if isinstance(found, str):
        return [case(label, 0.0, None, MODELOPT, agreement=found)]
    bench = ModelOptBench(run, scratch)
    rows = []
    start = time.perf_counter()
    try:
        for bits in BUDGETS:
            rows.append(_against_modelopt(bench, MODELOPT_FORMATS, bits, bench.scratch / "all-formats.pth"))
        return rows
    except Exception as error:  # noqa: BLE001 - where the reference stops is the finding
        text = (
            f"cannot run on {bench.device.type}: {_where_modelopt_stops(error)}. NVFP4's dynamic block fake "
            "quantization (tensor_quant._dynamic_block_quantize_impl) asserts a CUDA amax, then runs Triton's "
            "fp4_fake_quant_block or the modelopt_cuda_ext_mx CUDA extension: there is no CPU path, so the "
            "comparison with NVFP4 waits for a GPU"
        )
        reference_name = f"{MODELOPT} ({', '.join(MODELOPT_FORMATS)}), kl_div"
        seconds = time.perf_counter() - start
        text += f" ({seconds:.1f} s until it stopped)"
        rows.append(case(f"{label}: NVFP4 + W4A16 + FP8", 0.0, None, reference_name, agreement=text))
    formats = list(MODELOPT_CPU_FORMATS)
    rows += [_against_modelopt(bench, formats, bits, bench.scratch / "cpu-formats.pth") for bits in BUDGETS]
    return rows


# ---------------------------------------------------------------- llm-compressor oneshot with the recipe


def oneshot_row(run: LabRun, scratch: Path) -> dict:
    """The allocation at the largest budget written as the lab writes it (its JSON, then
    ``recipe.of_chosen``), run by llm-compressor's ``oneshot`` on MiniLM; each module's
    ``quantization_scheme`` after it against the allocation's scheme of that layer."""
    found = reference("llmcompressor")
    point = run.frontier.allocations[-1]
    label = f"oneshot with the allocation's recipe (budget {point.budget}), MiniLM {len(run.layers)} Linear"
    if isinstance(found, str):
        return case(label, 0.0, None, "llm-compressor oneshot", agreement=found)
    import json

    from llmcompressor import oneshot
    from torch.utils.data import DataLoader

    from lab.allocate import export
    from lab.export import lab_json, recipe
    from lab.export.checkpoint import check_fits
    from lab.export.chosen import of_lab_file

    start = time.perf_counter()
    document = export.document(point, run.scores, run.schemes, run.frontier)
    lab_file = lab_json.parse_document(json.loads(lab_json.dumps(document)))
    built = recipe.of_chosen(of_lab_file(lab_file.entries), check_fits(lab_file, run.model))
    ours_s = time.perf_counter() - start
    built.write(scratch / "recipe.yaml")
    windows = run.model.calibration_set(None, SAMPLES, SEQ_LEN).windows
    batches = [
        {"input_ids": torch.tensor([w]), "attention_mask": torch.ones(1, len(w), dtype=torch.long)} for w in windows
    ]
    model = _bert()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        oneshot(model=model, dataset=DataLoader(batches, batch_size=None), recipe=str(scratch / "recipe.yaml"))
    oneshot_s = time.perf_counter() - start
    wanted = point.schemes()
    got = {name: _scheme_of(module) for name, module in model.named_modules() if name in wanted}
    wrong = [f"{name}: {got.get(name)} for {scheme}" for name, scheme in wanted.items() if got.get(name) != scheme]
    passed = not wrong
    note = (
        f"{'PASS' if passed else 'FAIL'}: {len(wanted) - len(wrong)}/{len(wanted)} layers carry the allocation's "
        f"scheme after oneshot ({_mix(point)}); {len(built.config_groups)} config groups in the recipe"
    )
    if wrong:
        note += "; differ: " + "; ".join(wrong[:4])
    note += f"; oneshot {oneshot_s:.1f} s on {SAMPLES} calibration windows"
    if built.notes:
        note += f"; {len(built.notes)} recipe notes, e.g. " + " | ".join(built.notes[:2])
    return case(label, ours_s, None, "llm-compressor oneshot (QuantizationModifier)", agreement=note)


def _scheme_of(module: Any) -> str:
    """A module's compressed-tensors scheme after oneshot, named as the lab names its schemes."""
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is None or scheme.weights is None:
        return "none"
    weights, inputs = scheme.weights, scheme.input_activations
    kind = f"{weights.type}{weights.num_bits}"
    if kind == "float4" and weights.group_size == 16 and inputs is not None and inputs.dynamic == "local":
        return "NVFP4"
    if kind == "int4" and weights.group_size == 128 and inputs is None and weights.symmetric:
        return "W4A16"
    if kind == "float8" and weights.strategy == "tensor" and inputs is not None and inputs.strategy == "tensor":
        return "FP8"
    return f"{kind} {weights.strategy} g{weights.group_size} input {inputs and inputs.type}"


def cases(device: str) -> list[dict]:
    run = lab_allocation(device)
    rows = [scoring_row(run), *budget_rows(run), rule_row(run), spearman_row(run)]
    if SETTINGS.quick:
        return rows
    with tempfile.TemporaryDirectory(prefix="bench-allocate-") as scratch:
        for extra in (modelopt_rows, oneshot_row):
            try:
                found = extra(run, Path(scratch))
                rows += found if isinstance(found, list) else [found]
            except Exception as error:  # noqa: BLE001 - a broken reference is a row, not a crash
                traceback.print_exc()
                failure = f"{type(error).__name__}: {str(error)[:200]}"
                rows.append(case(f"{extra.__name__}: FAILED", 0.0, agreement=failure))
    return rows


if __name__ == "__main__":
    from bench import __main__ as bench_main

    sys.exit(bench_main.main(["--only", "allocate", *sys.argv[1:]]))
