"""The width ladder (issue 54): every stage of the lab beside llm-compressor 0.14's ``oneshot`` on
Llama decoders of the widths people quantize, each stage a fresh process, its wall time and peak
RSS measured, and a projection to 32 blocks.

**The models** are built on the fly (``sample_models.synthetic.write_planted_llama``: tiny-llama's
random weights and planted outliers at any width, written one shard at a time with the MiniLM
tokenizer) and deleted after their rung:

- **256**: tiny-llama itself (intermediate 688, 4 blocks, GQA 8/2 heads), bit for bit, so the
  rung ties to every tiny-llama figure already published (4 blocks rather than 2 for that reason;
  the rung costs minutes either way); its groups are 16, since 688 = 43 x 16 is no multiple of 128
  (a ragged group the checkpoint cannot pack), and BENCHMARKS.md's tiny-llama AWQ figures are at
  16 too.
- **1024**: intermediate 2816, 2 blocks, GQA 16/4 heads (85M parameters, the issue's table).
- **2048**: intermediate 5632, 2 blocks, GQA 32/4 heads (TinyLlama-1.1B's block shape).
- **4096**: intermediate 11008, 1 block, 32/32 heads (Llama-2-7B's block; 452M parameters, 1.8 GB).

Above 256 the groups are 128 (W4A16's), which divide every width and intermediate size.

**Stages**, each a fresh process on the same directory, one after the other. The lab's CLI
(``python -m observers``) runs layer by layer (``--sequential``: one block's weights resident, as a
32-block model runs on this machine) on every Linear of the blocks (``re:model\\.layers\\.\\d+\\..*``),
int4 symmetric groups, every default observer, the built-in calibration windows (32 x 128 tokens,
one a batch); oneshot runs on the same token ids (the lab's windows handed over as a DataLoader of
ready batches, one unpadded record each) with the sequential pipeline per ``LlamaDecoderLayer``,
its one observer ``memoryless_minmax``:

- ``weights``: ``run --kinds weight`` (analysis of the weights); no counterpart.
- ``inputs``: ``run --kinds weight,input`` (the inputs in the same int4 group spec, since the
  CLI's ``--format`` sets both; every default input observer); no counterpart.
- ``checkpoint``: ``run --observers memoryless_minmax --checkpoint DIR`` (round to nearest, packed
  and written), against oneshot's ``QuantizationModifier`` and ``save_pretrained(save_compressed=
  True)``: one observer each, the same work.
- ``gptq``: ``run --gptq --propagate`` (GPTQ with every default weight observer, each block
  calibrated on the quantized blocks before it, as oneshot's pipeline does by default), against
  oneshot's ``GPTQModifier`` (its defaults) with one observer.
- ``awq``: ``run --awq`` (every default weight observer, the four variants, the deployed variant's
  held-out effect), against oneshot's ``AWQModifier`` (defaults) then ``QuantizationModifier``
  with one observer. llm-compressor 0.14 pins AWQ's caches, which fails without an accelerator:
  ``Tensor.pin_memory`` is made a no-op in its process.
- ``allocate``: ``allocate`` over int4 groups, FP8 (per tensor) and none at 7 bits per weight
  (between int4's 6 bits at groups of 16 or 4.25 at 128, float32 scales counted, and FP8's 8),
  weights only (scores on the held-out text's scoring part, the budget measured); no counterpart.
  Not int8 channels: every default observer on int8 per-channel weights takes the histogram
  observers per channel, which pass 4 GB on tiny-llama's gate_proj alone.

**Measured** per process: wall seconds from start to reaping, and its peak RSS (``os.wait4``'s
``ru_maxrss``: the process's own high-water mark, with any children it reaped; not the bench's
cumulative ``RUSAGE_CHILDREN``; started by a bare launcher, since a child of the bench would keep
the bench's own high-water mark across exec), CPU seconds beside them (a busy shared machine
shows as wall time well above CPU time). A process past ``--timeout`` is killed with its process
group and its row says "stopped at N s". GB are 10^9 bytes.

**Projection to 32 blocks** (a projection, not a measurement): time = S + (T - S) x 32 / b, where T
is the process's wall seconds on the rung's b blocks and S the side's start-up measured in the same
run (a process that only starts and imports: ``python -m observers list`` for the lab, oneshot's
imports for the reference). Everything else (loading, the embedding and head, saving) is counted per
block, so the projection errs high on both sides. Memory: the lab's measured peak stands, since it
holds one block's weights at a time; oneshot on a CPU holds the whole model (``from_pretrained``
loads every block), so its peak grows by one block's float32 weights for each block added.

    .bench-venv/bin/python -m bench.bench_widths --rungs 256,1024 --stages weights,inputs,checkpoint \\
        --timeout 3600 --markdown widths.md
    .bench-venv/bin/python -m bench --only widths     # BENCH_WIDTHS_RUNGS / _STAGES / _TIMEOUT pick; --quick: 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.bench_fused_oneshot import SAMPLES, SEQ_LEN, calibration_batches
from bench.common import SETTINGS, case, reference

if TYPE_CHECKING:
    from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
TARGET_BLOCKS = 32
DEFAULT_TIMEOUT_S = 7200.0
LAYERS = r"re:model\.layers\.\d+\..*"
ALLOCATION_SCHEMES, ALLOCATION_BUDGET = "int4:group:{group},FP8,none", "7"
GB = 1e9
NOTHING_TO_PROJECT = "{side}: no longer than its start-up, nothing to project"


@dataclass(frozen=True)
class Rung:
    """One width of the ladder: the decoder's shape and the int4 group size its stages use."""

    hidden: int
    intermediate: int
    blocks: int
    heads: int
    kv_heads: int
    group: int

    def config(self) -> LlamaConfig:
        """The decoder's ``LlamaConfig`` (``sample_models.builtin.planted_llama_config``)."""
        from sample_models.builtin import planted_llama_config

        return planted_llama_config(self.hidden, self.intermediate, self.blocks, self.heads, self.kv_heads)

    def block_parameters(self) -> int:
        """Parameters of one decoder block: q, k, v, o, gate, up, down and the two norms."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def label(self) -> str:
        return (
            f"hidden {self.hidden} ({self.blocks} block{'s' * (self.blocks > 1)}, intermediate {self.intermediate}, "
            f"{self.heads}/{self.kv_heads} heads, int4 g{self.group})"
        )


RUNGS = {
    256: Rung(256, 688, 4, 8, 2, 16),
    1024: Rung(1024, 2816, 2, 16, 4, 128),
    2048: Rung(2048, 5632, 2, 32, 4, 128),
    4096: Rung(4096, 11008, 1, 32, 32, 128),
}


@dataclass(frozen=True)
class Stage:
    """One stage: what the lab's process does, and oneshot's process beside it ("" for none)."""

    name: str
    lab: str
    counterpart: str = ""


STAGES = {
    stage.name: stage
    for stage in (
        Stage("weights", "analysis, weights (run --kinds weight)"),
        Stage("inputs", "analysis, weights + inputs (run --kinds weight,input)"),
        Stage(
            "checkpoint",
            "checkpoint write (run --observers memoryless_minmax --checkpoint)",
            "oneshot QuantizationModifier + save_pretrained(save_compressed=True)",
        ),
        Stage("gptq", "GPTQ (run --gptq --propagate)", "oneshot GPTQModifier"),
        Stage("awq", "AWQ, 4 variants (run --awq)", "oneshot AWQModifier + QuantizationModifier"),
        Stage("allocate", "allocation (allocate: int4 groups, FP8 or none, 7 bits per weight)"),
    )
}

# A fresh process running oneshot: argv stage, model directory, batches file, group size, output directory.
# Stage "imports" stops after the imports (the start-up the projection sets apart). Tensor.pin_memory is a
# no-op: llm-compressor 0.14 pins the AWQ caches unconditionally, which fails without an accelerator.
ONESHOT = """
import sys, torch
torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
if sys.argv[1] == "imports":
    sys.exit(0)
stage, model_dir, batches_file, group, out = sys.argv[1:6]
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": int(group),
           "observer": "memoryless_minmax"}
scheme = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
if stage == "checkpoint":
    oneshot(model=model, recipe=QuantizationModifier(**scheme))
    model.save_pretrained(out, save_compressed=True)
else:
    recipe = [GPTQModifier(**scheme)] if stage == "gptq" else [AWQModifier(), QuantizationModifier(**scheme)]
    batches = DataLoader(torch.load(batches_file, weights_only=True), batch_size=None)
    oneshot(model=model, recipe=recipe, dataset=batches, pipeline="sequential",
            sequential_targets=["LlamaDecoderLayer"])
"""


@dataclass(frozen=True)
class Measured:
    """One process: wall and CPU seconds, peak RSS in bytes, its exit code (None when it was
    stopped at the timeout) and, when it failed, its last output lines."""

    seconds: float
    cpu_seconds: float
    peak_bytes: int
    code: int | None
    failure: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0

    def cell(self) -> str:
        """The seconds cell: seconds with CPU seconds, or why there are none to compare."""
        if self.code is None:
            return f"stopped at {self.seconds:.0f} s"
        if self.code:
            return f"failed (exit {self.code}): {self.failure}"
        return f"{self.seconds:.1f} (CPU {self.cpu_seconds:.0f})"


# A small process that starts the measured one and reaps it: argv report file, timeout seconds, command. Its
# wait4 rusage of the command is the command's own (ru_maxrss in KiB on Linux: the peak RSS of the command and of
# any children it reaped). The command is not started by the bench itself because Linux keeps the high-water mark
# of the memory a process replaces at exec: a child of the bench (torch imported, hundreds of MB) would report
# at least the bench's peak, and this launcher's is a bare interpreter's (about 10 MB). Past the timeout the
# command's process group (its own session) is killed and the report says it was stopped.
LAUNCHER = """
import json, os, signal, sys, time
report, timeout_s, command = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
alarmed = []
def stop(signum, frame):
    alarmed.append(True)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended as the alarm came
        pass
start = time.perf_counter()
pid = os.posix_spawnp(command[0], command, os.environ, setsid=True)
signal.signal(signal.SIGALRM, stop)
signal.setitimer(signal.ITIMER_REAL, timeout_s)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - start
signal.setitimer(signal.ITIMER_REAL, 0)
stopped = alarmed and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
with open(report, "w") as out:
    json.dump({"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_bytes": usage.ru_maxrss * 1024,
               "code": None if stopped else os.waitstatus_to_exitcode(status)}, out)
"""


def measure_process(command: Sequence[str], timeout_s: float, log: Path, cwd: Path = ROOT) -> Measured:
    """Run ``command`` as a fresh process (its output to ``log``) and measure it alone, through
    ``LAUNCHER``: wall seconds until it is reaped and ``os.wait4``'s rusage of it, the peak RSS of
    this one process (and of any children it reaped itself), neither the bench's own nor the largest
    of every child the bench ever had (``RUSAGE_CHILDREN``). Past ``timeout_s`` its whole process
    group is killed and the result says so (``code`` None): a stopped stage is a row, never an
    exception."""
    report = log.with_name(log.name + ".rusage.json")
    with open(log, "wb") as out:
        launcher = [sys.executable, "-c", LAUNCHER, str(report), str(timeout_s), *command]
        launched = subprocess.run(launcher, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if not report.exists():  # the command could not be started (the launcher's error is in the log)
        return Measured(0.0, 0.0, 0, launched.returncode or 1, _last_lines(log))
    found = json.loads(report.read_text())
    code = found["code"]
    failure = "" if code in (0, None) else _last_lines(log)
    return Measured(found["seconds"], found["cpu_seconds"], found["peak_bytes"], code, failure)


def _last_lines(log: Path, lines: int = 2, characters: int = 300) -> str:
    text = log.read_text(errors="replace").strip().splitlines()
    return " / ".join(line.strip() for line in text[-lines:])[-characters:]


def project(
    seconds: float, peak_bytes: int, start_up_s: float, blocks: int, held_per_block: int, target: int = TARGET_BLOCKS
) -> tuple[float, int]:
    """A process's time and peak at ``target`` blocks from one on ``blocks``: the start-up apart and
    the rest ``seconds - start_up_s`` per block; the peak grows by ``held_per_block`` bytes for each
    block added (0 where one block is resident at a time, one block's weights where all are)."""
    per_block = (seconds - start_up_s) / blocks
    return start_up_s + per_block * target, peak_bytes + held_per_block * (target - blocks)


@dataclass(frozen=True)
class StageResult:
    """One stage on one rung: the lab's process, and oneshot's (None: no counterpart, or it could
    not run and ``reference_note`` says why)."""

    rung: Rung
    stage: Stage
    lab: Measured
    reference: Measured | None = None
    reference_note: str = ""


@dataclass(frozen=True)
class StartUp:
    """Seconds a process of each side takes to start and import, before any model work."""

    lab: float
    reference: float | None


def ratio_cells(result: StageResult) -> tuple[str, str]:
    """The time ratio (lab / oneshot) and the memory difference (lab - oneshot, GB), where both ran."""
    lab, ref = result.lab, result.reference
    if ref is None or not (lab.ok and ref.ok):
        return "", ""
    return f"{lab.seconds / ref.seconds:.2f}x", f"{(lab.peak_bytes - ref.peak_bytes) / GB:+.2f}"


def projection_cell(result: StageResult, start_up: StartUp) -> str:
    """The 32-block projection of both sides, and their time ratio there. A process that took no
    longer than its side's start-up (a short run on a busy machine) has nothing to project."""
    blocks, lab, ref = result.rung.blocks, result.lab, result.reference
    if not lab.ok:
        return ""
    if lab.seconds <= start_up.lab:
        return NOTHING_TO_PROJECT.format(side="lab")
    lab_s, lab_bytes = project(lab.seconds, lab.peak_bytes, start_up.lab, blocks, 0)
    text = f"lab {lab_s:.0f} s, {lab_bytes / GB:.2f} GB"
    if ref is None or not ref.ok or start_up.reference is None:
        return text
    if ref.seconds <= start_up.reference:
        return f"{text}; {NOTHING_TO_PROJECT.format(side='oneshot')}"
    held = 4 * result.rung.block_parameters()  # float32 weights of each further block, all resident
    ref_s, ref_bytes = project(ref.seconds, ref.peak_bytes, start_up.reference, blocks, held)
    text += f"; oneshot {ref_s:.0f} s, {ref_bytes / GB:.2f} GB; "
    return text + f"{lab_s / ref_s:.2f}x, {(lab_bytes - ref_bytes) / GB:+.2f} GB"


HEADER = [
    "width",
    "stage",
    "lab s",
    "lab peak GB",
    "reference",
    "reference s",
    "reference peak GB",
    "time ratio",
    "memory difference GB",
    f"{TARGET_BLOCKS} blocks (projection)",
]


def table_cells(results: Sequence[StageResult], start_up: StartUp) -> list[list[str]]:
    """One row of cells per stage result, in ``HEADER``'s order."""
    rows = []
    for result in results:
        ref = result.reference
        time_ratio, memory = ratio_cells(result)
        rows.append(
            [
                result.rung.label,
                result.stage.lab,
                result.lab.cell(),
                f"{result.lab.peak_bytes / GB:.2f}" if result.lab.ok else "",
                result.stage.counterpart
                + (f" ({result.reference_note})" if result.reference_note and result.stage.counterpart else ""),
                ref.cell() if ref is not None else "",
                f"{ref.peak_bytes / GB:.2f}" if ref is not None and ref.ok else "",
                time_ratio,
                memory,
                projection_cell(result, start_up),
            ]
        )
    return rows


def ladder_markdown(results: Sequence[StageResult], start_up: StartUp, machine: str) -> str:
    """The ladder as GitHub markdown: the machine line, the start-up seconds the projection sets
    apart, then the table (``|`` in a cell escaped)."""
    reference_start = "" if start_up.reference is None else f", oneshot {start_up.reference:.1f} s"
    lines = [
        f"{machine}  ",
        f"start-up (imports, set apart by the projection): lab {start_up.lab:.1f} s{reference_start}",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table_cells(results, start_up)]
    return "\n".join(lines) + "\n"


def lab_arguments(stage: str, rung: Rung, model_dir: Path, scratch: Path, device: str) -> list[str]:
    """The lab CLI's arguments for ``stage`` on ``model_dir`` (its outputs under ``scratch``)."""
    calibration = ["--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN), "--batch-size", "1", "--sequential"]
    calibration += ["--device", device, "--quiet"]
    if stage == "allocate":
        schemes = ALLOCATION_SCHEMES.format(group=rung.group)
        return [
            *("allocate", str(model_dir), "--layers", LAYERS, "--schemes", schemes, "--kinds", "weight"),
            *("--budget", ALLOCATION_BUDGET, "--out", str(scratch / "allocation.json"), *calibration),
        ]
    scheme = ["--format", "int4", "--strategy", "group", "--group-size", str(rung.group), "--symmetric"]
    extra = {
        "weights": ["--kinds", "weight"],
        "inputs": ["--kinds", "weight,input"],
        "checkpoint": ["--kinds", "weight", "--observers", "memoryless_minmax", "--checkpoint", str(scratch / "lab")],
        "gptq": ["--kinds", "weight", "--gptq", "--propagate"],
        "awq": ["--kinds", "weight", "--awq"],
    }[stage]
    out = ["--out", str(scratch / "lab.json")]
    return ["run", str(model_dir), "--layers", LAYERS, *scheme, *extra, *calibration, *out]


def reference_missing() -> str:
    """Why oneshot cannot run here (``bench.common.reference``'s words), or "" when it can."""
    missing = [found for found in map(reference, ("llmcompressor", "compressed_tensors")) if isinstance(found, str)]
    return "; ".join(missing)


def start_up_seconds(timeout_s: float, scratch: Path, with_reference: bool) -> StartUp:
    """Each side's start-up: a process that starts and imports, the least of three runs (the first
    warms the file cache; the least is the one other processes slowed least)."""

    def seconds(command: list[str]) -> float:
        runs = [measure_process(command, timeout_s, scratch / "start-up.log") for _ in range(3)]
        return min(run.seconds for run in runs) if all(run.ok for run in runs) else float("nan")

    lab = seconds([sys.executable, "-m", "observers", "list"])
    ref = seconds([sys.executable, "-c", ONESHOT, "imports"]) if with_reference else None
    return StartUp(lab, ref)


def run_rung(
    rung: Rung, stages: Sequence[str], timeout_s: float, scratch: Path, device: str, missing: str
) -> list[StageResult]:
    """Write the rung's decoder under ``scratch``, then each stage's lab process and oneshot's, one
    after the other; the directory is removed at the end."""
    from sample_models.synthetic import write_planted_llama

    work = scratch / f"h{rung.hidden}"
    model_dir = work / "model"
    write_planted_llama(model_dir, rung.config())
    batches = work / "batches.pt"
    torch.save(calibration_batches(model_dir), batches)
    results = []
    for name in stages:
        stage = STAGES[name]
        out = work / name
        out.mkdir()
        command = [sys.executable, "-m", "observers", *lab_arguments(name, rung, model_dir, out, device)]
        print(f"  {rung.label}: {stage.lab} ...", file=sys.stderr, flush=True)
        lab = measure_process(command, timeout_s, out / "lab.log")
        if not stage.counterpart:
            results.append(StageResult(rung, stage, lab))
            continue
        if missing:
            results.append(StageResult(rung, stage, lab, None, missing))
            continue
        print(f"  {rung.label}: {stage.counterpart} ...", file=sys.stderr, flush=True)
        arguments = [name, str(model_dir), str(batches), str(rung.group), str(out / "oneshot")]
        ref = measure_process([sys.executable, "-c", ONESHOT, *arguments], timeout_s, out / "oneshot.log", cwd=out)
        results.append(StageResult(rung, stage, lab, ref))
    shutil.rmtree(work, ignore_errors=True)
    return results


def run_ladder(
    rungs: Sequence[int], stages: Sequence[str], timeout_s: float, device: str
) -> tuple[list[StageResult], StartUp]:
    """Every asked rung's stages, in the order given, and the start-up the projection sets apart."""
    missing = reference_missing()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-widths-") as name:
        scratch = Path(name)
        start_up = start_up_seconds(timeout_s, scratch, with_reference=not missing)
        for hidden in rungs:
            results += run_rung(RUNGS[hidden], stages, timeout_s, scratch, device, missing)
    return results, start_up


def parse_rungs(text: str) -> list[int]:
    """``256,1024``: rungs by hidden size (an unknown one is an error naming the known ones)."""
    rungs = [int(part) for part in text.split(",") if part.strip()]
    unknown = [hidden for hidden in rungs if hidden not in RUNGS]
    if unknown or not rungs:
        raise ValueError(f"rungs {text!r}: choose from {', '.join(map(str, RUNGS))}")
    return rungs


def parse_stages(text: str) -> list[str]:
    """``awq,gptq``: stages by name (an unknown one is an error naming the known ones)."""
    stages = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown or not stages:
        raise ValueError(f"stages {text!r}: choose from {', '.join(STAGES)}")
    return stages


def cases(device: str) -> list[dict]:
    """``python -m bench --only widths``: the ladder as rows of the bench's table (ours = the lab's
    process, reference = oneshot's; peaks and the projection in the agreement text), its own table
    on stderr. ``BENCH_WIDTHS_RUNGS`` and ``BENCH_WIDTHS_STAGES`` pick (default: every rung and
    stage, hours at 4096; ``--quick``: the 256 rung), ``BENCH_WIDTHS_TIMEOUT`` is each process's
    limit in seconds."""
    from bench.__main__ import machine_line

    rungs = parse_rungs(os.environ.get("BENCH_WIDTHS_RUNGS", "256" if SETTINGS.quick else ",".join(map(str, RUNGS))))
    stages = parse_stages(os.environ.get("BENCH_WIDTHS_STAGES", ",".join(STAGES)))
    timeout_s = float(os.environ.get("BENCH_WIDTHS_TIMEOUT", DEFAULT_TIMEOUT_S))
    results, start_up = run_ladder(rungs, stages, timeout_s, device)
    print(ladder_markdown(results, start_up, machine_line(device)), file=sys.stderr)
    rows = []
    for result, cells in zip(results, table_cells(results, start_up), strict=True):
        lab, ref = result.lab, result.reference
        notes = [
            "" if lab.ok else f"lab: {cells[2]}",
            "" if ref is None or ref.ok else f"oneshot: {cells[5]}",
            f"peak RSS GB: lab {cells[3] or '-'}, oneshot {cells[6] or '-'}",
            f"{TARGET_BLOCKS} blocks (projection): {cells[9]}" if cells[9] else "",
        ]
        rows.append(
            case(
                f"widths, {cells[0]}: {cells[1]}",
                lab.seconds if lab.ok else 0.0,
                ref.seconds if ref is not None and ref.ok else None,
                cells[4],
                agreement="; ".join(note for note in notes if note),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import machine_line, references_line

    parser = argparse.ArgumentParser(prog="python -m bench.bench_widths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rungs", default=",".join(map(str, RUNGS)), help="hidden sizes, e.g. 256,1024")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated: {', '.join(STAGES)}")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds each process may take")
    parser.add_argument("--device", default="cpu", help="the lab's --device (oneshot picks its own)")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    try:
        rungs, stages = parse_rungs(args.rungs), parse_stages(args.stages)
    except ValueError as error:
        parser.error(str(error))
    results, start_up = run_ladder(rungs, stages, args.timeout, args.device)
    text = ladder_markdown(results, start_up, f"{machine_line(args.device)} · {references_line()}")
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    processes = [m for r in results for m in (r.lab, r.reference) if m is not None]
    return 1 if any(m.code not in (0, None) for m in processes) else 0  # stopped at the timeout is no failure


if __name__ == "__main__":
    sys.exit(main())
