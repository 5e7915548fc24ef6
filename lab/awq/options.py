"""AWQ's command-line options, declared from ``observers.AWQ_KNOBS`` (the one declaration of each
knob's default and bounds): ``--awq`` and ``--awq-<knob>``, and the ``AWQSpec`` they give."""

from __future__ import annotations

import argparse

import observers as ob


def flag(knob: str) -> str:
    return "--awq-" + knob.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--awq`` and one flag per AWQ knob, defaults and help from the knob's declaration."""
    parser.add_argument(
        "--awq",
        action="store_true",
        help="also search AWQ's smoothing scales for each weight observer, four ways side by side: round-to-nearest, "
        "llm-compressor's AWQ (memoryless min-max in the search), the observer inside the search, and the joint "
        "clip search; a decoder's mappings, defaults llm-compressor's and ModelOpt's",
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
        if given:
            raise ValueError(f"{', '.join(flag(name) for name in given)} need --awq")
        return None
    try:
        return ob.AWQSpec(**given)
    except ValueError as err:
        raise ValueError(f"--awq: {err}") from None
