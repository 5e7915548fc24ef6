"""``python -m observers run ... --awq``: the AWQ stage on the run's model, layers, weight spec,
weight observers and calibration set, its table printed and its rows written beside the run's JSON
(``x.json`` → ``x.awq.json``). The CLI's ``run`` only calls ``check`` before the model opens and
``run`` after its analysis."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import IO, Any

import observers as ob
from lab.awq.options import spec_of
from lab.export.json_values import json_safe

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
        return None
    if "weight" not in config.specs:
        raise ValueError("--awq smooths weights: the run needs a weight format (--kinds with weight)")
    if sweep:
        raise ValueError("--awq walks the model's blocks in one process: run it on a --layers list, not a sweep")
    if config.transform is not None:
        raise ValueError("--awq with --transform: AWQ's scales are searched on the model as it is; leave out one")
    if config.sequential:
        raise ValueError("--awq loads the model whole (it smooths each block in a copy): leave out --sequential")
    if config.gptq is not None:
        raise ValueError("--awq with --gptq: AWQ then GPTQ is not built yet; run them one at a time")
    return awq


def run(
    awq: ob.AWQSpec, model: Any, layers: list[str], config: Any, args: argparse.Namespace, out: IO[str], err: IO[str]
) -> str:
    """Search every mapping of the chosen layers for the run's weight observers (a progress bar on
    ``err`` unless ``--quiet``); print the table and write the rows beside ``--out``; returns the
    file written."""
    from lab.awq.effect import model_effect
    from lab.awq.run import run_awq
    from lab.awq.table import awq_frame, awq_lines, effect_lines
    from lab.effect.evaluate import Evaluator
    from lab.progress_bar import ProgressBar
    from lab.results import higher_is_better
    from lab.vocab import MODEL_METRIC_PREFIX

    progress = None if args.quiet else ProgressBar(err)
    observers = {name: dict(config.knobs.get(name, {})) for name in config.observers_for("weight")}
    texts = config.dataset if config.dataset is not None else (list(config.texts) if config.texts else None)
    found = run_awq(
        model,
        config.specs["weight"],
        observers,
        awq,
        layers=layers,
        texts=texts,
        samples=config.samples,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        progress=progress,
    )
    out.writelines(awq_lines(found))
    evaluator = Evaluator(model)
    effect = model_effect(model, found, evaluator)
    metric = evaluator.default_metric
    out.writelines(effect_lines(effect, metric, higher_is_better(f"{MODEL_METRIC_PREFIX}{metric}")))
    document = {
        "awq": awq.to_dict(),
        "weight": config.specs["weight"].to_dict(),
        "observers": list(observers),
        "tokens": found.tokens,
        "held_out_tokens": found.held_out_tokens,
        "left_out": list(found.left_out),
        "mappings": [
            {"smooth": r.mapping.smooth, "balance": list(r.mapping.balance), "parent": r.mapping.parent}
            for r in found.results
        ],
        "rows": _records(awq_frame(found)),
        "model": _records(effect),
        "held_out": evaluator.held_out,
    }
    target = path_for(args.out)
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    staging.write_text(json.dumps(json_safe(document), indent=1))
    staging.replace(target)
    return str(target)


def _records(frame) -> list[dict[str, Any]]:
    """The table's rows with missing values as None (JSON's null)."""
    return frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
