"""AWQ's command-line options, declared from ``observers.AWQ_KNOBS`` (the one declaration of each
knob's default and bounds): ``--awq`` and ``--awq-<knob>``, and the ``AWQSpec`` they give."""

from __future__ import annotations

import argparse
from typing import Any

import observers as ob
from lab.awq.search import DEPLOYED_VARIANT, Variant


def flag(knob: str) -> str:
    return "--awq-" + knob.replace("_", "-")


MODEL_LEVEL = ("deployed", "all")
"""``--awq-model-level``: the deployed variant's model-level effect (the default), or every variant's."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--awq`` and one flag per AWQ knob, defaults and help from the knob's declaration."""
    parser.add_argument(
        "--awq",
        action="store_true",
        help="also search AWQ's smoothing scales for each weight observer, four ways side by side: round-to-nearest, "
        "llm-compressor's AWQ (memoryless min-max in the search), the observer inside the search, and the joint "
        "clip search; a decoder's mappings, defaults llm-compressor's and ModelOpt's",
    )
    parser.add_argument(
        "--awq-variant",
        choices=[str(v) for v in Variant],
        default=None,
        help=f"which variant --checkpoint and --recipe deploy (default {DEPLOYED_VARIANT}: llm-compressor's AWQ); "
        "each mapping takes the observer --choose names for its layers, else the best by --choose-by when it is an "
        "awq: figure, else by awq:mapping_error; rtn deploys the analysis's own choices",
    )
    parser.add_argument(
        "--awq-model-level",
        choices=MODEL_LEVEL,
        default=None,
        help="whose model-level effect on held-out text the run measures: the variant --awq-variant deploys "
        "(default), or all four variants (one held-out pass of the model per distinct deployment, four times "
        "as many)",
    )
    for name, knob in ob.AWQ_KNOBS.items():
        kind = str if knob.choices else knob.type
        parser.add_argument(
            flag(name), dest=f"awq_{name}", type=kind, choices=knob.choices or None, default=None, help=knob.describe()
        )


def spec_of(args: argparse.Namespace) -> ob.AWQSpec | None:
    """The run's ``AWQSpec``, None without ``--awq``; a knob without ``--awq``, or out of its bounds,
    is one ``ValueError`` line."""
    given = {name: getattr(args, f"awq_{name}") for name in ob.AWQ_KNOBS if getattr(args, f"awq_{name}") is not None}
    if not args.awq:
        options = (("--awq-variant", args.awq_variant), ("--awq-model-level", args.awq_model_level))
        given = [flag(name) for name in given] + [option for option, value in options if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --awq")
        return None
    try:
        return ob.AWQSpec(**given)
    except ValueError as err:
        raise ValueError(f"--awq: {err}") from None


def variant_of(args: argparse.Namespace) -> Variant:
    """The variant the run deploys (``--awq-variant``)."""
    return DEPLOYED_VARIANT if args.awq_variant is None else Variant(args.awq_variant)


def model_level_variants(args: argparse.Namespace) -> tuple[Variant, ...]:
    """The variants whose model-level effect the run measures (``--awq-model-level``): the one it
    deploys, what the issue asks for, unless every one is asked for (each distinct deployment is
    one held-out pass of the whole model)."""
    return tuple(Variant) if args.awq_model_level == "all" else (variant_of(args),)


def conflict(settings: Any) -> str | None:
    """What AWQ cannot be combined with yet, in one line (None: nothing): ``settings`` is a run's
    ``RunConfig`` (the CLI) or the Run page's ``RunSettings``, both with ``transform``. GPTQ
    composes: the analysis's GPTQ figures are the unsmoothed weights', and a checkpoint runs each
    balance layer's GPTQ on its folded weight (``lab.export.checkpoint``). AWQ rides a layer-by-layer
    pass (``lab.awq.run``), which a whole-model capture is not, and decides what each next block
    receives, which propagation would too."""
    if settings.transform is not None:
        return "AWQ searches its scales on the model as it is: leave out the transform (rotation, smoothing) or AWQ"
    if settings.propagate:
        return (
            "AWQ hands each next block its smoothed block's float outputs, as llm-compressor's pipeline does: "
            "leave out the quantized propagation (--propagate)"
        )
    if settings.sequential is False:
        return "AWQ walks the blocks one at a time as llm-compressor's pipeline does: leave out the whole-model capture"
    return None
