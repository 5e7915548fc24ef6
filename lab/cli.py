"""``python -m observers``: the lab without a browser.

Subcommands: ``list`` (observers, formats, presets), ``layers MODEL`` and ``run MODEL ...``.
``run`` fills the same ``lab.settings.RunSettings`` the app's Run page fills (formats, presets,
knobs, activation order, calibration), then calls ``lab.pipeline.analyse`` and
``lab.results.choose`` as the app does, and writes the Observer Lab JSON, optionally an HTML
report and a compressed-tensors export: the same settings give the same file. Bad input ends
with exit code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import IO, Any

import observers as ob
from lab.results import spec_text
from lab.settings import RunSettings, SpecSettings, parse_knob
from lab.vocab import DEFAULT_METRIC, DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, LAYER_TENSORS
from observers.formats import formats_table

EXIT_BAD_INPUT = 2
BAR_WIDTH = 30


class CliError(ValueError):
    """Bad command-line input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise CliError(f"{self.prog}: {message}")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m observers", description="Observer Lab: compare quantization observers.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands.add_parser("list", help="observers (with knobs), element formats and presets")
    layers = commands.add_parser("layers", help="list a model's layers")
    layers.add_argument("model", help="minilm, tiny-llama, tiny-moe, a directory, a weights file or a hub id")
    layers.add_argument("--filter", default=None, help="glob over layer names, or a regex after 're:'")
    layers.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    run = commands.add_parser("run", help="run observers on layers and export the chosen qparams")
    run.add_argument("model", help="minilm, tiny-llama, tiny-moe, a directory, a weights file or a hub id")
    run.add_argument("--layers", required=True, help="comma-separated layer names or patterns (glob, or 're:regex')")
    scheme = run.add_mutually_exclusive_group(required=True)
    scheme.add_argument("--format", dest="dtype", help="element format, e.g. int4, int8, fp8_e4m3 (see 'list')")
    scheme.add_argument("--preset", help=f"compressed-tensors preset: {', '.join(ob.PRESET_NAMES)}")
    run.add_argument("--strategy", help="tensor, channel, group, token or block")
    run.add_argument("--group-size", type=int, help="columns per group for --strategy group")
    run.add_argument("--block-size", help="ROWSxCOLS for --strategy block, e.g. 128x128")
    sym = run.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false")
    run.add_argument("--observers", help="comma-separated observer names (default: all)")
    run.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="OBSERVER.KNOB=VALUE",
        help="set an observer knob, e.g. percentile.percentile=99.9 (repeatable; see 'list')",
    )
    run.add_argument("--actorder", action="store_true", help="group weight columns by input importance (GPTQ actorder)")
    run.add_argument("--kinds", help="comma-separated tensor kinds: weight, input, output (default: weight or preset)")
    run.add_argument(
        "--kv-cache", dest="kv_dtype", help="also analyse key/value states of attention blocks in this format"
    )
    run.add_argument("--kv-per-head", action="store_true", help="one k/v scale per KV head instead of per tensor")
    run.add_argument("--attention", help="attention blocks for --kv-cache: names or patterns (default: all)")
    run.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    run.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="calibration samples")
    run.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per calibration sample")
    run.add_argument("--choose-by", default=DEFAULT_METRIC, help=f"metric: {', '.join(ob.HIGHER_IS_BETTER)}")
    run.add_argument("--out", required=True, help="Observer Lab JSON file to write")
    run.add_argument("--report", help="HTML report to write")
    run.add_argument(
        "--allow-uncalibrated",
        action="store_true",
        help="export even when some activation tensors saw no calibration tokens (recorded as uncalibrated)",
    )
    run.add_argument("--compressed-tensors", dest="ct_dir", help="directory for the compressed-tensors export")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


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
    kinds = _csv(args.kinds)
    unknown = [k for k in kinds if k not in LAYER_TENSORS]
    if unknown:
        raise CliError(f"unknown tensor kind(s) {', '.join(unknown)}; choose from {', '.join(LAYER_TENSORS)}")
    if args.preset is not None and not preset_input and any(k != "weight" for k in kinds):
        raise CliError(f"preset {args.preset} does not quantize activations (it keeps them in high precision)")
    return kinds


def _knob_values(items: Sequence[str]) -> dict[str, dict[str, Any]]:
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


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    """The ``RunSettings`` of ``run``'s flags: ``--format`` or ``--preset`` fills the editors as the
    Run page's format box or preset does, the spec flags change them, ``--kinds`` and
    ``--kv-cache`` say what to analyse."""
    settings = RunSettings(observers=_observer_names(args.observers), knobs=_knob_values(args.knob))
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
    if args.actorder and not settings.actorder_applies:
        raise CliError("--actorder needs group-wise integer weights (--strategy group) and input activations")
    return settings


def _select(items: Sequence[Any], text: str, option: str, nothing: str) -> list[str]:
    """Names of ``items`` (objects with ``.name``) matching any comma-separated name or pattern
    of ``text``, in their own order; an item of ``text`` that matches nothing is an error."""
    from sample_models import filter_layers

    chosen: set[str] = set()
    for pattern in _csv(text):
        found = filter_layers(items, pattern)
        if not found:
            raise CliError(f"{option} {pattern!r} matches {nothing}")
        chosen.update(item.name for item in found)
    if not chosen:
        raise CliError(f"{option} is empty")
    return [item.name for item in items if item.name in chosen]


def select_attention(model: Any, text: str | None) -> list[str]:
    """Attention blocks matching ``--attention`` (all when ``text`` is None), in model order."""
    blocks = [SimpleNamespace(name=name) for name in model.attention_blocks()]
    if not blocks:
        raise CliError(f"{model.name} has no attention block whose keys and values can be captured")
    if text is None:
        return [block.name for block in blocks]
    return _select(blocks, text, "--attention", f"no attention block of {model.name}")


def select_layers(model: Any, text: str) -> list[str]:
    """Layers with a weight matrix matching ``--layers``, in model order."""
    matrix_layers = [info for info in model.layers() if len(info.shape) >= 2]
    return _select(matrix_layers, text, "--layers", f"no layer with a weight matrix (see 'layers {model.name}')")


def _observer_names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(_csv(text))
    unknown = [n for n in names if n not in ob.available()]
    if unknown:
        raise CliError(f"unknown observer(s) {', '.join(unknown)}; available: {', '.join(ob.available())}")
    if not names:
        raise CliError("--observers is empty")
    return names


class ProgressBar:
    """A plain-text progress bar on one terminal line: ``[#####.....] 12/40 label``."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, done: int, total: int, label: str) -> None:
        filled = BAR_WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r[{bar}] {done}/{total} {label[:60]:<60}{end}")
        self.stream.flush()


def _cmd_list(out: IO[str]) -> None:
    out.write("observers:\n")
    for name, description in ob.available().items():
        knobs = ", ".join(f"{k}={v!r}" for k, v in ob.knobs(name).items() if ob.knob_specs(name)[k].editable)
        out.write(f"  {name:<28} {description}\n  {'':<28} knobs: {knobs}\n")
    out.write("formats:\n")
    for row in formats_table():
        block = f"block {row['block_size']}" if row["block_size"] else "no block"
        out.write(
            f"  {row['name']:<28} {row['family']:<7} {row['element']:<10} {block:<10} scale {row['scale']:<24} "
            f"max {row['max_value']:g}\n"
        )
    out.write("presets:\n")
    for name in ob.PRESET_NAMES:
        parts = [f"{kind}: {'-' if spec is None else spec_text(spec)}" for kind, spec in ob.preset(name).items()]
        out.write(f"  {name:<28} {'; '.join(parts)}\n")


def _cmd_layers(args: argparse.Namespace, out: IO[str]) -> None:
    from sample_models import open_model

    model = open_model(args.model, device=args.device)
    infos = model.layers(args.filter)
    if not infos:
        raise CliError(f"--filter {args.filter!r} matches no layer of {args.model}")
    for info in infos:
        shape = "x".join(map(str, info.shape))
        out.write(f"{info.name}\t{info.type}\t{shape}\t{info.params}\n")


def _cmd_run(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    from lab import compressed_tensors, lab_json
    from lab.pipeline import analyse
    from lab.results import check_metric, choose

    check_metric(args.choose_by)
    settings = settings_from_args(args)
    config = settings.config(has_layers=True, has_attention=settings.wants["kv"])
    from sample_models import open_model  # after the cheap checks: importing transformers takes seconds

    model = open_model(args.model, device=args.device)
    layers = select_layers(model, args.layers)
    attention = select_attention(model, args.attention) if settings.wants["kv"] else []
    analysis = analyse(model, layers, config, progress=None if args.quiet else ProgressBar(err), attention=attention)
    for warning in analysis.warnings:
        err.write(f"warning: {warning}\n")
    choices = choose(analysis, args.choose_by)
    if not choices:
        raise CliError("no observer produced qparams for these settings: " + _first_error(analysis))
    lab_json.save_file(analysis, choices, args.out, args.choose_by, args.allow_uncalibrated)
    written = [args.out]
    if args.report:
        from lab.report import write_report

        written.append(str(write_report(analysis, choices, args.report, metric=args.choose_by)))
    if args.ct_dir:
        built = compressed_tensors.save_file(analysis, choices, args.ct_dir, args.allow_uncalibrated)
        written.append(args.ct_dir)
        for note in built.notes:
            err.write(f"note: {note}\n")
    for (layer, tensor), observer in choices.items():
        value = analysis.entry(layer, tensor).result(observer).metrics.get(args.choose_by)
        out.write(f"{layer}\t{tensor}\t{observer}\t{args.choose_by}={value:.6g}\n")
    out.write(f"wrote {', '.join(written)}\n")


def _first_error(analysis: Any) -> str:
    for entry in analysis.entries:
        for result in entry.results:
            if result.error:
                return f"{result.name}: {result.error}"
    return "nothing was analysed"


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
        if args.command == "list":
            _cmd_list(out)
        elif args.command == "layers":
            _cmd_layers(args, out)
        else:
            _cmd_run(args, out, err)
    except ValueError as exc:
        err.write("error: " + " ".join(str(exc).split()) + "\n")
        return EXIT_BAD_INPUT
    except OSError as exc:
        err.write(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": ") + "\n")
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
