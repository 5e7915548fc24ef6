"""A parent module's calls replayed with its balance layers' weights replaced, many replacements in
one pass: the judge of AWQ's candidates.

llm-compressor runs the parent (the attention for q/k/v, the MLP for gate/up, the linear itself for
o and down) once per candidate. Here each batch's arguments are repeated once per replacement along
the batch and each balance layer computes every replacement's share with its own weight (one
batched matrix product), so the Python around the parent runs once for many candidates and
observers. A replacement's loss is llm-compressor's: the squared difference to the float output
summed over the real tokens of every batch, divided by the element count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from lab.awq.budget import ACTIVATION_BYTES
from lab.awq.moment import InputMoment

ROW_BLOCK = 32
"""Output rows of a linear parent's loss summed as one part (``LinearCalls``)."""

ROW_BLOCK_COST = 4
"""What one float64 multiply-add of ``LinearCalls``' row blocks costs in float32 multiply-adds of a
forward: measured 4.2 on a 2-core AVX-512 Xeon (``down_proj`` at hidden 1024, 2816 columns: 219 ms
a replacement against 76 ms for 4096 tokens), so a linear parent is judged by its row blocks only
where its tokens outnumber its input columns four times."""


class ParentCalls:
    """What a parent module received for each calibration batch (``args``, ``kwargs``) and which
    tokens of the batch are real (``valid``, ``(batch, seq)``; padding is left out of every loss)."""

    def __init__(self, module: nn.Module, calls: list[tuple[tuple, dict]], valid: list[torch.Tensor]) -> None:
        if not calls:
            raise ValueError("the parent module was never called: no calibration token reached it")
        self.module, self.calls, self.valid = module, calls, valid
        self._views = True

    def outputs(self) -> list[torch.Tensor]:
        """The parent's outputs with its current weights (the first output of a tuple)."""
        with torch.no_grad():
            return [_first(self.module(*args, **kwargs)) for args, kwargs in self.calls]

    def energy(self, reference: list[torch.Tensor]) -> float:
        """``Σ ref² / n`` over the real tokens: the reference for relative errors."""
        total = 0.0
        for valid, ref in zip(self.valid, reference, strict=True):
            total += float(ref.double().square().mul(_token_mask(valid, ref)).sum())
        return total / max(self.elements(reference), 1)

    def losses(
        self,
        balance: dict[str, nn.Linear],
        replacements: Sequence[dict[str, torch.Tensor]],
        reference: list[torch.Tensor],
        width: int,
        moment: InputMoment,
        activations: int = ACTIVATION_BYTES,
    ) -> torch.Tensor:
        """Each replacement's loss (float64, ``(len(replacements),)``): ``replacements`` give every
        balance layer's weight ``(out, in)``; ``width`` is the parent's widest activation per token.
        The sums are ``judged``'s: the calls, or a linear parent's blocks of output rows;
        ``activations``: the bytes of the widest activation one stacked call holds."""
        judged = self.judged(balance, moment)
        step = judged.step(width, activations)
        sums = torch.zeros(len(replacements), dtype=torch.float64)
        for start in range(0, len(replacements), step):
            chunk = replacements[start : start + step]
            with closing(judged.replay(balance, stacked(chunk), reference)) as calls:
                for call_sums in calls:
                    sums[start : start + len(chunk)] += call_sums
        return sums / max(judged.elements(reference), 1)

    def judged(self, balance: dict[str, nn.Linear], moment: InputMoment) -> ParentCalls | LinearCalls:
        """What a loss is summed over: the calls, or, for a parent that is its one balance layer
        (``o_proj``, ``down_proj``) whose tokens outnumber its input columns ``ROW_BLOCK_COST``
        times, the blocks of its output rows (``LinearCalls``: the same mean squared difference
        without running the tokens, each replacement costing ``out·in²`` float64 multiply-adds
        instead of ``tokens·in·out`` float32 ones)."""
        tokens = sum(int(v.sum()) if v.dim() and v.numel() else 0 for v in self.valid)
        if list(balance.values()) == [self.module] and tokens > ROW_BLOCK_COST * moment.columns:
            return LinearCalls(self.module.weight.detach(), moment.full())
        return self

    def step(self, width: int, activations: int = ACTIVATION_BYTES) -> int:
        """Replacements one stacked call holds (``activations`` bytes of the widest activation)."""
        return max(1, activations // max(1, max(int(v.numel()) for v in self.valid) * width * 4))

    def elements(self, reference: list[torch.Tensor]) -> int:
        """The output elements of real tokens a loss is the mean over."""
        total = 0
        for valid, ref in zip(self.valid, reference, strict=True):
            mask = _token_mask(valid, ref)
            total += int(mask.expand_as(ref).sum()) if mask.dim() else ref.numel()
        return total

    def replay(
        self,
        balance: dict[str, nn.Linear],
        weights: dict[str, torch.Tensor],
        reference: list[torch.Tensor],
        order: Sequence[int] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Per call (the calls at ``order``'s indices, in its order; None: every call in turn),
        each replacement's squared difference to the float output summed over the call's real
        tokens (float64, ``(n,)``): ``weights`` give each balance layer's ``n`` replacements laid
        out ``(n, out, in)`` (``stacked``), the calls run one by one, so a caller may stop after
        any (close the iterator: the balance layers' own forwards come back then)."""
        n = next(iter(weights.values())).shape[0]
        with _swapped(balance, weights), torch.no_grad():
            for index in range(len(self.calls)) if order is None else order:
                (args, kwargs), valid, ref = self.calls[index], self.valid[index], reference[index]
                out = _first(self._stacked_call(args, kwargs, ref.shape[0], n))
                squared = out.reshape(n, *ref.shape).sub_(ref).square_()
                mask = _token_mask(valid, ref)
                if not bool(mask.all()):
                    squared.mul_(mask)
                yield squared.flatten(1).sum(1, dtype=torch.float64).cpu()

    def _stacked_call(self, args: tuple, kwargs: dict, batch: int, n: int):
        """The module on ``n`` shares of a call's batch. A batch of one is shared as a view
        (``expand``: the same numbers, without writing ``n`` copies of the hidden states, the mask
        and the rotary tables for every call); a module that writes into its inputs or views them
        in another shape (a MoE block's ``view(-1, hidden)``) refuses a view loudly, and from then
        on gets copies."""
        if self._views and batch == 1:
            try:
                return self.module(*_repeat(args, batch, n, _expanded), **_repeat(kwargs, batch, n, _expanded))
            except RuntimeError:
                self._views = False
        return self.module(*_repeat(args, batch, n, _copied), **_repeat(kwargs, batch, n, _copied))


def _expanded(value: torch.Tensor, n: int) -> torch.Tensor:
    return value.expand(n, *value.shape[1:])


def _copied(value: torch.Tensor, n: int) -> torch.Tensor:
    return value.repeat(n, *([1] * (value.dim() - 1)))


class LinearCalls:
    """A linear parent's loss ``tr(Δ M Δᵀ)/out`` (``Δ`` the weight's change, ``M`` the mean
    ``x xᵀ`` of its inputs) in parts, one per block of ``ROW_BLOCK`` output rows: what a loss or
    a race reads of ``ParentCalls`` where the parent is its one balance layer, the row blocks
    standing for the calls. A part is a quadratic form of a second moment, so never negative (one
    rounded below zero counts as zero): its sums after some blocks bound the loss from below, as
    the calls' do."""

    def __init__(self, weight: torch.Tensor, moment: torch.Tensor) -> None:
        self.weight, self.moment = weight, moment
        out = weight.shape[0]
        self.calls = [slice(start, min(start + ROW_BLOCK, out)) for start in range(0, out, ROW_BLOCK)]

    def elements(self, reference: list[torch.Tensor] | None = None) -> int:
        """The loss is a mean over output columns: ``out``."""
        return self.weight.shape[0]

    def step(self, width: int, activations: int = ACTIVATION_BYTES) -> int:
        """Replacements one replay holds: ``activations`` bytes of a whole weight's float64
        difference and product (more than the stacked weights, or a block's parts, take)."""
        return max(1, activations // (16 * self.weight.numel()))

    def replay(
        self,
        balance: dict[str, nn.Linear],
        weights: dict[str, torch.Tensor],
        reference: list,
        order: Sequence[int] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Per row block (those at ``order``'s indices, in its order; None: every block in turn),
        each replacement's part ``Σ_rows δ M δᵀ`` (float64, ``(n,)``); ``weights``: the one
        layer's ``n`` replacements laid out ``(n, out, in)``."""
        (replaced,) = weights.values()
        m = self.moment.to(replaced.device, torch.float64)
        for rows in self.calls if order is None else [self.calls[index] for index in order]:
            delta = replaced[:, rows].double() - self.weight[rows].double()
            yield ((delta @ m) * delta).flatten(1).sum(1).clamp_min(0).cpu()


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _token_mask(valid: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``valid`` (batch, seq) as a mask broadcasting over ``ref`` (batch, seq, hidden), or over
    ``ref`` (tokens, hidden) when the parent sees the real tokens only (an expert)."""
    if ref.dim() == 3 and tuple(ref.shape[:2]) == tuple(valid.shape):
        return valid.to(ref.device, ref.dtype).unsqueeze(-1)
    return torch.ones((), dtype=ref.dtype, device=ref.device)


def _repeat(value, batch: int, n: int, repeat: Callable[[torch.Tensor, int], torch.Tensor]):
    """``value`` with every tensor whose first dimension is the batch repeated ``n`` times along it
    by ``repeat`` (hidden states, masks, rotary tables of a batch of one too)."""
    if isinstance(value, torch.Tensor):
        return repeat(value, n) if value.dim() >= 2 and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {k: _repeat(v, batch, n, repeat) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat(v, batch, n, repeat) for v in value)
    return value


def stacked(replacements: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each layer's replacement weights ``(out, in)`` laid out ``(n, out, in)``, what a replay
    reads: one copy in their own layout, or a view of the one replacement (a 7B-wide gate/up
    candidate is 360 MB, raced alone; a transposed copy of it cost more than its replay's products)."""
    if len(replacements) == 1:
        return {name: weight.unsqueeze(0) for name, weight in replacements[0].items()}
    return {name: torch.stack([r[name] for r in replacements]) for name in replacements[0]}


@contextmanager
def _swapped(balance: dict[str, nn.Linear], weights: dict[str, torch.Tensor]):
    """Each balance layer's forward swapped for one that gives each input share its own weight: the
    input ``(n·b, …, in)`` cut into ``n`` shares along the first dimension, share ``i`` multiplied
    by ``weights[name][i]`` ``(out, in)`` (one share: the layer's own linear map with that weight).
    The layer's own product is never computed (a forward hook would replace its output only after
    computing it, a third of an MLP parent's work thrown away)."""

    def forward_for(module: nn.Linear, name: str):
        def forward(x: torch.Tensor) -> torch.Tensor:
            w = weights[name].to(x.dtype)
            n = w.shape[0]
            if n == 1:
                return F.linear(x, w[0], module.bias)
            y = torch.bmm(x.reshape(n, -1, x.shape[-1]), w.transpose(1, 2))
            if module.bias is not None:
                y = y + module.bias
            return y.reshape(*x.shape[:-1], w.shape[1])

        return forward

    for name, module in balance.items():
        if type(module).forward is not nn.Linear.forward:
            raise TypeError(f"{name}: a balance layer must compute a plain linear map, not {type(module).__name__}")
    with ExitStack() as swapped:
        for name, module in balance.items():
            swapped.enter_context(forward_swapped(module, forward_for(module, name)))
        yield


@contextmanager
def forward_swapped(module: nn.Module, forward: Callable) -> Iterator[None]:
    """``module`` computing ``forward`` while the ``with`` runs; an instance ``forward`` that was
    there before (accelerate's offloading hooks set one) is put back after."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        del module.forward
        if previous is not None:
            module.forward = previous
