"""``python -m observers``: the lab without a browser.

Subcommands: ``list`` (observers, formats, presets), ``layers MODEL``, ``run MODEL ...``, and the model-level ones:
``evaluate MODEL --choices FILE`` and ``sensitivity MODEL ...`` (``lab.effect.evaluate``, ``lab.effect.sensitivity``:
what a choice does to the model's output on held-out text). ``run`` fills the same ``lab.settings.RunSettings`` the
app's Run page fills (formats, presets, knobs, activation order, calibration), then calls
``lab.analyse.pipeline.analyse`` and ``lab.results.choose`` as the app does, and writes the Observer Lab JSON,
optionally an HTML report and a compressed-tensors export: the same settings give the same file. Bad input ends
with exit code 2 and one line on stderr, never a traceback; ``run --awq`` adds AWQ's table (``lab.awq.command``).

``run --layers all`` (or ``--chunk N``, ``--resume``, or several torchrun ranks) is a sweep (``lab.scale.sweep``):
layers are streamed in chunks, written as they finish and resumable; under ``torchrun`` the ranks split the layers
(``lab.scale.distributed``) and rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import observers as ob
from lab.allocate import command as allocate_command
from lab.awq import command as awq_command
from lab.cli_args import ALL_LAYERS, CliError, build_parser, settings_from_args, split_csv
from lab.gptq import hessians
from lab.history import command as history
from lab.progress_bar import ProgressBar
from lab.results import first_error, spec_text
from lab.results.served import record_value, served_text
from lab.scale import distributed
from lab.settings import parse_bytes
from lab.vocab import DEFAULT_METRIC, PER_LAYER_PREFIX
from observers.formats import formats_table

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# every command, the stages' too: what main parses with, and what the docs' CLI reference renders (docs/hooks)
command_parser = partial(build_parser, extra=(allocate_command.add_parser, history.add_parser))


def _select(items: Sequence[Any], text: str, option: str, nothing: str) -> list[str]:
    """Names of ``items`` (objects with ``.name``) matching any comma-separated name or pattern
    of ``text``, in their own order; an item of ``text`` that matches nothing is an error."""
    from sample_models import filter_layers

    chosen: set[str] = set()
    for pattern in split_csv(text):
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
    """Layers with a weight matrix matching ``--layers`` (all of them for ``all``), in model order."""
    matrix_layers = [info for info in model.layers() if len(info.shape) >= 2]
    if text.strip() == ALL_LAYERS:
        return [info.name for info in matrix_layers]
    return _select(matrix_layers, text, "--layers", f"no layer with a weight matrix (see 'layers {model.name}')")


def _open(args: argparse.Namespace) -> Any:
    """The model ``args.model`` on ``args.device``; imported late, after cheap checks (transformers takes seconds)."""
    from sample_models import open_model

    return open_model(args.model, device=args.device)


def _cmd_list(out: IO[str]) -> None:
    out.write("observers:\n")
    for name, description in ob.available().items():
        knobs = ", ".join(f"{k}={v!r}" for k, v in ob.knobs(name).items() if ob.knob_specs(name)[k].editable)
        out.write(f"  {name:<28} {description}\n  {'':<28} knobs: {knobs}\n")
    for alias, name in ob.aliases().items():
        out.write(f"  {alias:<28} another name of {name} (as llm-compressor users type it)\n")
    out.write("formats:\n")
    for row in formats_table():
        block = f"block {row['block_size']}" if row["block_size"] else "no block"
        out.write(f"  {row['name']:<28} {row['family']:<7} {row['element']:<10} {block:<10} ")
        out.write(f"scale {row['scale']:<24} max {row['max_value']:g}\n")
    out.write("presets:\n")
    for name in ob.PRESET_NAMES:
        parts = [f"{kind}: {'-' if spec is None else spec_text(spec)}" for kind, spec in ob.preset(name).items()]
        out.write(f"  {name:<28} {'; '.join(parts)}\n")


def _cmd_layers(args: argparse.Namespace, out: IO[str]) -> None:
    model = _open(args)
    infos = model.layers(args.filter)
    if not infos:
        raise CliError(f"--filter {args.filter!r} matches no layer of {args.model}")
    for info in infos:
        shape = "x".join(map(str, info.shape))
        out.write(f"{info.name}\t{info.type}\t{shape}\t{info.params}\n")


def _is_sweep(args: argparse.Namespace) -> bool:
    """Whether ``run`` streams its layers (``lab.scale.sweep``) rather than analysing them in one go."""
    streamed = args.layers.strip() == ALL_LAYERS or args.chunk is not None or args.resume
    return streamed or distributed.world_size() > 1


def _choice_line(layer: str, tensor: str, observer: str, metric: str, value: Any, fused: dict | None = None) -> str:
    """One chosen tensor: its observer and ``metric`` as served, and how a fusing server runs it
    (``lab.results.served.served_text``)."""
    shown = f"n/a (chosen by {DEFAULT_METRIC})" if value is None else f"{float(value):.6g}"
    return f"{layer}\t{tensor}\t{observer}\t{metric}={shown}{served_text(fused, metric)}\n"


def _cmd_run(args: argparse.Namespace, out: IO[str], err: IO[str], ranks: distributed.Ranks) -> None:
    from lab.analyse.pipeline import analyse
    from lab.export import compressed_tensors, lab_json
    from lab.gptq.table import gptq_lines
    from lab.results import check_metric, choose, metric_value, override

    check_metric(args.choose_by)
    settings = settings_from_args(args)
    config = settings.config(has_layers=True, has_attention=settings.wants["kv"])
    sweep = _is_sweep(args)
    awq = awq_command.check(args, config, sweep)
    if args.transform and args.ct_dir:
        raise CliError(
            "--compressed-tensors writes qparams for the model as it is; with --transform they are the qparams of the "
            "rotated or smoothed tensors, which the checkpoint does not hold: leave out one of the two"
        )
    if sweep and (args.report or args.ct_dir or args.choose):
        raise CliError(
            "--report, --compressed-tensors and --choose need every analysed tensor in memory, which a sweep "
            "(--layers all, --chunk, --resume or torchrun) does not keep: run them on a --layers list, or change "
            "choices with `export` on the sweep's file"
        )
    if args.transform and (args.checkpoint or args.recipe):
        raise CliError(
            "--checkpoint and --recipe apply qparams to the model as it is; with --transform they are the qparams of "
            "the rotated or smoothed tensors: leave out one of the two"
        )
    from sample_models import open_model  # after the cheap checks: importing transformers takes seconds

    model = open_model(args.model, device=ranks.device_for(args.device))
    layers = select_layers(model, args.layers)
    attention = select_attention(model, args.attention) if settings.wants["kv"] else []
    if sweep:
        from lab.scale.plan import Plan

        scope = (tuple(layers), config, tuple(attention))
        plan = Plan(model, *scope, args.choose_by, args.allow_uncalibrated, args.chunk, args.split)
        _cmd_sweep(args, plan, out, err, ranks)
        return

    def chosen(part: Any) -> dict:  # what propagation quantizes a settled block with: what the run exports
        return override(part, choose(part, args.choose_by), args.choose, part=True)

    bar = None if args.quiet else ProgressBar(err)
    analysing = partial(analyse, model, layers, config, progress=bar, attention=attention, choices=chosen)
    analysis, awq_document = awq_command.analysed(awq, model, layers, config, args, (out, err), analysing)
    for warning in analysis.warnings:
        err.write(f"warning: {warning}\n")
    for note in sorted({e.metrics_note for e in analysis.entries if e.metrics_note}):
        err.write(f"note: activation {note} (a seeded sample; the qparams saw every token)\n")
    choices = override(analysis, choose(analysis, args.choose_by), args.choose)
    if not choices:
        raise CliError(
            "no observer produced qparams for these settings: " + (first_error(analysis) or "nothing was analysed")
        )
    made_by = history.made_by()
    document = lab_json.save_file(analysis, choices, args.out, args.choose_by, args.allow_uncalibrated, made_by)
    records = {(record["layer"], record["tensor"]): record for record in document["entries"]}
    written = [args.out, str(history.save_beside(analysis, args.out, args.model, args.device))]
    written += awq_command.write(awq_document, args.out)  # its digest ties it to this very x.json
    if config.gptq is not None and hessians.save(hessians.directory_for(args.out), analysis.entries):
        written.append(str(hessians.directory_for(args.out)))  # what deploys its GPTQ choices later
    if args.report:
        from lab.results.report import write_report

        written.append(str(write_report(analysis, choices, args.report, args.choose_by, provenance=made_by)))
    if args.ct_dir:
        built = compressed_tensors.save_file(analysis, choices, args.ct_dir, args.allow_uncalibrated, made_by)
        written.append(args.ct_dir)
        for note in built.notes:
            err.write(f"note: {note}\n")
    if args.checkpoint or args.recipe:
        written += _deploy(args, lab_json.load_file(args.out), model, err, args.out)
    for (layer, tensor), observer in choices.items():
        entry, record = analysis.entry(layer, tensor), records.get((layer, tensor), {})
        local = args.choose_by.removeprefix(PER_LAYER_PREFIX) in ob.HIGHER_IS_BETTER and record
        value = record_value(record, args.choose_by) if local else metric_value(entry, observer, args.choose_by)
        out.write(_choice_line(layer, tensor, observer, args.choose_by, value, record.get("fused")))
        for run in entry.tool_results:
            value = run.result.metrics.get(args.choose_by)
            if value is None:
                out.write(f"{layer}\t{tensor}\tas {run.tool}: not available ({run.result.error})\n")
            else:
                out.write(_choice_line(layer, tensor, f"as {run.result.name}", args.choose_by, value))
    out.writelines(gptq_lines(analysis))
    out.write(f"wrote {', '.join(written)}\n")


def _cmd_sweep(args: argparse.Namespace, plan: Any, out: IO[str], err: IO[str], ranks: distributed.Ranks) -> None:
    """``run`` as a sweep of ``plan`` (a ``lab.scale.plan.Plan``); only rank 0 draws progress and reports."""
    from lab.export import lab_json
    from lab.scale.sweep import run_sweep

    note = plan.split_note(ranks.world_size)
    if note and ranks.is_main:
        err.write(f"note: {note}\n")
    for added in plan.added if ranks.is_main else ():
        err.write(f"warning: {added}\n")
    shortfall = plan.calibration_shortfall()
    if shortfall and ranks.is_main:
        err.write(f"warning: {shortfall}\n")
    bar = ProgressBar(err, "layers") if ranks.is_main and not args.quiet else None
    outcome = run_sweep(plan, args.out, resume=args.resume, progress=bar, ranks=ranks, provenance=history.made_by())
    if outcome is None:
        return
    for warning in outcome.warnings:
        err.write(f"warning: {warning}\n")
    if outcome.resumed:
        err.write(f"note: {outcome.resumed} of {len(plan.units())} layers came from the interrupted sweep\n")
    deployed = []
    if args.checkpoint or args.recipe:
        deployed = _deploy(args, lab_json.parse_document(outcome.document), plan.model, err, args.out)
    for entry in outcome.document["entries"]:
        observer, value = entry["chosen"]["observer"], record_value(entry, args.choose_by)
        out.write(_choice_line(entry["layer"], entry["tensor"], observer, args.choose_by, value, entry.get("fused")))
    out.write(f"wrote {', '.join([args.out, *deployed])}\n")


def _deploy(args: argparse.Namespace, lab_file: Any, model: Any, err: IO[str], path: str) -> list[str]:
    """``--checkpoint``/``--recipe`` from a choices file at ``path`` (GPTQ's Hessians, AWQ's scales beside it)."""
    from lab.export import checkpoint, recipe
    from lab.export.chosen import of_lab_file
    from lab.provenance import provenance_lines

    lab_file, awq = awq_command.deployed(lab_file, path)  # AWQ's choices, when an AWQ run wrote them for this file
    facts = checkpoint.check_fits(lab_file, model)  # once: it hashes every weight file
    written = []
    if args.checkpoint:
        bar = None if getattr(args, "quiet", False) else ProgressBar(err, "tensors")
        kept = hessians.read(hessians.directory_for(path)) if lab_file.config.get("gptq") else None
        options = {"overwrite": args.overwrite, "progress": bar, "facts": facts, "hessians": kept, "awq": awq}
        result = checkpoint.write(lab_file, model, args.checkpoint, **options)
        written.append(args.checkpoint)
        for note in result.notes:
            err.write(f"note: checkpoint: {note}\n")
    if args.recipe:
        chosen, asked = of_lab_file(lab_file.entries), provenance_lines(lab_file.provenance)
        built = recipe.of_chosen(chosen, facts, asked, lab_file.config.get("gptq"), awq)
        built.write(args.recipe)
        written.append(args.recipe)
        for note in built.notes:
            err.write(f"note: recipe: {note}\n")
    return written


def _cmd_export(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    """``export CHOICES --model MODEL``: a saved choices file as a checkpoint and/or a recipe."""
    from lab.export import lab_json

    if not (args.checkpoint or args.recipe):
        raise CliError("export writes --checkpoint DIR and/or --recipe FILE: name at least one")
    lab_file = lab_json.load_file(args.choices)
    lab_file = replace(lab_file, provenance=history.made_by(lab_file.provenance))
    model = _open(args)
    out.write(f"wrote {', '.join(_deploy(args, lab_file, model, err, args.choices))}\n")


def _held_out(args: argparse.Namespace) -> dict[str, Any]:
    """The Evaluator's held-out text options from ``--held-out*`` (defaults where not given)."""
    options: dict[str, Any] = {}
    if args.held_out is not None:
        try:
            text = Path(args.held_out).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CliError(f"--held-out {args.held_out}: not a UTF-8 text file") from None
        options["texts"] = [part for part in text.split("\n\n") if part.strip()]
    if args.held_out_samples is not None:
        options["samples"] = args.held_out_samples
    if args.held_out_seq_len is not None:
        options["seq_len"] = args.held_out_seq_len
    return options


def _evaluation_lines(evaluations: Sequence[Any], out: IO[str]) -> None:
    for evaluation in evaluations:
        values = " ".join(f"{k}={v:.6g}" for k, v in evaluation.metrics.items())
        out.write(f"{evaluation.name}\t{evaluation.tensors} tensors\t{values}\n")


def _cmd_evaluate(args: argparse.Namespace, out: IO[str]) -> None:
    """``evaluate MODEL --choices FILE --out FILE``: the file's choices against the float model."""
    from lab.effect.evaluate import Evaluator, document, float_set, from_lab_file
    from lab.export import lab_json

    lab_file = lab_json.load_file(args.choices)
    memory = None if args.max_memory is None else parse_bytes(args.max_memory)
    model = _open(args)
    kept = hessians.read(hessians.directory_for(args.choices)) if lab_file.config.get("gptq") else None
    choice_set = from_lab_file(lab_file, model, name=args.choices, hessians=kept)
    evaluator = Evaluator(model, sequential=args.sequential, max_memory=memory, **_held_out(args))
    evaluations = [evaluator.evaluate(float_set()), evaluator.evaluate(choice_set)]
    _write_json(args.out, document(evaluator, evaluations, choices=args.choices))
    _evaluation_lines(evaluations, out)
    out.write(f"wrote {args.out}\n")


def _cmd_sensitivity(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    """``sensitivity MODEL --layers ... <run's scheme flags> --out FILE``: one tensor at a time."""
    from lab.analyse.pipeline import analyse
    from lab.effect.evaluate import Evaluator, document
    from lab.effect.sensitivity import compare, sensitivity
    from lab.results import check_metric
    from lab.vocab import MODEL_METRICS

    if args.metric is not None and args.metric not in MODEL_METRICS:
        raise CliError(f"--metric {args.metric!r} is not a model-level metric; choose from {', '.join(MODEL_METRICS)}")
    check_metric(args.local_metric)
    if getattr(args, "transform", None) or getattr(args, "as_tools", None):
        raise CliError("sensitivity evaluates the model as it is: --transform and --as do not apply to it")
    settings = settings_from_args(args)
    config = settings.config(has_layers=True, has_attention=settings.wants["kv"])
    held_out = _held_out(args)
    model = _open(args)
    layers = select_layers(model, args.layers)
    attention = select_attention(model, args.attention) if settings.wants["kv"] else []
    evaluator = Evaluator(model, sequential=config.sequential, max_memory=config.max_memory, **held_out)
    analysis = analyse(model, layers, config, progress=None if args.quiet else ProgressBar(err), attention=attention)
    kinds = list(dict.fromkeys(e.tensor for e in analysis.entries))
    bar = None if args.quiet else ProgressBar(err, "runs")
    table = sensitivity(
        evaluator, analysis, tensors=kinds, metric=args.metric, local_metric=args.local_metric, progress=bar
    )
    evaluations = compare(evaluator, analysis, table)
    extra = {"sensitivity": table.to_dict(analysis), "config": analysis.config.to_dict()}
    _write_json(args.out, document(evaluator, evaluations, **extra))
    written = [args.out]
    if args.report:
        from lab.results.report import write_report

        effect = (table, evaluations)
        written.append(str(write_report(analysis, table.choices(analysis), args.report, args.local_metric, effect)))
    for row in table.ranking().head(10).itertuples(index=False):
        out.write(f"{row.rank}\t{row.layer}\t{row.tensor}\tleast harmful {row[3]}\t{table.metric}={row[4]:.6g}\n")
    _evaluation_lines(evaluations, out)
    out.write(f"wrote {', '.join(written)}\n")


def _cmd_allocate(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    """``allocate MODEL --layers ... --schemes ... --budget B``: see ``lab.allocate.command``."""
    held_out = _held_out(args)
    request = allocate_command.check(args, held_out.get("texts"))
    model = _open(args)
    layers = select_layers(model, args.layers)
    deploy = lambda lab_file: _deploy(args, lab_file, model, err, args.out)  # noqa: E731
    allocate_command.run(args, request, model, layers, held_out, deploy, out, err)


def _write_json(path: str, document: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, allow_nan=False, indent=1)


def _interrupted(args: argparse.Namespace | None) -> str:
    """The line Ctrl-C leaves: for a sweep, where its finished layers are and how to go on."""
    if args is None or args.command != "run" or not _is_sweep(args):
        return "interrupted\n"
    from lab.scale.sweep import partial_path

    kept = partial_path(args.out)
    return f"interrupted: finished layers are kept in {kept}; run the same command with --resume to go on\n"


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input, 130 interrupted)."""
    out, err = out or sys.stdout, err or sys.stderr
    args = None
    try:
        args = command_parser().parse_args(argv)
        if args.command == "list":
            _cmd_list(out)
        elif args.command == "layers":
            _cmd_layers(args, out)
        elif args.command == "evaluate":
            _cmd_evaluate(args, out)
        elif args.command == "sensitivity":
            _cmd_sensitivity(args, out, err)
        elif args.command == "export":
            _cmd_export(args, out, err)
        elif args.command == "allocate":
            _cmd_allocate(args, out, err)
        elif args.command == "history":
            history.run(args, out)
        else:
            with distributed.ranks_for(args.device) as ranks:
                ranks.check_same(json.dumps(vars(args), sort_keys=True))
                _cmd_run(args, out, err, ranks)
    except KeyboardInterrupt:
        err.write("\n" + _interrupted(args))
        return EXIT_INTERRUPTED
    except ValueError as exc:
        err.write("error: " + " ".join(str(exc).split()) + "\n")
        return EXIT_BAD_INPUT
    except OSError as exc:
        err.write(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": ") + "\n")
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
