"""The opened model: one object the app, the CLI and the checks use for every source.

It composes a weight store (listing and lazy weights) with an optional runtime (the executable
module and its tokenizer, built on first use). The object is meant to be shared read-only: weights
are returned as fresh tensors, captures hold a per-model lock, and capture hooks record only the
thread that installed them, so concurrent callers never see each other's activations.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Callable
from functools import cached_property
from typing import Generic, TypeVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from .calibration import Batch, check_knobs, make_batches, plan_batches, rounds, share_of, token_windows
from .calibration_sets import CalibrationSamples, CalibrationSource, calibration_samples, calibration_stamp
from .capture import (
    Activations,
    BlockTap,
    Done,
    Stream,
    capture_activations,
    capture_sequential,
    eager_attention,
)
from .errors import ActivationsUnavailableError, LayerNotFoundError, SequentialUnsupportedError
from .kv import (
    KVStates,
    attention_blocks,
    attention_kind,
    capture_kv_sequential,
    capture_kv_states,
    head_dim_of,
    split_heads,
)
from .layers import (
    LayerInfo,
    LayerRef,
    converted_rows,
    filter_layers,
    io_widths,
    resolve_layer,
    saved_expert_names,
)
from .sequential import Progress, SequentialModel, SequentialRunner, SequentialStats, default_max_memory
from .stores import WeightStore

T = TypeVar("T")
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_BATCH_SIZE = 8
QUERY_NAMES = ("q_proj", "query")
KV_NAMES = ("k_proj", "v_proj", "key", "value")


class SequentialFallbackWarning(UserWarning):
    """An automatic capture would have gone block by block, but the model cannot (see the message),
    so the whole model was loaded instead."""


class Lazy(Generic[T]):
    """A value built once, on first use, even when several threads ask at the same time."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """True once the value is built (it is never built by asking)."""
        return self._value is not None

    def get(self) -> T:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._factory()
        return self._value


class Runtime:
    """What activations need: the executable module and its tokenizer, both lazy, and how to build
    the module's skeleton (parameters on the meta device), which answers structural questions and
    runs sequential calibration without loading the weights."""

    def __init__(
        self,
        build_module: Callable[[], nn.Module],
        build_tokenizer: Callable[[], PreTrainedTokenizerBase],
        build_skeleton: Callable[[], nn.Module],
    ) -> None:
        self.module = Lazy(build_module)
        self.tokenizer = Lazy(build_tokenizer)
        self.build_skeleton = build_skeleton
        self.structure = Lazy(build_skeleton)


class Model:
    """An opened model source.

    Attributes:
        name: short name shown in the UI (built-in name, directory name, file name, hub id).
        source: where it came from (path or id).
        description: one line for the UI; says "synthetic" for the built-in random decoders.
        config: the transformers config, or None for a bare weights file or a model_type transformers
            does not know.
        device, dtype: where and in which precision weights are returned and captures run.
        supports_activations: False when the source has weights only (a bare weights file, an
            architecture transformers does not know, no usable tokenizer).
        weights_only_reason: None when activations can be captured, else the sentence that says why
            not (naming the file or directory) for the UI to show; captures raise it as
            ActivationsUnavailableError.
        last_sequential: what the last sequential capture held in memory (SequentialStats), or None.
    """

    def __init__(
        self,
        *,
        name: str,
        source: str,
        description: str,
        store: WeightStore,
        runtime: Runtime | None,
        config: PretrainedConfig | None,
        device: torch.device,
        dtype: torch.dtype,
        weights_only_reason: str | None = None,
    ) -> None:
        if (runtime is None) == (weights_only_reason is None):
            raise ValueError("a model has either a runtime or a reason why it has weights only, not both or neither")
        self.name = name
        self.source = source
        self.description = description
        self.config = config
        self.device = device
        self.dtype = dtype
        self.weights_only_reason = weights_only_reason
        self._store = store
        self._runtime = runtime
        self._capture_lock = threading.RLock()
        self._calibration_memo: dict = {}
        self._sequential = Lazy(self._sequential_model)
        self._saved_experts: dict[str, str] | None = None
        self.last_sequential: SequentialStats | None = None

    def __repr__(self) -> str:
        return f"Model({self.name!r}, device={self.device}, dtype={self.dtype})"

    @property
    def supports_activations(self) -> bool:
        return self._runtime is not None

    def layers(self, pattern: str | None = None) -> list[LayerInfo]:
        """Layers in model order, filtered by ``pattern`` (see ``layers.filter_layers``: glob, or
        a regex after ``re:``; None lists all)."""
        return filter_layers(self._store.infos(), pattern)

    def layer(self, name: str) -> LayerInfo:
        """One layer's description; LayerNotFoundError (with close matches) if absent."""
        info = self._index.get(name)
        if info is None:
            raise self._not_found(name)
        return info

    @cached_property
    def _index(self) -> dict[str, LayerInfo]:
        return {info.name: info for info in self._store.infos()}

    def weight(self, name: str) -> torch.Tensor:
        """The layer's weight as (out, in, ...), in the model dtype on the model device. Read
        lazily from disk for checkpoints; a copy for in-memory models, so callers may modify it."""
        self.layer(name)
        return self._store.weight(name)

    def bias(self, name: str) -> torch.Tensor | None:
        """The layer's bias, or None."""
        self.layer(name)
        return self._store.bias(name)

    def stored_keys(self) -> list[str]:
        """Every tensor the weights hold (parameters and persistent buffers), file by file."""
        return self._store.stored_keys()

    def stored(self, key: str) -> torch.Tensor:
        """One stored tensor as stored (its dtype kept, on the CPU), read alone, so a checkpoint is
        rewritten holding only what it is writing."""
        return self._store.stored(key)

    def stored_bytes(self, key: str) -> int:
        """Bytes one stored tensor takes as stored (from its file's header where there is one)."""
        return self._store.stored_bytes(key)

    def module(self) -> nn.Module:
        """The executable model (built or loaded on first call). Treat it as read-only."""
        return self._require_runtime().module.get()

    def saved_expert_names(self) -> dict[str, str]:
        """``{expert projection: its layer name where transformers saves the model}`` for the
        model's fused experts (``layers.saved_expert_names``, read from the skeleton); empty for a
        model without fused experts or without a runtime. Found once (a conversion per fused
        tensor) and remembered: every name ``stored_key`` maps asks for it."""
        if self._saved_experts is None:
            self._saved_experts = {} if self._runtime is None else saved_expert_names(self._structure())
        return dict(self._saved_experts)

    def stored_key(self, key: str) -> str | None:
        """The stored key that holds the tensor the loaded model names ``key``, whole: ``key`` itself,
        the name transformers saves an expert projection's weight by (``saved_expert_names``), or a
        tensor it renames when loading (a hub Mixtral's router, ``block_sparse_moe.gate``:
        ``layers.converted_rows`` with one stored tensor holding every row in order); None when no
        stored tensor holds it whole (a fused tensor put together from several)."""
        keys = set(self.stored_keys())
        if key in keys:
            return key
        layer, _, leaf = key.rpartition(".")
        saved = self.saved_expert_names().get(layer)
        if saved is not None and f"{saved}.{leaf}" in keys:
            return f"{saved}.{leaf}"
        if self._runtime is None:
            return None
        root = self._structure()
        try:
            shape = root.get_parameter(key).shape
        except AttributeError:
            return None
        parts = converted_rows(root, key, shape, keys, getattr(root, "base_model_prefix", ""))
        if parts is None or len(parts) != 1 or not torch.equal(parts[0][1], torch.arange(len(parts[0][1]))):
            return None
        return parts[0][0]

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer that turns calibration text into tokens (loaded on first call)."""
        return self._require_runtime().tokenizer.get()

    def capture(
        self,
        names: list[str] | str,
        texts: list[str] | str | None = None,
        samples: int = 32,
        seq_len: int = 128,
        outputs: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        sequential: bool | None = None,
        max_memory: int | None = None,
        progress: Progress | None = None,
        share: tuple[int, int] = (0, 1),
        stream: Stream | None = None,
        done: Done | None = None,
        tap: BlockTap | None = None,
    ) -> Activations:
        """Inputs (and outputs when ``outputs``) of the named layers over calibration text,
        as ``{name: (tokens, features)}`` without padding tokens.

        ``texts=None`` uses the built-in paragraphs; long texts are split into ``seq_len``
        windows and the first ``samples`` windows are used. When the result would exceed
        ``max_bytes`` a random subset of tokens is kept and a CaptureSubsampledWarning is issued
        (``result.kept_fraction`` records it). ``result.token_counts`` gives the real tokens each
        layer saw: 0 for an expert the router never chose.

        ``sequential=True`` loads one block of weights at a time (see ``sequential.py``);
        ``None`` does so when the weights exceed ``max_memory`` bytes (default: half the free
        memory of the device) and the whole model is not loaded already. The result is the same
        either way. ``progress(done, total, block)`` is called after each block of a sequential run.

        ``share=(part, parts)``: capture only part ``part`` of the whole calibration batches, dealt
        out in turn (ranks that split the calibration; ``calibration.share_of``); the parts'
        tokens together are exactly those of the whole capture, subsampling included.

        ``stream``: also hand every real token of each batch to ``stream`` once the batch has run
        (``capture.Stream``), so observers see all tokens while only the kept ones are returned;
        ``done`` hears of each block's layers once they have had every batch (``capture.Done``).

        ``tap``: a stage that rides the pass block by block (``capture.BlockTap``; ``names`` may
        then be empty); the capture is then sequential, as the tap's blocks come one at a time.
        """
        names = [names] if isinstance(names, str) else list(names)
        if not names and tap is None:
            raise ValueError("choose at least one layer to capture")
        if tap is not None:
            if sequential is False:
                raise ValueError("a stage that rides the capture block by block needs the layer-by-layer capture")
            sequential = True
        with self._capture_lock:
            budget = self._sequential_budget(sequential, max_memory)
            module = self.module() if budget is None else self._sequential.get().module
            refs = {name: self._layer_ref(module, name) for name in names}
            widths = [io_widths(ref.info(name)) for name, ref in refs.items()]
            per_token = _element_size(self.dtype) * sum(w_in + (w_out if outputs else 0) for w_in, w_out in widths)
            batches, fraction, calls = self._batches(texts, samples, seq_len, batch_size, per_token, max_bytes, share)
            with eager_attention(module):
                if budget is None:
                    return capture_activations(module, refs, batches, outputs, fraction, stream, calls, done)
                with self._runner(batches, budget, progress) as runner:
                    return capture_sequential(runner, refs, batches, outputs, fraction, stream, calls, done, tap)

    def calibration_set(
        self, texts: list[str] | str | CalibrationSource | None = None, samples: int = 32, seq_len: int = 128
    ) -> CalibrationSamples:
        """The tokenized calibration set: the built-in paragraphs (``texts=None``), pasted texts, or
        the records of a ``CalibrationSource`` (``calibration_sets``). Kept for the last settings
        asked, so a capture and the lab's record of it tokenize once."""
        tokenizer = self.tokenizer()
        key = (calibration_stamp(texts), samples, seq_len)
        if self._calibration_memo.get("key") != key:
            if isinstance(texts, CalibrationSource):
                found = calibration_samples(tokenizer, texts, samples, seq_len)
            else:
                windows = token_windows(tokenizer, texts, samples, seq_len)
                source = {"kind": "builtin" if texts is None else "pasted"}
                found = CalibrationSamples.of(windows, asked=samples, records=len(windows), source=source)
            self._calibration_memo = {"key": key, "value": found}
        return self._calibration_memo["value"]

    def calibration_batches(
        self,
        texts: list[str] | str | CalibrationSource | None = None,
        samples: int = 32,
        seq_len: int = 128,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> int:
        """How many forward batches a capture with these calibration settings runs: ranks that split
        the batches need at least one each. Tokenizes the texts; runs nothing."""
        check_knobs(samples, seq_len, batch_size, getattr(self.config, "max_position_embeddings", None))
        return -(-len(self.calibration_set(texts, samples, seq_len).windows) // batch_size)

    def attention_blocks(self) -> list[str]:
        """Names of attention blocks ``capture_kv`` accepts (e.g. ``model.layers.0.self_attn``).
        Read from the skeleton, so listing them never loads the weights."""
        return attention_blocks(self._structure())

    def capture_kv(
        self,
        blocks: list[str] | str,
        texts: list[str] | str | None = None,
        samples: int = 32,
        seq_len: int = 128,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        sequential: bool | None = None,
        max_memory: int | None = None,
        progress: Progress | None = None,
        share: tuple[int, int] = (0, 1),
        stream: Stream | None = None,
        done: Done | None = None,
    ) -> KVStates:
        """Key and value states of attention blocks, per head:
        ``{block: {"k": (1, kv_heads, tokens, head_dim), "v": ...}}``. Keys are taken as the KV
        cache holds them (after RoPE), with ``num_key_value_heads`` heads under grouped-query
        attention. Same calibration and memory knobs as ``capture``."""
        blocks = [blocks] if isinstance(blocks, str) else list(blocks)
        if not blocks:
            raise ValueError("choose at least one attention block")
        with self._capture_lock:
            budget = self._sequential_budget(sequential, max_memory)
            module = self.module() if budget is None else self._sequential.get().module
            found = {name: self._attention_block(module, name) for name in blocks}
            per_token = 2 * _element_size(self.dtype) * sum(_kv_width(block) for block in found.values())
            batches, _, calls = self._batches(texts, samples, seq_len, batch_size, per_token, max_bytes, share)
            with eager_attention(module):
                if budget is None:
                    return capture_kv_states(module, self.config, found, batches, stream, calls, done)
                with self._runner(batches, budget, progress) as runner:
                    return capture_kv_sequential(runner, self.config, found, batches, stream, calls, done)

    def kv_shape(self, block: str) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of an attention block's keys and values (``kv_heads`` <
        query heads under grouped-query attention): the shape per-head KV scales must fit."""
        found = self._attention_block(self._structure(), block)
        head_dim = head_dim_of(self.config)
        return _kv_width(found) // head_dim, head_dim

    def head_view(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A captured q/k/v projection output (tokens, heads * head_dim) as
        (1, heads, tokens, head_dim), using the config's head size."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in QUERY_NAMES + KV_NAMES or self.config is None:
            raise ValueError(f"{name!r} is not a query/key/value projection with a known head size")
        return split_heads(x, head_dim_of(self.config))

    def _batches(self, texts, samples, seq_len, batch_size, per_token, max_bytes, share=(0, 1)):
        check_knobs(samples, seq_len, batch_size, getattr(self.config, "max_position_embeddings", None))
        windows = self.calibration_set(texts, samples, seq_len).windows
        padded = make_batches(self.tokenizer(), windows, batch_size, self.device)
        batches, fraction = plan_batches(padded, per_token, max_bytes)
        return share_of(batches, *share), fraction, rounds(len(batches), share[1])

    def _structure(self) -> nn.Module:
        """The model's skeleton: module names and shapes without weights. Never run or loaded."""
        return self._require_runtime().structure.get()

    def _sequential_model(self) -> SequentialModel:
        runtime = self._require_runtime()
        return SequentialModel(runtime.build_skeleton(), self._store, self.source, self.config.num_hidden_layers)

    def _sequential_budget(self, sequential: bool | None, max_memory: int | None) -> int | None:
        """The weights budget of a sequential capture, or None for a whole-model one. Automatic
        (``sequential=None``) goes sequential only when the weights exceed the budget and the whole
        model is not loaded already; a model it cannot run block by block is then captured whole,
        with a SequentialFallbackWarning that says why."""
        runtime = self._require_runtime()
        if max_memory is not None and (not isinstance(max_memory, int) or max_memory < 1):
            raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
        if sequential is False:
            return None
        budget = default_max_memory(self.device) if max_memory is None else max_memory
        if sequential is None:
            if runtime.module.ready or self._store.total_bytes() <= budget:
                return None
            try:
                self._sequential.get()
            except SequentialUnsupportedError as err:
                warnings.warn(f"{err}; capturing with the whole model", SequentialFallbackWarning, stacklevel=3)
                return None
        return budget

    def _runner(self, batches: list[Batch], budget: int, progress: Progress | None) -> SequentialRunner:
        hidden_bytes = sum(b.input_ids.numel() for b in batches) * self.config.hidden_size * _element_size(self.dtype)
        runner = SequentialRunner(
            self._sequential.get(),
            self._store,
            batches,
            device=self.device,
            max_memory=budget,
            hidden_bytes=hidden_bytes,
            progress=progress,
        )
        self.last_sequential = runner.stats
        return runner

    def _require_runtime(self) -> Runtime:
        if self._runtime is None:
            raise ActivationsUnavailableError(self.weights_only_reason)
        return self._runtime

    def _layer_ref(self, module: nn.Module, name: str) -> LayerRef:
        ref = resolve_layer(module, name)
        if ref is not None:
            return ref
        if name in self._index:
            raise LayerNotFoundError(
                f"layer {name!r} is stored in {self.source} but is not a module of the loaded "
                f"{type(module).__name__} (transformers renames or fuses it when loading), so its "
                "activations cannot be captured; capture the loaded model's names instead"
            )
        raise self._not_found(name)

    def _attention_block(self, module: nn.Module, name: str) -> nn.Module:
        try:
            block = module.get_submodule(name)
        except AttributeError:
            block = None
        if block is None or attention_kind(block) is None:
            close = difflib.get_close_matches(name, attention_blocks(module), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise LayerNotFoundError(f"no attention block named {name!r} in {self.source}{hint}")
        return block

    def _not_found(self, name: str) -> LayerNotFoundError:
        close = difflib.get_close_matches(name, list(self._index), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return LayerNotFoundError(f"no layer named {name!r} in {self.source}{hint}")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _kv_width(block: nn.Module) -> int:
    projection = getattr(block, "k_proj", None) or block.key
    return projection.out_features
