"""The command line of ``python -m observers``: its parser, and the one translation of ``run``'s
flags into ``lab.settings.RunSettings`` (the same settings object the app's Run page fills), so
the CLI and the app cannot drift apart. ``lab.cli`` runs the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import observers as ob
from lab.analyse.tools import Tool
from lab.awq import options as awq_options
from lab.destination import destination
from lab.scale.distributed import RankSplit
from lab.settings import RunSettings, SpecSettings, parse_bytes, parse_knob
from lab.vocab import (
    AWQ_METRIC_PREFIX,
    AWQ_METRICS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_METRIC,
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    GPTQ_METRIC_PREFIX,
    GPTQ_METRICS,
    LAYER_TENSORS,
    MODEL_METRICS,
    PER_LAYER_PREFIX,
)
from sample_models.calibration_sets import CalibrationSource

ALL_LAYERS = "all"


class CliError(ValueError):
    """Bad command-line input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise CliError(f"{self.prog}: {message}")


def split_csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser(extra: Sequence[Callable[[Any], None]] = ()) -> argparse.ArgumentParser:
    """The parser of every command; ``extra`` adds commands a stage defines (``allocate``)."""
    parser = _Parser(prog="python -m observers", description="Observer Lab: compare quantization observers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser("list", help="observers (with knobs), element formats and presets")
    layers = commands.add_parser("layers", help="list a model's layers")
    layers.add_argument("model", help="minilm, tiny-llama, tiny-moe, a directory, a weights file or a hub id")
    layers.add_argument("--filter", default=None, help="glob over layer names, or a regex after 're:'")
    layers.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    run = commands.add_parser("run", help="run observers on layers and export the chosen qparams")
    add_scheme_flags(run)
    run.add_argument(
        "--choose-by",
        default=DEFAULT_METRIC,
        help=f"metric: {', '.join(ob.HIGHER_IS_BETTER)}, as served (layers a server fuses share scales); "
        f"{PER_LAYER_PREFIX}<metric> with each layer's own scales, for a runtime that does not fuse; with --gptq also "
        + ", ".join(GPTQ_METRIC_PREFIX + name for name in GPTQ_METRICS)
        + "; with --awq, what each mapping's observer is chosen by: "
        + ", ".join(AWQ_METRIC_PREFIX + name for name in AWQ_METRICS),
    )
    run.add_argument("--out", required=True, type=destination, help="Observer Lab JSON file to write")
    run.add_argument("--report", type=destination, help="HTML report to write")
    run.add_argument(
        "--allow-uncalibrated",
        action="store_true",
        help="export even when some activation tensors saw no calibration tokens (recorded as uncalibrated)",
    )
    run.add_argument("--compressed-tensors", dest="ct_dir", help="directory for the compressed-tensors export")
    run.add_argument(
        "--choose",
        action="append",
        default=[],
        metavar="GLOB=OBSERVER",
        type=_choice_rule,
        help="every tensor of the layers GLOB matches takes OBSERVER instead of the best by --choose-by "
        "(repeatable; later rules win)",
    )
    add_deployment_flags(run)
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--chunk",
        type=int,
        help="sweep: analyse this many layers at a time, writing each chunk to OUT.partial.jsonl as it finishes "
        "(default with --layers all: 1, or 8 when activations are captured, one calibration pass per chunk)",
    )
    run.add_argument(
        "--split",
        choices=[split.value for split in RankSplit],
        help="torchrun: what the ranks divide; 'batches' (default when activations are captured): each rank "
        "captures a share of the calibration batches and the observers merge their statistics; 'layers': each "
        "layer is analysed whole by one rank, bit for bit as one process",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="sweep: go on from OUT.partial.jsonl of an interrupted sweep with the same settings, skipping its layers",
    )
    _add_effect_commands(commands)
    export = commands.add_parser(
        "export", help="a saved choices file (Observer Lab JSON) as a compressed checkpoint and/or recipe"
    )
    export.add_argument("choices", help="the Observer Lab JSON file (from run, or saved by the app)")
    export.add_argument("--model", required=True, help="the model the choices were made for")
    export.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    add_deployment_flags(export)
    for add in extra:
        add(commands)
    return parser


def _choice_rule(text: str) -> tuple[str, str]:
    """``GLOB=OBSERVER`` as ``(glob, observer)``."""
    glob, sep, observer = text.partition("=")
    if not sep or not glob.strip() or not observer.strip():
        raise argparse.ArgumentTypeError(f"expected GLOB=OBSERVER, got {text!r}")
    return glob.strip(), observer.strip()


def add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    """What a choice becomes for serving: a compressed checkpoint and an llm-compressor recipe."""
    parser.add_argument(
        "--checkpoint",
        help="directory for a compressed checkpoint (compressed-tensors packed) that transformers and vLLM load",
    )
    parser.add_argument(
        "--recipe", type=destination, help="llm-compressor recipe (YAML) that reproduces each layer's observer"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --checkpoint directory")


def add_held_out_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--held-out", help="UTF-8 text file to evaluate on (default: the built-in held-out paragraphs)")
    parser.add_argument(
        "--held-out-samples",
        type=int,
        help="at most this many windows (decoders) or sentences (encoders) of held-out text (default 64)",
    )
    parser.add_argument("--held-out-seq-len", type=int, help="tokens per held-out window or sentence (default 128)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_effect_commands(commands) -> None:
    """``evaluate`` (a choices file, end to end) and ``sensitivity`` (one tensor at a time, with
    ``run``'s scheme flags): model-level effect on held-out text (``lab.effect.evaluate``,
    ``lab.effect.sensitivity``)."""
    evaluate = commands.add_parser("evaluate", help="what a choices file does to the model's output on held-out text")
    evaluate.add_argument("model", help="the model the choices file was made for")
    evaluate.add_argument("--choices", required=True, help="Observer Lab JSON file (from 'run' or the app)")
    evaluate.add_argument("--out", required=True, type=destination, help="JSON file to write the evaluation to")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    memory = evaluate.add_mutually_exclusive_group()
    memory.add_argument("--sequential", dest="sequential", action="store_const", const=True, default=None)
    memory.add_argument("--whole-model", dest="sequential", action="store_const", const=False)
    evaluate.add_argument("--max-memory", help="memory budget, e.g. 8GB: larger models run block by block")
    add_held_out_flags(evaluate)
    sensitivity = commands.add_parser(
        "sensitivity", help="quantize one tensor at a time with each observer and measure the model's output"
    )
    add_scheme_flags(sensitivity)
    sensitivity.add_argument(
        "--metric",
        help=f"model-level metric that ranks: {', '.join(MODEL_METRICS)} (default: kl, or cosine for encoders)",
    )
    sensitivity.add_argument(
        "--local-metric", default=DEFAULT_METRIC, help=f"local metric to compare with: {', '.join(ob.HIGHER_IS_BETTER)}"
    )
    sensitivity.add_argument(
        "--out", required=True, type=destination, help="JSON file to write the table, ranking and comparison to"
    )
    sensitivity.add_argument("--report", type=destination, help="HTML report to write (with the model-level section)")
    add_held_out_flags(sensitivity)


def add_scheme_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that say what to analyse and how (model, layers, format or preset, granularity,
    observers, knobs, tensor kinds, KV cache, device, capture mode, calibration): ``run``'s, shared
    by ``sensitivity`` so that one set of flags means one scheme everywhere."""
    parser.add_argument("model", help="minilm, tiny-llama, tiny-moe, a directory, a weights file or a hub id")
    parser.add_argument(
        "--layers",
        required=True,
        help="comma-separated layer names or patterns (glob, or 're:regex'), or 'all': every layer with a weight "
        "matrix, streamed (a sweep)",
    )
    scheme = parser.add_mutually_exclusive_group(required=True)
    scheme.add_argument("--format", dest="dtype", help="element format, e.g. int4, int8, fp8_e4m3 (see 'list')")
    scheme.add_argument("--preset", help=f"compressed-tensors preset: {', '.join(ob.PRESET_NAMES)}")
    parser.add_argument("--strategy", help="tensor, channel, group, token or block")
    parser.add_argument("--group-size", type=int, help="columns per group for --strategy group")
    parser.add_argument("--block-size", help="ROWSxCOLS for --strategy block, e.g. 128x128")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false")
    parser.add_argument("--observers", help="comma-separated observer names (default: all)")
    parser.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="OBSERVER.KNOB=VALUE",
        help="set an observer knob, e.g. percentile.percentile=99.9 (repeatable; see 'list')",
    )
    parser.add_argument(
        "--actorder", action="store_true", help="group weight columns by input importance (GPTQ actorder)"
    )
    defaults = ob.GPTQSpec()
    parser.add_argument(
        "--gptq",
        action="store_true",
        help="also put each weight observer's qparams through GPTQ on its layer (the layer-output error and clipped "
        "share of round-to-nearest and of GPTQ, on the calibration inputs' Hessian); defaults are llm-compressor's",
    )
    parser.add_argument("--gptq-block-size", type=int, default=defaults.block_size, help="GPTQ's block of columns")
    parser.add_argument(
        "--gptq-dampening", type=float, default=defaults.dampening, help="added to H's diagonal, times its mean"
    )
    parser.add_argument(
        "--gptq-actorder",
        choices=list(ob.gptq.ACTORDER_ALIASES),
        default=defaults.actorder,
        help="sweep columns by decreasing H diagonal: static/weight (llm-compressor's default) keeps each column's "
        "group, group/dynamic forms groups in sweep order, none sweeps in order",
    )
    parser.add_argument(
        "--gptq-scales",
        choices=list(ob.gptq.SCALES),
        default=defaults.scales,
        help="fixed: the observer's scales from the original weight before the sweep (llm-compressor 0.14); refit: "
        "from the updated weights as the sweep reaches each group (the GPTQ paper, GPTQModel)",
    )
    awq_options.add_arguments(parser)
    parser.add_argument(
        "--transform",
        choices=[kind.value for kind in ob.TransformKind],
        help="observe the tensors a transformed model's layers see: 'hadamard' rotates weights and inputs (and "
        "key/value states per head) by a randomized Hadamard matrix, 'smoothquant' migrates input outliers into the "
        "weight; the float layer output is unchanged",
    )
    parser.add_argument("--transform-seed", type=int, default=0, help="seed of the Hadamard rotation's random signs")
    parser.add_argument(
        "--as",
        dest="as_tools",
        metavar="TOOLS",
        help="also observe each tensor as these tools would by default (their observer, knobs and conventions), "
        "comma-separated or 'all': llm-compressor, modelopt, quark, torch.ao; written beside the choice in the JSON",
    )
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="SmoothQuant migration strength in [0, 1] (--transform smoothquant)"
    )
    parser.add_argument(
        "--kinds", help="comma-separated tensor kinds: weight, input, output (default: weight or preset)"
    )
    parser.add_argument(
        "--kv-cache", dest="kv_dtype", help="also analyse key/value states of attention blocks in this format"
    )
    parser.add_argument("--kv-per-head", action="store_true", help="one k/v scale per KV head instead of per tensor")
    parser.add_argument("--attention", help="attention blocks for --kv-cache: names or patterns (default: all)")
    parser.add_argument(
        "--propagate",
        action="store_true",
        help="calibrate each block on the outputs of the blocks before it quantized with the choices so far "
        "(llm-compressor's sequential pipeline default); implies the layer-by-layer capture",
    )
    add_calibration_flags(parser)


def add_calibration_flags(parser: argparse.ArgumentParser) -> None:
    """Where and on what a run calibrates: device, capture mode, memory budget, samples, sequence
    length, batch size and the calibration set (``run``'s, ``sensitivity``'s and ``allocate``'s)."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument(
        "--sequential",
        dest="sequential",
        action="store_const",
        const=True,
        default=None,
        help="capture activations layer by layer (one block in memory at a time) even when the model fits",
    )
    memory.add_argument(
        "--whole-model", dest="sequential", action="store_const", const=False, help="never capture layer by layer"
    )
    parser.add_argument(
        "--max-memory",
        help="memory budget, e.g. 8GB or 150MiB: larger models are captured layer by layer "
        "(default: half of the free RAM, or of the free GPU memory on cuda)",
    )
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="calibration samples")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per calibration sample")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="samples per forward pass: the batches the observers see one by one (llm-compressor's default is 1)",
    )
    data = parser.add_argument_group("calibration set (default: the built-in paragraphs)")
    data.add_argument(
        "--dataset",
        metavar="PATH_OR_ID",
        help="the calibration records: a .txt (one record per line), .jsonl/.json/.csv/.parquet file, a "
        "save_to_disk directory or a hub dataset id; each record is one sample, truncated to --seq-len",
    )
    data.add_argument("--text-column", default="text", help="the records' text column (else a chat 'messages' column)")
    data.add_argument("--dataset-split", default="train", help="the split of a hub id or a saved DatasetDict")
    data.add_argument("--shuffle-seed", type=int, help="shuffle the records with this seed (default: file order)")


def _editor_changes(editor: SpecSettings, args: argparse.Namespace) -> None:
    """Apply ``--strategy``, ``--group-size``, ``--block-size`` and ``--symmetric`` to a spec editor."""
    if args.strategy is not None:
        editor.strategy = args.strategy
    if args.group_size is not None:
        editor.group_size = args.group_size
    if args.block_size is not None:
        try:
            editor.block_rows, editor.block_cols = (int(v) for v in args.block_size.lower().split("x"))
        except ValueError:
            raise CliError(f"--block-size must look like 128x128, got {args.block_size!r}") from None
    if args.symmetric is not None:
        editor.symmetric = args.symmetric


def _kinds(args: argparse.Namespace, preset_input: bool) -> list[str]:
    if not args.kinds:
        return ["weight", "input"] if preset_input else ["weight"]
    kinds = split_csv(args.kinds)
    unknown = [k for k in kinds if k not in LAYER_TENSORS]
    if unknown:
        raise CliError(f"unknown tensor kind(s) {', '.join(unknown)}; choose from {', '.join(LAYER_TENSORS)}")
    if args.preset is not None and not preset_input and any(k != "weight" for k in kinds):
        raise CliError(f"preset {args.preset} does not quantize activations (it keeps them in high precision)")
    return kinds


def knob_values(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--knob OBSERVER.KNOB=VALUE`` items as ``{observer: {knob: value}}``, each value read as
    its knob's declared type."""
    values: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, text = item.partition("=")
        observer, dot, knob = target.partition(".")
        if not (sep and dot and observer and knob):
            raise CliError(f"--knob must look like OBSERVER.KNOB=VALUE, got {item!r}")
        if observer not in ob.available():
            raise CliError(f"--knob {item!r}: unknown observer {observer!r}; available: {', '.join(ob.available())}")
        declared = ob.knob_specs(observer)
        if knob not in declared:
            raise CliError(f"--knob {item!r}: {observer} has no knob {knob!r}; it has {', '.join(declared)}")
        values.setdefault(observer, {})[knob] = parse_knob(declared[knob], f"--knob {target}", text)
    return values


def _tools(text: str | None) -> tuple[str, ...]:
    """``--as``: tool names, or every tool for ``all`` (checked by ``RunConfig``)."""
    if not text:
        return ()
    names = split_csv(text)
    return tuple(tool.value for tool in Tool) if names == ["all"] else tuple(names)


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """The ``RunSettings`` of ``run``'s flags: ``--format`` or ``--preset`` fills the editors as the
    Run page's format box or preset does, the spec flags change them, ``--kinds`` and
    ``--kv-cache`` say what to analyse."""
    settings = RunSettings(observers=observer_names(args.observers), knobs=knob_values(args.knob))
    preset_input = False
    if args.preset is not None:
        settings.apply_preset(args.preset)
        preset_input = ob.preset(args.preset)["input"] is not None
    else:
        settings.weight = SpecSettings(dtype=args.dtype)
        settings.act = SpecSettings(dtype=args.dtype)
    for editor in (settings.weight, settings.act):
        _editor_changes(editor, args)
    kinds = _kinds(args, preset_input)
    settings.wants = {kind: kind in kinds for kind in settings.wants}
    if args.kv_dtype is not None:
        settings.kv = SpecSettings(dtype=args.kv_dtype, strategy="channel" if args.kv_per_head else "tensor")
        settings.wants["kv"] = True
    elif args.kv_per_head or args.attention:
        raise CliError("--kv-per-head and --attention need --kv-cache FORMAT")
    settings.samples, settings.seq_len, settings.actorder = args.samples, args.seq_len, args.actorder
    settings.batch_size, settings.propagate = args.batch_size, args.propagate
    if args.dataset is not None:
        settings.dataset = CalibrationSource(args.dataset, args.text_column, args.dataset_split, args.shuffle_seed)
    settings.transform, settings.transform_seed, settings.smooth_alpha = args.transform, args.transform_seed, args.alpha
    settings.tools = _tools(args.as_tools)
    settings.gptq = _gptq(args)
    settings.sequential = args.sequential
    settings.max_memory = None if args.max_memory is None else parse_bytes(args.max_memory)
    if args.actorder and not settings.actorder_applies:
        raise CliError("--actorder needs group-wise integer weights (--strategy group) and input activations")
    return settings


def _gptq(args: argparse.Namespace) -> ob.GPTQSpec | None:
    """``--gptq`` and its knobs (a knob without ``--gptq`` is a mistake worth a line)."""
    given = {
        "block_size": args.gptq_block_size,
        "dampening": args.gptq_dampening,
        "actorder": args.gptq_actorder,
        "scales": args.gptq_scales,
    }
    if not args.gptq:
        if given != ob.GPTQSpec().to_dict():
            raise CliError("--gptq-block-size, --gptq-dampening, --gptq-actorder and --gptq-scales need --gptq")
        return None
    try:
        return ob.GPTQSpec(**given)
    except ValueError as err:
        raise CliError(f"--gptq: {err}") from None


def observer_names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(dict.fromkeys(ob.aliases().get(n, n) for n in split_csv(text)))  # llm-compressor's names too
    unknown = [n for n in names if n not in ob.available()]
    if unknown:
        raise CliError(f"unknown observer(s) {', '.join(unknown)}; available: {', '.join(ob.available())}")
    if not names:
        raise CliError("--observers is empty")
    return names
