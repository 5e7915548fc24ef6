"""Attention views: per-head reshapes of projection captures, and key/value state capture for
KV-cache quantization (the tensors a compressed-tensors export scales as ``<attn>.k_scale`` and
``<attn>.v_scale``).

Layout: per-head tensors are ``(1, heads, tokens, head_dim)``: all real tokens of all calibration
sequences laid end to end on the sequence axis. Padding never enters the statistics, and per-tensor
or per-head observers reduce over exactly the values a KV cache would hold.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import Cache, DynamicCache

from .calibration import Batch
from .capture import Done, Key, Stream, forward_kwargs
from .sequential import SequentialRunner

DECODER_KV = ("k_proj", "v_proj")
ENCODER_KV = ("key", "value")


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(tokens, heads * head_dim) -> (1, heads, tokens, head_dim)."""
    if x.ndim != 2 or x.shape[1] % head_dim:
        raise ValueError(f"cannot split a {tuple(x.shape)} tensor into heads of size {head_dim}")
    return x.reshape(x.shape[0], -1, head_dim).permute(1, 0, 2).unsqueeze(0)


def head_dim_of(config) -> int:
    """Per-head width from a transformers config."""
    explicit = getattr(config, "head_dim", None)
    return explicit or config.hidden_size // config.num_attention_heads


def attention_kind(block: nn.Module) -> str | None:
    """How to read a block's keys and values: "cache" for decoder attention (post-RoPE keys, as
    the KV cache stores them), "projection" for encoder attention without rotary embeddings,
    None when the module is not an attention block we understand."""
    if all(isinstance(getattr(block, n, None), nn.Linear) for n in DECODER_KV) and hasattr(block, "layer_idx"):
        return "cache"
    if all(isinstance(getattr(block, n, None), nn.Linear) for n in ENCODER_KV):
        return "projection"
    return None


def attention_blocks(model: nn.Module) -> list[str]:
    """Names of the attention blocks whose keys and values can be captured."""
    return [name for name, module in model.named_modules() if name and attention_kind(module)]


class _Sink:
    """The kept states of every block (``kept[block][which]``: chunks of (tokens, heads, head_dim))
    and, with a ``stream``, every real token's states of the batch that is running."""

    def __init__(self, stream: Stream | None) -> None:
        self.kept: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: {"k": [], "v": []})
        self.stream = stream
        self.pending: dict[Key, list[torch.Tensor]] = defaultdict(list)

    def add(self, block: str, which: str, states: torch.Tensor, batch: Batch) -> None:
        """``states`` (batch, seq, heads, head_dim) of one batch."""
        self.kept[block][which].append(states[batch.keep])
        if self.stream is not None:
            self.pending[(block, which)].append(states[batch.valid])

    def flush(self, blocks: list[str], empty_rounds: int = 0) -> None:
        """Hand the batch that ran to the stream, then ``empty_rounds`` calls with no states."""
        if self.stream is None or not blocks:
            return
        keys = [(block, which) for block in blocks for which in "kv"]
        self.stream(keys, {key: _heads_first(chunks) for key, chunks in self.pending.items()})
        self.pending.clear()
        for _ in range(empty_rounds):
            self.stream(keys, {})


@contextmanager
def _projection_hooks(blocks: dict[str, nn.Module], sink: _Sink, current: list[Batch], head_dim: int) -> Iterator[None]:
    handles = []
    owner = threading.get_ident()

    def make_hook(name: str, which: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if threading.get_ident() != owner:
                return
            sink.add(name, which, output.reshape(*output.shape[:2], -1, head_dim), current[0])

        return hook

    try:
        for name, block in blocks.items():
            for which, attr in zip("kv", ENCODER_KV, strict=True):
                handles.append(getattr(block, attr).register_forward_hook(make_hook(name, which)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_kv_states(
    model: nn.Module,
    config,
    blocks: dict[str, nn.Module],
    batches: list[Batch],
    stream: Stream | None = None,
    rounds: int = 0,
    done: Done | None = None,
) -> KVStates:
    """Keys and values of ``blocks`` as ``{block: {"k": (1, kv_heads, tokens, head_dim), "v": ...}}``
    (the kept tokens; ``stream`` gets every real token of each batch, ``rounds`` calls in all, and
    ``done`` every block at the end).
    Decoder blocks are read from a DynamicCache after each forward pass, so keys include RoPE
    and grouped-query attention yields ``num_key_value_heads`` heads. Encoder blocks (BERT) have
    no cache; their key/value projection outputs are hooked and split into heads.
    """
    sink = _Sink(stream)
    cached, projected = _split_by_kind(blocks)
    current: list[Batch] = []
    with _projection_hooks(projected, sink, current, head_dim_of(config)), torch.no_grad():
        for batch in batches:
            current[:] = [batch]
            kwargs = kv_forward_kwargs(model, batch, bool(cached))
            model(**kwargs)
            _read_cache(sink, cached, kwargs.get(cache_argument(model)), batch)
            sink.flush(list(blocks))
    for _ in range(rounds - len(batches)):
        sink.flush(list(blocks))
    result = _result(sink, blocks, batches)
    result.report(list(blocks), done)
    return result


def capture_kv_sequential(
    runner: SequentialRunner,
    config,
    blocks: dict[str, nn.Module],
    batches: list[Batch],
    stream: Stream | None = None,
    rounds: int = 0,
    done: Done | None = None,
) -> KVStates:
    """The same states as ``capture_kv_states``, one block in memory at a time. Every block call
    gets a fresh cache, read right after it when the block holds a requested attention module, so
    caches never accumulate the keys of every layer; ``done`` hears of each block after its run."""
    sink = _Sink(stream)
    cached, projected = _split_by_kind(blocks)
    current: list[Batch] = []
    runner.head(lambda model, batch: kv_forward_kwargs(model, batch, bool(cached)), lambda batch: None)
    for index in runner.blocks():
        here = [name for name in blocks if runner.block_of(name) == index]
        cached_here = {name: block for name, block in cached.items() if name in here}
        projected_here = {name: block for name, block in projected.items() if name in here}
        with _projection_hooks(projected_here, sink, current, head_dim_of(config)):
            for batch_index, batch in enumerate(batches):
                current[:] = [batch]
                recorded = runner.recorded_kwargs(index, batch_index)
                name = next((key for key in CACHE_ARGUMENTS if isinstance(recorded.get(key), Cache)), None)
                overrides = {name: _full_cache()} if name else {}
                runner.run(index, batch_index, **overrides)
                _read_cache(sink, cached_here, overrides.get(name), batch)
                sink.flush(here)
        for _ in range(rounds - len(batches)):
            sink.flush(here)
        _result(sink, {name: blocks[name] for name in here}, batches).report(here, done)
    return _result(sink, blocks, batches)


def kv_forward_kwargs(model: nn.Module, batch: Batch, cached: bool) -> dict:
    """Forward arguments of a KV capture: a fresh cache when decoder blocks are read from it."""
    kwargs = forward_kwargs(model, batch)
    if cached:
        kwargs.update({cache_argument(model): _full_cache(), "use_cache": True})
    return kwargs


CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The names of the KV cache argument: ``cache`` from transformers 5.2x on, ``past_key_values`` before."""


def cache_argument(module: nn.Module) -> str:
    """The name under which ``module.forward`` takes its KV cache."""
    parameters = inspect.signature(module.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), CACHE_ARGUMENTS[-1])


def _full_cache() -> DynamicCache:
    """A cache that keeps every token of every layer. Built without the config on purpose: with it,
    sliding-window layers (Mistral, Qwen2) keep only their last window, and the statistics must
    cover all calibration tokens."""
    return DynamicCache()


def _split_by_kind(blocks: dict[str, nn.Module]) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """(blocks read from the KV cache, blocks read from their key/value projections)."""
    cached = {name: block for name, block in blocks.items() if attention_kind(block) == "cache"}
    return cached, {name: block for name, block in blocks.items() if name not in cached}


def _read_cache(sink: _Sink, cached: dict[str, nn.Module], cache: Cache | None, batch: Batch) -> None:
    for name, block in cached.items():
        layer = cache.layers[block.layer_idx]
        sink.add(name, "k", layer.keys.transpose(1, 2), batch)
        sink.add(name, "v", layer.values.transpose(1, 2), batch)


class KVStates(dict):
    """``{block: {"k": (1, kv_heads, tokens, head_dim), "v": ...}}`` of the kept tokens; ``tokens``:
    the real tokens of the calibration batches (every one of them went through every block)."""

    def __init__(self, states: dict[str, dict[str, torch.Tensor]], tokens: int) -> None:
        super().__init__(states)
        self.tokens = tokens

    def report(self, blocks: list[str], done: Done | None) -> None:
        """Tell ``done`` about ``blocks``: their keys, kept states and token counts."""
        if done is None or not blocks:
            return
        keys = [(block, which) for block in blocks for which in "kv"]
        done(keys, {(b, w): self[b][w] for b, w in keys}, dict.fromkeys(keys, self.tokens))


def _result(sink: _Sink, blocks: dict[str, nn.Module], batches: list[Batch]) -> KVStates:
    states = {name: {which: _heads_first(sink.kept[name][which]) for which in "kv"} for name in blocks}
    return KVStates(states, int(sum(int(batch.valid.sum()) for batch in batches)))


def _heads_first(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Chunks of (tokens, heads, head_dim) -> (1, heads, tokens, head_dim)."""
    return torch.cat(chunks).permute(1, 0, 2).unsqueeze(0)
