"""Model-level effect of quantization: run the model with chosen tensors fake-quantized and keep
what a comparison with the float model needs.

An ``EffectRunner`` tokenizes held-out text (``held_out_texts``: paragraphs that are not
calibration text), records what every block receives besides its hidden states (masks, rotary
embeddings), and runs the float model once, keeping the hidden states at every block boundary.
``run(quantization)`` then fake-quantizes the chosen tensors inside the model (weights, layer
inputs and outputs, key/value states; static qparams or run-time ones for dynamic specs) and
starts from the first block the quantization touches: the float hidden states before it are
reused, so quantizing one layer of block k runs only blocks k.. and the head. Its result holds the
model's outputs (next-token logits of a decoder LM, mean-pooled sentence embeddings of an encoder)
and the SQNR of the hidden states after each block, so a person sees where the error enters.

The whole model is used when it is loaded or fits the memory budget; otherwise blocks are loaded
one at a time from the checkpoint (``sequential``'s skeleton and loader), for the float pass and for
every run. Hooks act only on the thread that installed them and the loaded module is never
changed, so another session sharing the model sees the float model. Only linear layers
(``nn.Linear``, ``Conv1D``) and attention blocks' key/value states can be quantized here.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

import observers as ob

from .calibration import Batch, make_batches
from .capture import forward_kwargs
from .kv import CACHE_ARGUMENTS, attention_kind, cache_argument
from .layers import expert_weight, resolve_layer
from .model import Model
from .sequential import _Call, _find_blocks, _LastBlockReached, _Loader, _split_call, _StandIn

HELD_OUT_FILE = Path(__file__).with_name("held_out_texts.json")
HELD_OUT_SAMPLES = 64
HELD_OUT_SEQ_LEN = 128
BATCH_SIZE = 16
LOGIT_WINDOWS = 4
"""Held-out windows whose logits a decoder's reduced stacked run makes at once (``run_stacked``):
512 tokens over a 32k vocabulary are 64 MB a tensor, where a batch of 16 windows is 256 MB and the
metrics hold four such tensors (128k vocabularies are four times as large)."""
POSITIONS_PER_ROW = 16
"""An encoder batch holds at most ``batch_size * POSITIONS_PER_ROW`` token positions, padding included."""
LINEAR_MODULES = ("Linear", "Conv1D")
FINAL_NORMS = ("norm", "final_layernorm", "ln_f")
REPLAY_TOLERANCE = 1e-3
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
Key = tuple[str, str]


@cache
def _held_out() -> tuple[str, ...]:
    return tuple(json.loads(HELD_OUT_FILE.read_text(encoding="utf-8")))


def held_out_texts() -> list[str]:
    """The shipped held-out paragraphs (prose, code, numbers, dialogue, lists, on other topics than
    the calibration paragraphs and sharing no sentence with them): the text model-level effect is
    measured on, so an observer is never judged on the text it was calibrated on."""
    return list(_held_out())


def split_held_out(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """Held-out paragraphs in two disjoint parts: the scoring part (the 1st, 3rd, 5th, …
    paragraph, blank ones dropped first) and the measuring part (the 2nd, 4th, …). A choice made
    on the scoring part is then measured on the measuring part, so the measurement is out of
    sample. Alternate paragraphs rather than halves because paragraphs often run by topic or kind
    (prose, code, lists), and alternating gives each part a share of each; by position, so the
    same text always splits the same way. Fewer than two paragraphs is a ``ValueError``: one part
    would be empty."""
    kept = [text for text in texts if text.strip()]
    if len(kept) < 2:
        raise ValueError(
            f"the held-out text has {len(kept)} paragraph(s); scoring on one part and measuring on another needs "
            "at least 2 (blank lines separate paragraphs)"
        )
    return kept[0::2], kept[1::2]


def sentences(texts: Sequence[str]) -> list[str]:
    """Texts split into sentences (after ``.``, ``!`` or ``?`` and at line breaks)."""
    return [part.strip() for text in texts for part in _SENTENCE_END.split(text) if part.strip()]


def model_kind(module: nn.Module) -> str:
    """``decoder`` for a causal LM (compared by next-token distributions), ``encoder`` for a model
    whose output is ``last_hidden_state`` (compared by sentence embeddings)."""
    if type(module).__name__.endswith("ForCausalLM"):
        return "decoder"
    return "encoder"


@dataclass(frozen=True)
class TensorQuant:
    """How one tensor is fake-quantized: its spec and static qparams, or ``qparams=None`` for a
    dynamic spec, whose qparams the runtime computes on every call (``ob.dynamic_fake_quantize``)."""

    spec: ob.QuantSpec
    qparams: ob.QParams | None = None
    weight: torch.Tensor | None = None
    """A weight's quantized values as they are to be used, when its qparams alone do not give them
    (GPTQ's error-updated weight, rounded with those qparams): taken as is."""
    made: Callable[[], torch.Tensor] | None = None
    """Or such a weight made when its layer runs (an AWQ deployment's, folded and quantized): a run
    holds it while the layer's block runs, not every layer's at once (26 GB for a 7B model)."""

    def __call__(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """``x`` (an activation ``(..., hidden)``, a weight ``(out, in)`` or attention states
        ``(batch, heads, seq, head_dim)``) quantized and dequantized, same shape and dtype."""
        if kind == "weight" and (self.weight is not None or self.made is not None):
            weight = self.weight if self.weight is not None else self.made()
            if weight.shape != x.shape:
                raise ValueError(f"a quantized weight of shape {tuple(weight.shape)} for a {tuple(x.shape)} layer")
            return weight.to(device=x.device, dtype=x.dtype)
        if self.qparams is None:
            return ob.dynamic_fake_quantize(x, self.spec)
        if kind == "activation":
            return ob.fake_quantize(x.reshape(-1, x.shape[-1]), self.qparams, self.spec).reshape(x.shape)
        return ob.fake_quantize(x, self.qparams, self.spec)


Quantization = Mapping[Key, TensorQuant]
"""``{(layer, "weight"|"input"|"output"): ...}`` and ``{(attention block, "k"|"v"): ...}``."""


Reduce = Callable[[int, slice, torch.Tensor, torch.Tensor], Any]
"""``reduce(batch index, windows, float logits, logits)``: what a decoder's stacked run keeps of one
variant's logits on some windows of one batch, given the float model's logits on the same windows."""


def logit_windows(count: int) -> list[slice]:
    """A batch of ``count`` windows in the parts whose logits are made at once (``LOGIT_WINDOWS``)."""
    return [slice(start, min(start + LOGIT_WINDOWS, count)) for start in range(0, count, LOGIT_WINDOWS)]


@dataclass
class RunResult:
    """One run: the model's outputs per batch (logits ``(b, s, vocab)`` of a decoder, sentence
    embeddings ``(b, hidden)`` of an encoder; what a ``Reduce`` made of them), the SQNR in dB of
    the hidden states after each block against the float run (``inf`` before the first quantized
    block), and the block it started at."""

    outputs: list[Any]
    block_sqnr_db: list[float]
    start: int


class _Resident:
    """The loaded model: blocks run in place, nothing is loaded or freed."""

    def __init__(self, model: Model) -> None:
        self.module = model.module()
        self.blocks_name, self.blocks = _find_blocks(self.module, model.source, model.config.num_hidden_layers)

    @contextmanager
    def block(self, index: int) -> Iterator[nn.Module]:
        yield self.blocks[index]

    def outer(self):
        return nullcontext()

    def record(self, batches: list[Batch], owner: int) -> tuple[list[list[_Call]], list[torch.Tensor], list]:
        """Each block's calls and the first block's inputs, from one forward pass per batch with
        pre-hooks on the blocks; also the module's own outputs (to check the replay against)."""
        calls: list[list[_Call]] = [[] for _ in self.blocks]
        first: list[torch.Tensor] = []

        def hook_for(index: int):
            def hook(module, args, kwargs):
                if threading.get_ident() != owner:
                    return
                hidden, call = _split_call(args, kwargs)
                calls[index].append(call)
                if index == 0:
                    first.append(hidden)

            return hook

        handles = [b.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, b in enumerate(self.blocks)]
        outputs = []
        try:
            with torch.no_grad():
                for batch in batches:
                    outputs.append(self.module(**forward_kwargs(self.module, batch)))
        finally:
            for handle in handles:
                handle.remove()
        return calls, first, outputs


class _Streamed:
    """A model larger than the budget: the skeleton of ``sequential``, one block loaded at a time
    from the checkpoint, the modules outside the blocks loaded when first called."""

    def __init__(self, model: Model, budget: int) -> None:
        self.seq = model._sequential.get()
        self.seq.check_budget(budget)
        self.module = self.seq.module
        self.blocks_name, self.blocks = self.seq.blocks_name, self.seq.blocks
        self.loader = _Loader(self.seq, model._store, model.device, budget)
        self._outer_depth = 0

    @contextmanager
    def block(self, index: int) -> Iterator[nn.Module]:
        block = self.blocks[index]
        self.loader.load(block, self.seq.block_name(index), recurse=True)
        try:
            yield block
        finally:
            self.loader.free(block)

    @contextmanager
    def outer(self) -> Iterator[None]:
        """The modules outside the blocks loaded as they are called and freed when the outermost
        ``with`` ends (float logits made inside a run's own ``outer`` keep the head it loaded)."""
        self._outer_depth += 1
        handles = []
        if self._outer_depth == 1:
            handles = [m.register_forward_pre_hook(lambda m, args: self.loader.ensure_outer(m)) for m in self.seq.outer]
        try:
            yield
        finally:
            self._outer_depth -= 1
            for handle in handles:
                handle.remove()
            if not self._outer_depth:
                self.loader.free_all()

    def record(self, batches: list[Batch], owner: int) -> tuple[list[list[_Call]], list[torch.Tensor], list]:
        """Each block's calls and the first block's inputs, the blocks replaced by stand-ins (the
        skeleton belongs to the model's sequential runs, which hold the same lock)."""
        calls: list[list[_Call]] = [[] for _ in self.blocks]
        first: list[torch.Tensor] = []

        def on_call(index: int, args: tuple, kwargs: dict) -> torch.Tensor:
            hidden, call = _split_call(args, kwargs)
            calls[index].append(call)
            if index == 0:
                first.append(hidden)
            if index == len(self.blocks) - 1:
                raise _LastBlockReached
            return hidden

        originals = list(self.blocks)
        try:
            for index in range(len(self.blocks)):
                self.blocks[index] = _StandIn(index, on_call)
            with self.outer(), torch.no_grad():
                for batch in batches:
                    try:
                        self.module(**forward_kwargs(self.module, batch))
                    except _LastBlockReached:
                        continue
        finally:
            for index, block in enumerate(originals):
                self.blocks[index] = block
        return calls, first, []


class _QuantizingCache(DynamicCache):
    """A KV cache that fake-quantizes the keys and values an attention block stores (after RoPE,
    as a quantized KV cache holds them) and hands them back to the attention without keeping them."""

    def __init__(self, quantize: Mapping[int, Mapping[str, TensorQuant]]) -> None:
        super().__init__()
        self._quantize = quantize

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        chosen = self._quantize.get(layer_idx, {})
        k = chosen["k"](key_states, "attention") if "k" in chosen else key_states
        v = chosen["v"](value_states, "attention") if "v" in chosen else value_states
        return k, v


class EffectRunner:
    """The float run of a model on held-out text, cached at every block boundary, and runs with
    chosen tensors fake-quantized that start from the first block they touch.

    ``texts`` (default ``held_out_texts()``): a decoder reads them as one stream cut into full
    windows of ``seq_len`` tokens (at most ``samples``); an encoder embeds them sentence by
    sentence (at most ``samples`` sentences of at most ``seq_len`` tokens). Text shorter than one
    window is refused. ``sequential``/``max_memory`` as in ``Model.capture``.
    """

    def __init__(
        self,
        model: Model,
        texts: Sequence[str] | None = None,
        *,
        samples: int = HELD_OUT_SAMPLES,
        seq_len: int = HELD_OUT_SEQ_LEN,
        batch_size: int = BATCH_SIZE,
        sequential: bool | None = None,
        max_memory: int | None = None,
    ) -> None:
        self.model = model
        with model._capture_lock:
            budget = model._sequential_budget(sequential, max_memory)
            self._backend = _Resident(model) if budget is None else _Streamed(model, budget)
            self.sequential = budget is not None
            self.kind = model_kind(self._backend.module)
            texts = held_out_texts() if texts is None else [t for t in texts if t.strip()]
            self.batches = self._held_out_batches(texts, samples, seq_len, batch_size)
            self.tokens = int(sum(int(b.valid.sum()) for b in self.batches))
            self._calls, first, module_outputs = self._backend.record(self.batches, threading.get_ident())
            self._boundaries: list[list[torch.Tensor]] = [first]
            decoder = self.kind == "decoder"
            float_run = self._run_blocks({}, 0, keep=True, tail=not decoder)
            self.float_outputs: Sequence[torch.Tensor] = _FloatLogits(self) if decoder else float_run.outputs
            self._check_replay(module_outputs)

    @property
    def num_blocks(self) -> int:
        return len(self._backend.blocks)

    @property
    def blocks_name(self) -> str:
        return self._backend.blocks_name

    # ------------------------------------------------------------ held-out text

    def _held_out_batches(self, texts: list[str], samples: int, seq_len: int, batch_size: int) -> list[Batch]:
        for knob, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"held-out {knob} must be a positive integer, got {value!r}")
        if not texts:
            raise ValueError("the held-out text is empty")
        tokenizer = self.model.tokenizer()
        if self.kind == "decoder":
            ids = tokenizer("\n\n".join(texts), add_special_tokens=False, verbose=False)["input_ids"]
            windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:samples]
            total = len(ids)
        else:
            encoded = tokenizer(sentences(texts)[:samples], truncation=True, max_length=seq_len)["input_ids"]
            # by length, so batches hold little padding; the metrics do not depend on the order
            windows = sorted((list(w) for w in encoded), key=len)
            total = sum(len(w) for w in encoded)
            if len(windows) < 3:
                raise ValueError(f"the held-out text has {len(windows)} sentence(s); comparing embeddings needs 3")
        if total < seq_len or not windows:
            raise ValueError(
                f"the held-out text has {total} tokens, shorter than one window of {seq_len} tokens: "
                "give more text or a shorter window"
            )
        device = self.model.device
        if self.kind == "decoder":
            padded = make_batches(tokenizer, windows, batch_size, device)
        else:
            groups = _by_positions(windows, batch_size * POSITIONS_PER_ROW)
            padded = [make_batches(tokenizer, group, len(group), device)[0] for group in groups]
        return [Batch(ids, mask, mask.bool()) for ids, mask in padded]

    # ------------------------------------------------------------ where a tensor lives

    def block_of(self, name: str) -> int | None:
        """The block index of a module, ``num_blocks`` for one after the blocks (the LM head), None
        for one before them (embeddings)."""
        prefix = f"{self.blocks_name}."
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            if index.isdigit():
                return int(index)
        return self.num_blocks if name in self._after_blocks else None

    def start_of(self, keys: Sequence[Key]) -> int:
        """The first block a quantization of ``keys`` changes (``num_blocks``: only the head)."""
        starts = [self.block_of(layer) for layer, _ in keys]
        if any(s is None for s in starts):
            bad = next(layer for (layer, _), s in zip(keys, starts, strict=True) if s is None)
            raise ValueError(f"{bad!r} runs before the first block; model-level evaluation quantizes blocks and head")
        return min(starts, default=self.num_blocks)

    def check(self, quantization: Quantization) -> None:
        """Refuse what cannot be quantized here: layers that are not linear modules of the model,
        key/value states of modules that are not attention blocks. ``ValueError`` naming each."""
        problems = []
        for layer, tensor in quantization:
            module = self._module(layer)
            if module is None:
                ref = resolve_layer(self._backend.module, layer)
                if ref is None:
                    problems.append(f"{layer}: not a layer of the loaded model")
                elif tensor != "weight":
                    problems.append(f"{layer} {tensor}: a fused MoE expert; only its weight can be evaluated")
            elif tensor in ("k", "v"):
                if attention_kind(module) is None:
                    problems.append(f"{layer} {tensor}: not an attention block with key/value states")
            elif type(module).__name__ not in LINEAR_MODULES:
                problems.append(f"{layer} {tensor}: a {type(module).__name__}; only linear layers can be evaluated")
        if problems:
            raise ValueError("cannot evaluate these choices on the model:\n  - " + "\n  - ".join(problems))
        self.start_of(list(quantization))

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self._backend.module.get_submodule(name)
        except AttributeError:
            return None

    @cached_property
    def _after_blocks(self) -> frozenset[str]:
        """Modules registered after the blocks (final norm, LM head, pooler): quantizing one of them
        changes only what follows the last block (an encoder's mean-pooled embedding uses none)."""
        names = [n for n, _ in self._backend.module.named_modules()]
        last = max(i for i, n in enumerate(names) if n == self.blocks_name or n.startswith(f"{self.blocks_name}."))
        return frozenset(names[last + 1 :])

    # ------------------------------------------------------------ running

    def run(self, quantization: Quantization, start: int | None = None, sqnr: bool = True) -> RunResult:
        """The model's outputs with ``quantization`` applied, from block ``start`` on (default: the
        first block it touches; 0 runs every block, which gives the same result). ``sqnr=False``
        skips the per-block SQNR (NaN in the result), which a sweep reading only outputs does not need."""
        self.check(quantization)
        first = self.start_of(list(quantization))
        start = first if start is None else start
        if not 0 <= start <= first:
            raise ValueError(f"start={start} must be between 0 and {first}, the first block this quantization touches")
        with self.model._capture_lock:
            return self._run_blocks(quantization, start, keep=False, sqnr=sqnr)

    def run_stacked(
        self, variants: Sequence[Quantization], start: int | None = None, reduce: Reduce | None = None
    ) -> list[RunResult]:
        """A ``run`` (``sqnr=False``) of each of ``variants``, quantizations of the same tensors of linear
        layers, in one pass: each held-out batch's hidden states repeated once per variant along the
        batch, each variant's tensors applied to its own share. The matrix products are larger (a
        CPU runs them faster) and the Python around them runs once; the outputs are each variant's
        own up to the last bits that a larger product sums in another order. With ``reduce`` (a
        decoder's), each batch's logits are made ``LOGIT_WINDOWS`` windows and one variant at a time
        and handed to ``reduce`` beside the float model's on the same windows; what it returns is
        kept in their place, a list per batch: logits over the whole vocabulary (256 MB a batch of
        the built-in held-out text over a 32k vocabulary, float or quantized) are never held for a
        batch."""
        if reduce is not None and self.kind != "decoder":
            raise ValueError("a reduced stacked run reduces a decoder's logits; an encoder's outputs are kept whole")
        if len(variants) == 1 and reduce is None:
            return [self.run(variants[0], start, sqnr=False)]
        keys = list(variants[0])
        if any(list(v) != keys for v in variants) or any(tensor in ("k", "v") for _, tensor in keys):
            raise ValueError("stacked runs quantize the same tensors of linear layers in every variant")
        for variant in variants:
            self.check(variant)
        first = self.start_of(keys)
        start = first if start is None else start
        if not 0 <= start <= first:
            raise ValueError(f"start={start} must be between 0 and {first}, the first block this quantization touches")
        n, owner = len(variants), threading.get_ident()
        with self.model._capture_lock, torch.inference_mode():
            hidden = [torch.cat([h] * n) for h in self._boundaries[start]]
            for index in range(start, self.num_blocks):
                inside = [{k: q for k, q in v.items() if self.block_of(k[0]) == index} for v in variants]
                with self._backend.block(index) as block, _stacked_hooks(self._backend.module, inside, owner):
                    calls = [
                        _Call(*_repeated((c.args, c.kwargs), len(h) // n, n), c.by_keyword)
                        for c, h in zip(self._calls[index], hidden, strict=True)
                    ]
                    hidden = [call.invoke(block, h, {}) for call, h in zip(calls, hidden, strict=True)]
            after = [{k: q for k, q in v.items() if self.block_of(k[0]) == self.num_blocks} for v in variants]
            with self._backend.outer():
                if reduce is None:
                    with _stacked_hooks(self._backend.module, after, owner):
                        outputs = [
                            list(self._tail(h, _repeated(batch, len(batch.input_ids), n)).chunk(n))
                            for h, batch in zip(hidden, self.batches, strict=True)
                        ]
                else:
                    outputs = [self._reduced(index, h.chunk(n), after, reduce) for index, h in enumerate(hidden)]
        nan = [math.nan] * self.num_blocks
        return [RunResult([o[i] for o in outputs], nan, start) for i in range(n)]

    def _reduced(self, index: int, shares: Sequence[torch.Tensor], after: list[Quantization], reduce: Reduce) -> list:
        """Each variant's reductions of batch ``index``'s logits (its share of the last hidden
        states, its quantization of the modules after the blocks), ``logit_windows`` at a time,
        the float logits of those windows made once for every variant, before any variant's hooks
        go in."""
        owner, batch = threading.get_ident(), self.batches[index]
        final = self._boundaries[self.num_blocks][index]
        found: list[list] = [[] for _ in shares]
        for rows in logit_windows(len(final)):
            float_logits = self._tail(final[rows], batch)
            for kept, share, quantization in zip(found, shares, after, strict=True):
                with self._hooks(quantization, owner):
                    kept.append(reduce(index, rows, float_logits, self._tail(share[rows], batch)))
        return found

    def _run_blocks(
        self, quantization: Quantization, start: int, keep: bool, sqnr: bool = True, tail: bool = True
    ) -> RunResult:
        """The blocks from ``start`` with ``quantization``, the hidden states after each kept as
        boundaries (``keep``: the float run) or compared with them (``sqnr``); the outputs made
        from the last (``tail``; none without it)."""
        hidden = self._boundaries[start]
        owner = threading.get_ident()
        sqnr_db = [math.inf if i < start or sqnr else math.nan for i in range(self.num_blocks)]
        for index in range(start, self.num_blocks):
            inside = {k: q for k, q in quantization.items() if self.block_of(k[0]) == index}
            with self._backend.block(index) as block, self._hooks(inside, owner), torch.inference_mode():
                overrides = self._kv_overrides(inside)
                hidden = [
                    call.invoke(block, h, overrides(call.kwargs))
                    for call, h in zip(self._calls[index], hidden, strict=True)
                ]
            if keep:
                self._boundaries.append(hidden)
            elif sqnr:
                sqnr_db[index] = self._sqnr(hidden, self._boundaries[index + 1])
        if not tail:
            return RunResult([], sqnr_db, start)
        after = {k: q for k, q in quantization.items() if self.block_of(k[0]) == self.num_blocks}
        with self._backend.outer(), self._hooks(after, owner), torch.inference_mode():
            outputs = [self._tail(h, batch) for h, batch in zip(hidden, self.batches, strict=True)]
        return RunResult(outputs, sqnr_db, start)

    def _sqnr(self, hidden: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
        signal = error = 0.0
        for h, ref, batch in zip(hidden, reference, self.batches, strict=True):
            valid = batch.valid
            ref32, h32 = ref[valid].float(), h[valid].float()
            signal += float(ref32.square().sum())
            error += float((h32 - ref32).square().sum())
        if error == 0.0:
            return math.inf
        return 10.0 * math.log10(signal / error) if signal > 0 else -math.inf

    def _head_module(self) -> nn.Module | None:
        get = getattr(self._backend.module, "get_output_embeddings", None)
        return get() if self.kind == "decoder" and get is not None else None

    def _final_norm(self) -> nn.Module | None:
        if self.kind != "decoder":
            return None
        base = getattr(self._backend.module, self._backend.module.base_model_prefix, None)
        return next((getattr(base, n) for n in FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)), None)

    def _tail(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Logits of a decoder (final norm, then the LM head), the mean of the last hidden states
        over real tokens for an encoder (the sentence embedding all-MiniLM-L6-v2 is trained for)."""
        if self.kind == "decoder":
            norm, head = self._final_norm(), self._head_module()
            if head is None:
                raise ValueError(f"{self.model.name}: a causal LM without an output embedding cannot be evaluated")
            return head(hidden if norm is None else norm(hidden)).float()
        mask = batch.attention_mask.unsqueeze(-1).float()
        return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def _check_replay(self, module_outputs: list) -> None:
        """Running the blocks one by one must give the model's own output, or every comparison
        after it would measure the replay instead of the quantization."""
        for output, mine, batch in zip(module_outputs, self.float_outputs, self.batches, strict=False):
            if self.kind == "decoder":
                theirs = output.logits.float()
            else:
                mask = batch.attention_mask.unsqueeze(-1).float()
                theirs = (output.last_hidden_state.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            scale = float(theirs.abs().max()) or 1.0
            if float((theirs - mine).abs().max()) > REPLAY_TOLERANCE * scale:
                raise ValueError(
                    f"{self.model.name}: running its blocks one by one does not reproduce the model's output, "
                    "so model-level effect cannot be measured on it"
                )

    # ------------------------------------------------------------ hooks

    def _kv_overrides(self, inside: Quantization) -> Callable[[dict], dict]:
        """Keyword arguments that replace a block call's KV cache (found in the call's recorded
        arguments under either of its names) with one that fake-quantizes the chosen states."""
        per_layer: dict[int, dict[str, TensorQuant]] = {}
        for (name, tensor), quant in inside.items():
            if tensor in ("k", "v") and attention_kind(self._module(name)) == "cache":
                per_layer.setdefault(self._module(name).layer_idx, {})[tensor] = quant
        if not per_layer:
            return lambda recorded: {}

        def overrides(recorded: dict) -> dict:
            name = next((key for key in CACHE_ARGUMENTS if key in recorded), cache_argument(self._module("")))
            return {name: _QuantizingCache(per_layer)}

        return overrides

    def _hooks(self, quantization: Quantization, owner: int):
        heads = self.model.config.num_attention_heads if self.model.config is not None else 1
        return quantizing_hooks(self._backend.module, quantization, heads, owner)


@contextmanager
def quantizing_hooks(root: nn.Module, quantization: Quantization, heads: int, owner: int) -> Iterator[None]:
    """Forward hooks on ``root``'s modules that fake-quantize the chosen tensors of linear layers
    (weight, input, output) and the key/value projections of encoder attention blocks (``heads``
    per projection), for the thread ``owner`` only; removed on exit, whatever happens. Key/value
    states read from a decoder's cache are quantized by the cache instead (``_QuantizingCache``).
    The weights of fused MoE experts (``experts.3.up_proj``) are quantized by their experts
    module, which runs once with them in place of its own (``_experts_swapped``)."""
    experts, rest = _experts_split(root, quantization)
    by_module: dict[str, dict[str, TensorQuant]] = {}
    for (name, tensor), quant in rest.items():
        module = root.get_submodule(name)
        if tensor in ("k", "v"):
            if attention_kind(module) == "projection":
                projection = f"{name}.{'key' if tensor == 'k' else 'value'}"
                by_module.setdefault(projection, {})[f"heads_{tensor}"] = quant
            continue
        by_module.setdefault(name, {})[tensor] = quant
    handles = []
    try:
        for name, chosen in by_module.items():
            hook = _linear_hook(chosen, heads, owner)
            handles.append(root.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
        for module, chosen in experts.items():
            before, after = _experts_swapped(chosen, owner)
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


class _FloatLogits(Sequence[torch.Tensor]):
    """A decoder's float logits per held-out batch, made from the float run's last hidden states
    when asked (the head's product again: the same numbers): held for every batch they took 0.5 GB
    over a 32k vocabulary, more than the rest of a run's activations together."""

    def __init__(self, runner: EffectRunner) -> None:
        self._runner = runner

    def __len__(self) -> int:
        return len(self._runner.batches)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        runner = self._runner
        final = runner._boundaries[runner.num_blocks][index]
        with runner.model._capture_lock, runner._backend.outer(), torch.inference_mode():
            return runner._tail(final, runner.batches[index])


@contextmanager
def _stacked_hooks(root: nn.Module, variants: Sequence[Quantization], owner: int) -> Iterator[None]:
    """``quantizing_hooks`` for stacked variants: a chosen linear layer's input and output are cut
    into one share per variant along the batch, and each share goes through that variant's hook
    (a fused experts module runs each share again with that variant's expert weights)."""
    split = [_experts_split(root, variant) for variant in variants]
    names = dict.fromkeys(name for name, _ in split[0][1])
    handles = []
    try:
        for name in names:
            hooks = [_linear_hook({t: q for (m, t), q in rest.items() if m == name}, 1, owner) for _, rest in split]
            handles.append(root.get_submodule(name).register_forward_hook(_share_hook(hooks), with_kwargs=True))
        for module in split[0][0]:
            hook = _experts_hook([experts.get(module, {}) for experts, _ in split], owner)
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _share_hook(hooks: list[Callable]) -> Callable:
    def hook(mod, args, kwargs, output):
        x = args[0] if args else next(iter(kwargs.values()))
        shares = list(zip(x.chunk(len(hooks)), output.chunk(len(hooks)), strict=True))
        found = [own(mod, (part,), {}, out) for own, (part, out) in zip(hooks, shares, strict=True)]
        return torch.cat([out if f is None else f for f, (_, out) in zip(found, shares, strict=True)])

    return hook


ExpertWeights = dict[tuple[int, str], TensorQuant]
"""A fused experts module's chosen weights: ``{(expert, "gate_proj"|"up_proj"|"down_proj"): ...}``."""


def _experts_split(root: nn.Module, quantization: Quantization) -> tuple[dict[nn.Module, ExpertWeights], dict]:
    """``quantization``'s fused-expert weights by experts module, and the rest as it is."""
    experts: dict[nn.Module, ExpertWeights] = {}
    rest = {}
    for (name, tensor), quant in quantization.items():
        ref = resolve_layer(root, name) if tensor == "weight" else None
        if ref is not None and ref.expert is not None:
            experts.setdefault(ref.module, {})[(ref.expert, ref.projection)] = quant
        else:
            rest[(name, tensor)] = quant
    return experts, rest


def _experts_swapped(chosen: ExpertWeights, owner: int) -> tuple[Callable, Callable]:
    """A forward pre-hook and a forward hook (called whatever happens) that run a fused experts
    module once with its chosen expert weights quantized: the quantized copies put in place of its
    parameters before the call and its own put back after it, for the thread ``owner`` only. One
    quantization needs no second run of the module (``_experts_hook`` runs it again per share)."""
    swapped = ExitStack()

    def before(mod, args):
        if threading.get_ident() == owner:
            swapped.enter_context(_parameters_swapped(mod, _quantized_experts(mod, chosen)))

    def after(mod, args, output):
        if threading.get_ident() == owner:
            swapped.close()

    return before, after


def _experts_hook(shares: list[ExpertWeights], owner: int) -> Callable:
    """A forward hook on a fused experts module that runs it again on each variant's share of the
    tokens (stacked variants) with that variant's chosen expert weights quantized, the
    module's own parameters put back after each share. Its inputs (hidden states, routing) are
    token-major, so a stacked batch's shares are contiguous rows. The quantized copies are made per
    call and let go after it: one extra copy of the module's weights at a time."""

    def hook(mod, args, kwargs, output):
        if threading.get_ident() != owner:
            return None
        n, rows = len(shares), output.shape[0]
        parts = []
        for index, chosen in enumerate(shares):
            if not chosen:
                parts.append(output.chunk(n)[index])
                continue
            shared_args = [_share_of(a, index, n, rows) for a in args]
            shared_kwargs = {k: _share_of(v, index, n, rows) for k, v in kwargs.items()}
            with _parameters_swapped(mod, _quantized_experts(mod, chosen)):
                parts.append(mod.forward(*shared_args, **shared_kwargs))
        return parts[0] if n == 1 else torch.cat(parts)

    return hook


def _share_of(value, index: int, n: int, rows: int):
    """Share ``index`` of ``n`` of a token-major tensor with ``rows`` rows; anything else as it is."""
    if n > 1 and isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
        return value.chunk(n)[index]
    return value


def _quantized_experts(mod: nn.Module, chosen: ExpertWeights) -> dict[str, torch.Tensor]:
    """Copies of a fused experts module's 3-D weights with the chosen experts' projections quantized."""
    copies = {name: getattr(mod, name).detach().clone() for name in ("gate_up_proj", "down_proj")}
    for (expert, projection), quant in chosen.items():
        view = expert_weight(copies, expert, projection)
        view.copy_(quant(view, "weight"))
    return copies


@contextmanager
def _parameters_swapped(mod: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``mod``'s parameters named in ``tensors`` replaced by them while the ``with`` runs."""
    saved = {name: mod._parameters[name] for name in tensors}
    try:
        mod._parameters.update(tensors)
        yield
    finally:
        mod._parameters.update(saved)


def _repeated(value, batch: int, n: int):
    """``value`` (a block call's keyword arguments, or a held-out ``Batch``) with every tensor whose
    first dimension is the batch repeated ``n`` times along it; one of size 1 broadcasts as it is."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value] * n) if value.dim() >= 2 and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, Batch):
        return Batch(*(torch.cat([t] * n) for t in (value.input_ids, value.attention_mask, value.keep)))
    if isinstance(value, dict):
        return {k: _repeated(v, batch, n) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_repeated(v, batch, n) for v in value)
    return value


def _linear_hook(chosen: dict[str, TensorQuant], heads: int, owner: int):
    weights: list[torch.Tensor] = []

    def hook(mod, args, kwargs, output):
        if threading.get_ident() != owner:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        y = output
        if "weight" in chosen or "input" in chosen:
            weight = _as_out_in(mod)
            if "weight" in chosen:
                if not weights:
                    weights.append(chosen["weight"](weight, "weight"))
                weight = weights[0]
            x_in = chosen["input"](x, "activation") if "input" in chosen else x
            y = F.linear(x_in, weight.to(x_in.dtype), None if mod.bias is None else mod.bias)
        if "output" in chosen:
            y = chosen["output"](y, "activation")
        for which in ("heads_k", "heads_v"):
            if which in chosen:
                per_head = y.reshape(*y.shape[:-1], heads, -1).transpose(-3, -2)
                y = chosen[which](per_head, "attention").transpose(-3, -2).reshape(y.shape)
        return y

    return hook


def _by_positions(windows: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Windows sorted by length, grouped so that each padded batch holds at most ``budget``
    positions (at least one window): short sentences share a batch, long ones do not pad it."""
    groups: list[list[list[int]]] = []
    for window in windows:
        if groups and (len(groups[-1]) + 1) * len(window) <= budget:
            groups[-1].append(window)
        else:
            groups.append([window])
    return groups


def _as_out_in(module: nn.Module) -> torch.Tensor:
    """A linear module's weight as ``(out, in)`` (``Conv1D`` stores it transposed)."""
    return module.weight.t() if type(module).__name__ == "Conv1D" else module.weight
