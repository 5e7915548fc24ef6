"""Attention views: per-head reshapes of projection captures, and key/value state capture for
KV-cache quantization (the tensors a compressed-tensors export scales as ``<attn>.k_scale`` and
``<attn>.v_scale``).

Layout: per-head tensors are ``(1, heads, tokens, head_dim)``: all real tokens of all calibration
sequences laid end to end on the sequence axis. Padding never enters the statistics, and per-tensor
or per-head observers reduce over exactly the values a KV cache would hold.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import Cache, DynamicCache

from .calibration import Batch
from .capture import forward_kwargs
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


@contextmanager
def _projection_hooks(blocks: dict[str, nn.Module], sink: dict, current: list[Batch], head_dim: int) -> Iterator[None]:
    handles = []
    owner = threading.get_ident()

    def make_hook(name: str, which: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if threading.get_ident() != owner:
                return
            batch = current[0]
            states = output[batch.keep]
            sink[name][which].append(states.reshape(states.shape[0], -1, head_dim))

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
    model: nn.Module, config, blocks: dict[str, nn.Module], batches: list[Batch]
) -> dict[str, dict[str, torch.Tensor]]:
    """Keys and values of ``blocks`` as ``{block: {"k": (1, kv_heads, tokens, head_dim), "v": ...}}``.

    Decoder blocks are read from a DynamicCache after each forward pass, so keys include RoPE
    and grouped-query attention yields ``num_key_value_heads`` heads. Encoder blocks (BERT) have
    no cache; their key/value projection outputs are hooked and split into heads.
    """
    sink: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: {"k": [], "v": []})
    cached, projected = _split_by_kind(blocks)
    current: list[Batch] = []
    with _projection_hooks(projected, sink, current, head_dim_of(config)), torch.no_grad():
        for batch in batches:
            current[:] = [batch]
            kwargs = kv_forward_kwargs(model, batch, bool(cached))
            model(**kwargs)
            _read_cache(sink, cached, kwargs.get("past_key_values"), batch)
    return _result(sink, blocks)


def capture_kv_sequential(
    runner: SequentialRunner, config, blocks: dict[str, nn.Module], batches: list[Batch]
) -> dict[str, dict[str, torch.Tensor]]:
    """The same states as ``capture_kv_states``, one block in memory at a time. Every block call
    gets a fresh cache, read right after it when the block holds a requested attention module, so
    caches never accumulate the keys of every layer."""
    sink: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: {"k": [], "v": []})
    cached, projected = _split_by_kind(blocks)
    current: list[Batch] = []
    runner.head(lambda model, batch: kv_forward_kwargs(model, batch, bool(cached)), lambda batch: None)
    for index in runner.blocks():
        cached_here = {name: block for name, block in cached.items() if runner.block_of(name) == index}
        projected_here = {name: block for name, block in projected.items() if runner.block_of(name) == index}
        with _projection_hooks(projected_here, sink, current, head_dim_of(config)):
            for batch_index, batch in enumerate(batches):
                current[:] = [batch]
                has_cache = isinstance(runner.recorded_kwargs(index, batch_index).get("past_key_values"), Cache)
                overrides = {"past_key_values": _full_cache()} if has_cache else {}
                runner.run(index, batch_index, **overrides)
                _read_cache(sink, cached_here, overrides.get("past_key_values"), batch)
    return _result(sink, blocks)


def kv_forward_kwargs(model: nn.Module, batch: Batch, cached: bool) -> dict:
    """Forward arguments of a KV capture: a fresh cache when decoder blocks are read from it."""
    kwargs = forward_kwargs(model, batch)
    if cached:
        kwargs.update(past_key_values=_full_cache(), use_cache=True)
    return kwargs


def _full_cache() -> DynamicCache:
    """A cache that keeps every token of every layer. Built without the config on purpose: with it,
    sliding-window layers (Mistral, Qwen2) keep only their last window, and the statistics must
    cover all calibration tokens."""
    return DynamicCache()


def _split_by_kind(blocks: dict[str, nn.Module]) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """(blocks read from the KV cache, blocks read from their key/value projections)."""
    cached = {name: block for name, block in blocks.items() if attention_kind(block) == "cache"}
    return cached, {name: block for name, block in blocks.items() if name not in cached}


def _read_cache(sink: dict, cached: dict[str, nn.Module], cache: Cache | None, batch: Batch) -> None:
    for name, block in cached.items():
        layer = cache.layers[block.layer_idx]
        sink[name]["k"].append(layer.keys.transpose(1, 2)[batch.keep])
        sink[name]["v"].append(layer.values.transpose(1, 2)[batch.keep])


def _result(sink: dict, blocks: dict[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {which: _heads_first(sink[name][which]) for which in "kv"} for name in blocks}


def _heads_first(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Chunks of (tokens, heads, head_dim) -> (1, heads, tokens, head_dim)."""
    return torch.cat(chunks).permute(1, 0, 2).unsqueeze(0)
