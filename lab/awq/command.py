"""``python -m observers run ... --awq``: the AWQ stage on the run's model, layers, weight spec,
weight observers and calibration set, its table printed and its rows written beside the run's JSON
(``x.json`` → ``x.awq.json``) with the deployment (``lab.awq.deploy``) and the digest of the
``x.json`` it belongs to. The CLI's ``run`` calls ``check`` before the model opens, ``ride`` with
its analysis (AWQ rides the analysis's calibration pass) and ``write`` once ``x.json`` is written;
``deployed`` gives a deployment its lab file with the AWQ choices in it (``run`` and ``export``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pandas as pd

import observers as ob
from lab.awq import deploy
from lab.awq.deploy import AWQDeploy
from lab.awq.effect import model_effect
from lab.awq.options import conflict, model_level_variants, spec_of, variant_of
from lab.awq.run import AWQRun, AWQWalk, Step, searched_mappings, walk_of_config
from lab.awq.search import Variant
from lab.awq.table import awq_frame, awq_lines, effect_lines
from lab.effect.evaluate import Evaluator
from lab.export.json_values import json_safe
from lab.export.lab_json import LabFile
from lab.progress_bar import ProgressBar
from lab.results import higher_is_better
from lab.vocab import AWQ_METRIC_PREFIX, MODEL_METRIC_PREFIX

SUFFIX = ".awq.json"


def path_for(lab_path: str | os.PathLike) -> Path:
    """Where the AWQ rows of the run saved as ``lab_path`` go: ``x.json`` → ``x.awq.json``."""
    path = Path(lab_path)
    return path.with_name(path.stem + SUFFIX)


def check(args: argparse.Namespace, config: Any, sweep: bool) -> ob.AWQSpec | None:
    """The run's ``AWQSpec`` (None without ``--awq``) after the checks that need no model: one line
    for what AWQ cannot be combined with yet."""
    awq = spec_of(args)
    if awq is None:
        if args.choose_by.startswith(AWQ_METRIC_PREFIX):
            raise ValueError(f"--choose-by {args.choose_by} ranks observers under AWQ: it needs --awq")
        return None
    if "weight" not in config.specs:
        raise ValueError("--awq smooths weights: the run needs a weight format (--kinds with weight)")
    if sweep:
        raise ValueError("--awq walks the model's blocks in one process: run it on a --layers list, not a sweep")
    why = conflict(config)
    if why is not None:
        raise ValueError(why)
    if args.choose_by.startswith(f"{AWQ_METRIC_PREFIX}gptq_") and config.gptq is None:
        raise ValueError(f"--choose-by {args.choose_by} ranks observers under AWQ then GPTQ: it needs --gptq")
    return awq


class MappingBars:
    """The walk's progress as one bar per mapping (its candidates judged, the time left), the
    mapping's number and name beside it: a 7B-wide mapping searches for minutes."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.number = 0
        self.bar = ProgressBar(stream, "candidates")

    def __call__(self, step: Step) -> None:
        if step.number != self.number:
            self.number, self.bar = step.number, ProgressBar(self.stream, "candidates")
        self.bar(step.done, step.total, f"AWQ {step.number}/{step.mappings} {step.name}")


def analysed(
    awq: ob.AWQSpec | None,
    model: Any,
    layers: list[str],
    config: Any,
    args: argparse.Namespace,
    streams: tuple[IO[str], IO[str]],
    analyse: Callable[..., Any],
) -> tuple[Any, dict[str, Any] | None]:
    """The run's analysis (``analyse(tap=None)``) and, with ``--awq``, AWQ riding its calibration
    pass (``ride``): the analysis and AWQ's document (None without AWQ)."""
    if awq is None:
        return analyse(), None
    out, err = streams
    return ride(awq, model, layers, config, args, out, err, lambda walk: analyse(tap=walk))


def ride(
    awq: ob.AWQSpec,
    model: Any,
    layers: list[str],
    config: Any,
    args: argparse.Namespace,
    out: IO[str],
    err: IO[str],
    analyse: Callable[[AWQWalk], Any],
) -> tuple[Any, dict[str, Any]]:
    """The run's analysis (``analyse(walk)``) with AWQ riding its calibration pass (a progress bar
    on ``err`` unless ``--quiet``), every mapping of the chosen layers searched for the run's weight
    observers; then the table, the model-level effect and the deployment printed. The document is
    written beside ``--out`` as soon as the walk is over, with its deployment (what the search found
    is kept if the analysis after the pass fails), again with the model-level effect, and returned
    for ``write`` to tie to ``x.json``."""
    if config.gptq is not None and (args.checkpoint or args.recipe):
        chosen = set(layers)
        mappings, listed = searched_mappings(model, layers)
        missing = [listed[b] for m in mappings.found for b in m.balance if listed[b] not in chosen]
        if missing:
            raise ValueError(
                "AWQ then GPTQ deploys every balance layer of a searched mapping through GPTQ, from the analysis's "
                f"Hessians: add {', '.join(missing)} to --layers"
            )
    decided: dict[str, Any] = {}

    def searched(found: AWQRun) -> None:
        decided["deployment"], decided["undeployable"] = _deployment(found, model, args)
        _write(_document(found, config, decided, pd.DataFrame(), None), None, path_for(args.out))

    walk = walk_of_config(model, layers, config, awq, None if args.quiet else MappingBars(err), searched)
    analysis = analyse(walk)
    found = walk.result()
    out.writelines(awq_lines(found))
    evaluator = Evaluator(model, sequential=config.sequential, max_memory=config.max_memory)
    measured = model_level_variants(args)
    try:
        effect, unmeasured = model_effect(model, found, evaluator, measured), None
    except ValueError as err:
        effect, unmeasured = pd.DataFrame(), " ".join(str(err).split())
    metric = evaluator.default_metric
    better = higher_is_better(f"{MODEL_METRIC_PREFIX}{metric}")
    out.writelines(effect_lines(effect, metric, better, deployed_only=len(measured) == 1))
    if effect.empty:
        why = unmeasured or decided["undeployable"] or "no observer deploys on every mapping"
        out.write(f"# model-level: not measured ({why})\n")
    if decided["deployment"] is not None:
        out.writelines(f"deploy\t{line}\n" for line in decided["deployment"].lines())
    if decided["undeployable"] is not None:
        out.write(f"deploy\tnot deployable: {decided['undeployable']}\n")
    document = _document(found, config, decided, effect, evaluator.held_out)
    _write(document, None, path_for(args.out))  # tied to x.json by ``write`` once it exists
    return analysis, document


def _deployment(found: AWQRun, model: Any, args: argparse.Namespace) -> tuple[AWQDeploy | None, str | None]:
    """What a checkpoint of the run holds (``--awq-variant``, ``--choose-by``, ``--choose``), or why
    none can be made (a ``ValueError`` when ``--checkpoint`` or ``--recipe`` needs one)."""
    variant = variant_of(args)
    if variant == Variant.RTN:
        return None, None
    figure = deploy.figure_of(args.choose_by)
    picks = deploy.choose_observers(found, variant, figure, args.choose)
    observers_of = {name: observer for name, (observer, _) in picks.items()}
    figures = {name: value for name, (_, value) in picks.items()}
    try:
        return deploy.of_run(model, found, variant, observers_of, figure, figures), None
    except ValueError as err:
        if args.checkpoint or args.recipe:
            raise
        return None, str(err)


def _document(
    found: AWQRun, config: Any, decided: dict[str, Any], effect: pd.DataFrame, held_out: dict | None
) -> dict[str, Any]:
    """``x.awq.json``'s content: the search's rows, the model-level effect and the deployment."""
    deployment = decided["deployment"]
    return {
        "awq": found.awq.to_dict(),
        "weight": config.specs["weight"].to_dict(),
        "observers": list(found.observers),
        "tokens": found.tokens,
        "held_out_tokens": found.held_out_tokens,
        "left_out": list(found.left_out),
        "mappings": [
            {"smooth": r.mapping.smooth, "balance": list(r.mapping.balance), "parent": r.mapping.parent}
            for r in found.results
        ],
        "rows": _records(awq_frame(found)),
        "model": _records(effect),
        "held_out": held_out,
        "deployed": None if deployment is None else deployment.to_dict(),
        "not_deployable": decided["undeployable"],
    }


def write(document: dict[str, Any] | None, lab_path: str | os.PathLike) -> list[str]:
    """Write ``run``'s document beside the run's JSON (just written at ``lab_path``), with that
    file's digest, so a later run that rewrites ``x.json`` without AWQ is never deployed with
    this one's scales; the paths written (none without a document)."""
    if document is None:
        return []
    target = path_for(lab_path)
    _write(document, _digest(lab_path), target)
    return [str(target)]


def _write(document: dict[str, Any], lab_file: str | None, target: Path) -> None:
    """The document with the digest of its ``x.json`` (None: not yet written, never deployed),
    written beside and moved into place."""
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    staging.write_text(json.dumps(json_safe({**document, "lab_file": lab_file}), indent=1))
    staging.replace(target)


def deployed(lab_file: LabFile, lab_path: str | os.PathLike) -> tuple[LabFile, AWQDeploy | None]:
    """``lab_file`` (read from ``lab_path``) with AWQ's choices in it, and the deployment, when an
    AWQ run wrote one beside it for this very file; else ``lab_file`` and None."""
    path = path_for(lab_path)
    if not path.is_file():
        return lab_file, None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable AWQ file ({err})") from None
    if document.get("lab_file") != _digest(lab_path):
        return lab_file, None
    if document.get("not_deployable"):
        raise ValueError(f"{path}: {document['not_deployable']}")
    if document.get("deployed") is None:
        return lab_file, None
    deployment = AWQDeploy.from_dict(document["deployed"])
    return deployment.applied(lab_file), deployment


def _digest(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _records(frame) -> list[dict[str, Any]]:
    """The table's rows with missing values as None (JSON's null)."""
    return frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
