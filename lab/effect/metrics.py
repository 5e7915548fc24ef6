"""The model-level metrics of quantized outputs against the float model's on held-out text: a
decoder LM's KL(float || quantized) of next-token distributions, top-1 agreement and perplexity
(``decoder_metrics``; several models at once with the float side of each batch made once,
``decoder_metrics_of``, or a few windows at a time as a stacked run's logits come, ``FloatSides``), an
encoder's mean cosine of sentence embeddings and the Spearman correlation of the held-out
sentences' pairwise similarities (``encoder_metrics``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sample_models.effect import logit_windows


@dataclass(frozen=True)
class _FloatSide:
    """What every quantized model's figures on one held-out batch compare with: the float model's
    log-probabilities and probabilities, its top-1 token, its summed negative log likelihood of the
    next token, and which positions count (real ones; real ones whose next token is real)."""

    log_p: torch.Tensor
    p: torch.Tensor
    top1: torch.Tensor
    nll: float
    valid: torch.Tensor
    following: torch.Tensor
    target: torch.Tensor

    @classmethod
    def of(cls, float_logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> _FloatSide:
        log_p = torch.log_softmax(float_logits.float(), dim=-1)
        following = (valid[:, :-1] & valid[:, 1:]).float()
        target = ids[:, 1:].unsqueeze(-1)
        nll = -(log_p[:, :-1].gather(-1, target).squeeze(-1) * following).sum()
        top1 = log_p.max(-1).indices  # argmax's first maximum, twice as fast on CPU
        return cls(log_p, log_p.exp(), top1, float(nll), valid.float(), following, target)

    def against(self, logits: torch.Tensor) -> tuple[float, float, float, float]:
        """Sums over real positions: KL(float || quantized), top-1 agreements, the quantized
        model's negative log likelihood of the next token, and the positions predicted."""
        log_q = torch.log_softmax(logits.float(), dim=-1)
        agree = self.top1 == log_q.max(-1).indices
        nll_q = -(log_q[:, :-1].gather(-1, self.target).squeeze(-1) * self.following).sum()
        # p·(log p − log q) in log_q's own buffer: the same float operations as the expression
        # written out, without its three vocabulary-wide temporaries (a third of this call's time)
        kl = log_q.neg_().add_(self.log_p).mul_(self.p).sum(-1)
        return (
            float((kl * self.valid).sum()),
            float((agree.float() * self.valid).sum()),
            float(nll_q),
            float(self.following.sum()),
        )


def decoder_metrics(float_logits: Sequence[torch.Tensor], logits: Sequence[torch.Tensor], batches) -> dict[str, float]:
    """``kl`` (mean over real positions), ``top1_agreement``, ``perplexity`` of the quantized model
    and ``float_perplexity``, all in fp32."""
    return decoder_metrics_of(float_logits, [logits], batches)[0]


def decoder_metrics_of(
    float_logits: Sequence[torch.Tensor], runs: Sequence[Sequence[torch.Tensor]], batches
) -> list[dict[str, float]]:
    """``decoder_metrics`` of several quantized models' logits (``runs``, each per batch), the
    float side of each batch's windows computed once for all of them: each model's figures are the
    ones ``decoder_metrics`` gives it alone, bit for bit, and the ones a reduced stacked run gives
    it from the same logits (the same windows, ``logit_windows``, summed in the same order)."""
    sides = FloatSides(batches)
    sums: list[list[list]] = [[[] for _ in batches] for _ in runs]
    for index, batch in enumerate(batches):
        float_batch = float_logits[index]
        for rows in logit_windows(len(batch.input_ids)):
            for per_batch, run in zip(sums, runs, strict=True):
                per_batch[index].append(sides.against(index, rows, float_batch[rows], run[index][rows]))
    return [sides.metrics(per_batch) for per_batch in sums]


class FloatSides:
    """The float side of some windows of a held-out batch (``_FloatSide``), made when those windows
    are first asked for and kept until others are (a stacked run asks for one part's variants in
    turn, ``EffectRunner.run_stacked``), and the sums that make the decoder metrics, added part by
    part in order."""

    def __init__(self, batches) -> None:
        self.batches = batches
        self._current: tuple[tuple[int, int], _FloatSide] | None = None
        self._nll: dict[tuple[int, int], float] = {}

    def against(
        self, index: int, rows: slice, float_logits: torch.Tensor, logits: torch.Tensor
    ) -> tuple[float, float, float, float]:
        """``_FloatSide.against`` for windows ``rows`` of batch ``index`` (a ``Reduce``: the float
        and quantized logits of those windows)."""
        key = (index, rows.start or 0)
        if self._current is None or self._current[0] != key:
            batch = self.batches[index]
            self._current = (key, _FloatSide.of(float_logits, batch.input_ids[rows], batch.valid[rows]))
            self._nll[key] = self._current[1].nll
        return self._current[1].against(logits)

    def metrics(self, per_batch: Sequence[Sequence[tuple[float, float, float, float]]]) -> dict[str, float]:
        """One model's metrics from its sums per batch (a list per batch, one per ``logit_windows``
        part, every part's float side made by ``against`` first)."""
        kl = agree = nll_q = predicted = nll_p = count = 0.0
        for index, (parts, batch) in enumerate(zip(per_batch, self.batches, strict=True)):
            windows = logit_windows(len(batch.input_ids))
            for rows, sums in zip(windows, parts, strict=True):
                kl, agree, nll_q, predicted = kl + sums[0], agree + sums[1], nll_q + sums[2], predicted + sums[3]
                nll_p += self._nll[(index, rows.start)]
            count += float(batch.valid.sum())
        return {
            "kl": max(kl / count, 0.0),
            "top1_agreement": agree / count,
            "perplexity": math.exp(nll_q / predicted),
            "float_perplexity": math.exp(nll_p / predicted),
        }


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """0-based ranks of a 1-D tensor's values (ties by position: similarities of real sentences
    do not tie)."""
    order = x.argsort(stable=True)
    ranks = torch.arange(len(x), dtype=torch.float64, device=x.device)
    return torch.empty_like(x, dtype=torch.float64).scatter_(0, order, ranks)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (Pearson correlation of their ranks); exactly 1
    when the order is the same."""
    ra, rb = _ranks(a), _ranks(b)
    if torch.equal(ra, rb):
        return 1.0
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denominator if denominator else math.nan


def encoder_metrics(float_embeddings: Sequence[torch.Tensor], embeddings: Sequence[torch.Tensor]) -> dict[str, float]:
    """``cosine``: mean cosine of each sentence's embedding to its float one; ``spearman``: how
    well the ranking of all pairwise sentence similarities is kept."""
    f = torch.cat(list(float_embeddings)).float()
    q = torch.cat(list(embeddings)).float()
    cosine = F.cosine_similarity(f, q, dim=-1).clamp(-1.0, 1.0)
    rows, cols = torch.triu_indices(len(f), len(f), offset=1)
    similarity = [(F.normalize(x, dim=-1) @ F.normalize(x, dim=-1).T)[rows, cols] for x in (f, q)]
    return {"cosine": float(cosine.mean()), "spearman": spearman(*similarity)}
