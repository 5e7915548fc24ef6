"""An allocation's held-out text in two parts: every score is computed on the scoring part and
every allocation (and uniform scheme) is measured on the measuring part, so the frontier's measured
figures are out of sample: the layers were chosen on other sentences than the ones they are judged
on. Each point is also measured on the scoring part (in sample), so the gap between the two shows
how much of the prediction's agreement came from the text it was made on.

The split rule is ``sample_models.effect.split_held_out`` (alternate paragraphs), the same for the
built-in paragraphs and a person's own; each part has its own float run (an ``Evaluator``), capped
at ``samples`` windows or sentences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lab.effect.evaluate import Evaluator
from sample_models.effect import HELD_OUT_SAMPLES, HELD_OUT_SEQ_LEN, held_out_texts, split_held_out

SCORING, MEASURING = "scoring", "measuring"
PARTS = {"predicted": SCORING, "in_sample": SCORING, "measured": MEASURING}
"""Which part of the held-out text each of a frontier point's figures comes from."""
SPLIT_RULE = "alternate paragraphs: the 1st, 3rd, 5th, … score, the 2nd, 4th, … measure"


@dataclass(frozen=True)
class HeldOut:
    """The two parts' evaluators (``scoring``, ``measuring``), where the text came from
    (``source``) and how many paragraphs each part holds (``paragraphs``: scoring, measuring)."""

    scoring: Evaluator
    measuring: Evaluator
    source: str
    paragraphs: tuple[int, int]

    def describe(self) -> dict[str, Any]:
        """What an allocation's JSON records: the text, the split rule, each part's windows and tokens."""
        return {
            "texts": self.source,
            "split": SPLIT_RULE,
            **{
                part: {**evaluator.held_out, "texts": f"{count} paragraph(s)"}
                for part, evaluator, count in zip(
                    (SCORING, MEASURING), (self.scoring, self.measuring), self.paragraphs, strict=True
                )
            },
        }

    def summary(self) -> str:
        """The split in one line, for the CLI's notes, the report and the page."""
        scoring, measuring = self.paragraphs
        return (
            f"scored on {scoring} of the {scoring + measuring} {self.source} (the 1st, 3rd, …; "
            f"{self.scoring.runner.tokens} tokens), measured on the other {measuring} "
            f"({self.measuring.runner.tokens} tokens)"
        )


def split(
    model: Any,
    texts: Sequence[str] | None = None,
    *,
    samples: int = HELD_OUT_SAMPLES,
    seq_len: int = HELD_OUT_SEQ_LEN,
    sequential: bool | None = None,
    max_memory: int | None = None,
) -> HeldOut:
    """``texts`` (default: the built-in held-out paragraphs) split by ``split_held_out``, each part's
    float run made. Too few paragraphs, or a part too short for one window (three sentences for
    an encoder): a ``ValueError`` in one line, naming the part."""
    given = held_out_texts() if texts is None else [text for text in texts if text.strip()]
    parts = split_held_out(given)
    evaluators = []
    for name, part in zip((SCORING, MEASURING), parts, strict=True):
        try:
            evaluator = Evaluator(
                model, part, samples=samples, seq_len=seq_len, sequential=sequential, max_memory=max_memory
            )
        except ValueError as err:
            raise ValueError(
                f"{err} (the {name} part: {len(part)} of the held-out text's {len(given)} paragraphs)"
            ) from None
        evaluators.append(evaluator)
    source = "built-in held-out paragraphs" if texts is None else "given paragraphs"
    return HeldOut(evaluators[0], evaluators[1], source, (len(parts[0]), len(parts[1])))
