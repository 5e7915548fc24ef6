"""``python -m observers allocate``: every chosen layer's scheme and observer under a size budget,
chosen by the model's own loss, the frontier over a sweep of budgets measured end to end, and the
allocation written as a choice (Observer Lab JSON, and a packed checkpoint and recipe from it).

``lab.cli`` parses, opens the model and hands this module the layers, the held-out options and
its deployment writer; every check that needs no model runs before the model is opened. The
held-out text is split in two (``lab.allocate.held_out``): the scores on one part, the frontier
measured on the other (and on the first, in sample).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lab.allocate.schemes import Budget, Scheme, describe, parse_budgets, parse_schemes
from lab.cli_args import (
    CliError,
    add_calibration_flags,
    add_deployment_flags,
    add_held_out_flags,
    knob_values,
    observer_names,
    split_csv,
)
from lab.destination import destination
from lab.vocab import MODEL_METRICS


def add_parser(commands: Any) -> None:
    """The ``allocate`` command's flags."""
    allocate = commands.add_parser(
        "allocate", help="each layer's scheme and observer under a size budget, by the model's own loss"
    )
    allocate.add_argument("model", help="minilm, tiny-llama, tiny-moe, a directory, a weights file or a hub id")
    allocate.add_argument(
        "--layers", required=True, help="comma-separated layer names or patterns (glob, or 're:regex')"
    )
    allocate.add_argument(
        "--schemes",
        required=True,
        help="candidate schemes, comma-separated: presets (NVFP4, W4A16, FP8, W8A8, MXFP4, …), 'none' (the layer "
        "stays in its dtype) or weight specs DTYPE[:STRATEGY[:SIZE]] such as int4:group:64",
    )
    allocate.add_argument(
        "--budget", help="the budget the exports take: average bits per weight over the layers (4.8) or a size (3.2GB)"
    )
    allocate.add_argument("--budgets", help="budgets of the frontier, comma-separated, in the unit of --budget")
    allocate.add_argument(
        "--kinds", help="'weight': weights only, even for schemes that quantize inputs (default: each scheme's own)"
    )
    allocate.add_argument("--observers", help="weight observers to score (default: every one that applies)")
    allocate.add_argument("--knob", action="append", default=[], metavar="OBSERVER.KNOB=VALUE", help="an observer knob")
    allocate.add_argument(
        "--metric",
        help=f"model-level metric that scores: {', '.join(MODEL_METRICS)} (default: kl, or cosine for encoders)",
    )
    allocate.add_argument(
        "--out", required=True, type=destination, help="Observer Lab JSON file of the allocation to write"
    )
    allocate.add_argument("--report", type=destination, help="HTML report to write: the frontier and the allocation")
    add_deployment_flags(allocate)
    add_calibration_flags(allocate)
    add_held_out_flags(allocate)


@dataclass(frozen=True)
class Request:
    """What ``allocate`` was asked, read and checked before the model is opened."""

    schemes: list[Scheme]
    budget: Budget
    budgets: list[Budget]


def check(args: argparse.Namespace, texts: Sequence[str] | None = None) -> Request:
    """The schemes, budgets, kinds and the held-out ``texts`` given (``--held-out``'s paragraphs;
    None: the built-in ones), which must split in two parts; one ``CliError`` for the first problem."""
    kinds = split_csv(args.kinds) if args.kinds else None
    if kinds is not None and (
        not kinds or any(kind not in ("weight", "input") for kind in kinds) or "weight" not in kinds
    ):
        raise CliError(
            f"--kinds {args.kinds!r}: allocate quantizes weights, with or without inputs: weight or weight,input"
        )
    if args.metric is not None and args.metric not in MODEL_METRICS:
        raise CliError(f"--metric {args.metric!r} is not a model-level metric; choose from {', '.join(MODEL_METRICS)}")
    try:
        schemes = parse_schemes(args.schemes, weights_only=kinds == ["weight"])
        budget, budgets = parse_budgets(args.budget, args.budgets)
    except ValueError as err:
        raise CliError(str(err)) from None
    if texts is not None:
        from sample_models.effect import split_held_out

        try:
            split_held_out(texts)
        except ValueError as err:
            raise CliError(f"--held-out {args.held_out}: {err}") from None
    return Request(schemes, budget, budgets)


def base_config(args: argparse.Namespace, scheme: Scheme) -> Any:
    """The calibration settings every scheme's analyses share (their specs are put in per scheme)."""
    from lab.analyse.run_config import RunConfig
    from lab.settings import parse_bytes
    from sample_models.calibration_sets import CalibrationSource

    dataset = None
    if args.dataset is not None:
        dataset = CalibrationSource(args.dataset, args.text_column, args.dataset_split, args.shuffle_seed)
    return RunConfig(
        specs={"weight": scheme.weight},
        observers=observer_names(args.observers),
        knobs=knob_values(args.knob),
        samples=args.samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dataset=dataset,
        sequential=args.sequential,
        max_memory=None if args.max_memory is None else parse_bytes(args.max_memory),
    )


def run(
    args: argparse.Namespace,
    request: Request,
    model: Any,
    layers: Sequence[str],
    held_out_options: dict[str, Any],
    deploy: Callable[[Any], list[str]],
    out: IO[str],
    err: IO[str],
) -> None:
    """Score on the held-out text's scoring part, solve, measure on both parts, write.
    ``deploy(lab_file)`` writes ``--checkpoint``/``--recipe``."""
    from lab.allocate import export, frontier, held_out
    from lab.allocate.score import score
    from lab.analyse.pipeline import analyse
    from lab.export import lab_json
    from lab.history.command import made_by
    from lab.progress_bar import ProgressBar
    from lab.runtime.fusion import fused_groups
    from lab.scheme.cost import LayerSizes

    schemes = request.schemes
    sizes = LayerSizes.of(model, layers)
    groups = fused_groups(layers)
    mine = frontier.scheme_layers(sizes, schemes)
    frontier.check_budgets(sizes, schemes, request.budgets)
    quiet = args.quiet
    base = base_config(args, next(s for s in schemes if not s.dense))
    parts = held_out.split(model, sequential=args.sequential, max_memory=base.max_memory, **held_out_options)
    err.write(f"note: schemes {describe(schemes)}\n")
    err.write(f"note: held-out text {parts.summary()}\n")
    for scheme in schemes:
        chosen = mine.get(scheme.name, list(layers))
        bits = sizes.scheme_bits(scheme.weight, scheme.input, chosen)
        where = "" if len(chosen) == len(layers) else f" (on the {len(chosen)} layers it applies to)"
        err.write(f"note: {scheme.name} takes {bits:.4g} bits per weight{where}, as the checkpoint stores it\n")
    for name, members in groups:
        if len(members) > 1:
            err.write(f"note: {name} shares one scheme ({len(members)} layers fused by the server)\n")

    def analysed(scheme: Scheme, config: Any, chosen: Sequence[str]) -> Any:
        return analyse(model, list(chosen), config)

    scores = score(
        parts, mine, schemes, base, analysed, metric=args.metric, progress=None if quiet else ProgressBar(err, "")
    )
    options = frontier.layer_options(scores, sizes, schemes)
    measured = frontier.frontier(
        parts, scores, options, groups, sizes, request.budgets, None if quiet else ProgressBar(err, "runs")
    )
    chosen = next(p for p in measured.allocations if p.budget == request.budget.text)
    if (args.checkpoint or args.recipe) and not export.quantized_layers(chosen):
        raise CliError(f"{chosen.name} keeps every layer dense: there is no checkpoint or recipe to write")
    settings = {"layers": list(layers), "budgets": [b.text for b in request.budgets], "held_out": parts.describe()}
    document = export.document(chosen, scores, schemes, measured, settings) | {"provenance": made_by()}
    Path(args.out).write_text(lab_json.dumps(document), encoding="utf-8")
    written = [args.out]
    if args.checkpoint or args.recipe:
        written += deploy(lab_json.parse_document(json.loads(lab_json.dumps(document))))
    if args.report:
        from lab.allocate.report import write_report

        written.append(str(write_report(args.report, measured, chosen, options, sizes)))
    for note in measured.notes:
        err.write(f"note: {note}\n")
    out.writelines(_point_line(p, measured.metric) for p in measured.points)
    if measured.spearman is not None:
        out.write(
            f"predicted (scoring part) against measured (measuring part): Spearman {measured.spearman:.3f} "
            f"over {len(measured.points)} points\n"
        )
    out.writelines(f"{c.layer}\t{c.scheme}\t{c.observer or '-'}\n" for c in chosen.choices)
    out.write(f"wrote {', '.join(written)}\n")


def _point_line(point: Any, metric: str) -> str:
    from lab.allocate.frontier import score_name

    measured, in_sample = ("n/a" if v is None else f"{v:.6g}" for v in (point.measured_score, point.in_sample_score))
    counts: dict[str, int] = {}
    for choice in point.choices:
        counts[choice.scheme] = counts.get(choice.scheme, 0) + 1
    mix = ", ".join(f"{scheme} {count}" for scheme, count in counts.items())
    name = score_name(metric)
    return (
        f"{point.name}\t{point.bits_per_weight:.4f} bits/weight\t{point.checkpoint_bytes:,} bytes\t"
        f"predicted {name}={point.predicted:.6g}\tin-sample {name}={in_sample}\tmeasured {name}={measured}\t{mix}\n"
    )
