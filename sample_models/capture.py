"""Hook-based activation capture.

Forward hooks record the inputs (and optionally outputs) of chosen layers while calibration
batches run, keep only real tokens (padding is dropped with the attention mask) and flatten to
(tokens, features). Fused MoE experts have no module per expert, so one pre-hook on the experts
module replays the routing for the requested experts; an expert that received no tokens yields
a (0, features) tensor and a token count of 0. Hooks are removed in ``finally`` blocks, so an
exception never leaves a hook behind on the shared model, and they record only calls made from
the capturing thread, so another thread running the same model is never recorded.

With a ``stream`` the hooks also hand every real token of each batch on, once the batch has run
(``Stream``): the lab's observers see all tokens, batch by batch, while only the planned sample of
tokens (``Batch.keep``) is kept. Memory is then one batch of activations plus the sample, whatever
the number of calibration tokens.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PretrainedConfig

from .calibration import Batch
from .layers import LayerRef
from .sequential import SequentialRunner, StopPass

Key = tuple[str, str]
"""``(layer, "input"|"output")`` for layer activations, ``(attention block, "k"|"v")`` for KV states."""

Stream = Callable[[list[Key], dict[Key, torch.Tensor]], None]
"""Called once per calibration batch (per block and batch in a sequential run) with the keys whose
hooks ran in that pass, in a fixed order, and the batch's rows of every real token for each key
(absent when the layer saw no token: an unrouted expert). Layer activations are ``(tokens,
features)``, KV states ``(1, heads, tokens, head_dim)``. Keys fed the very same tensor (the query,
key and value projections read one hidden state) get the same tensor object. Ranks that split the
batches all make the same number of calls: a rank out of batches is called with no rows."""


Done = Callable[[list[Key], dict[Key, torch.Tensor], dict[Key, int]], "Propagation | None"]
"""Called once the stream has had every batch of some keys (one block's layers in a sequential
capture, every layer at the end of a whole-model one): the keys, their kept tokens and the real
tokens each saw. A sweep writes those layers' results then, and forgets them. In a sequential
capture it may return a ``Propagation`` for the block that just finished."""

Propagation = Callable[[nn.Module], AbstractContextManager]
"""Given the model, a context in which the block's chosen tensors are fake-quantized: the capture
runs the block's batches again inside it and hands the next block those outputs."""


class BlockTap(Protocol):
    """A stage that rides a sequential capture block by block, as llm-compressor's modifiers ride
    its sequential pipeline (AWQ): its hooks are on each block while the block runs its batches,
    it hears of each batch before the batch runs, and once the block has had every batch (its
    weights still loaded) it may change what the next block receives. ``key`` says what it changes
    there, so results a pass made with it are never taken for a plain pass's ('' when nothing)."""

    key: str

    def hooks(self, index: int, block: nn.Module) -> AbstractContextManager: ...

    def start(self, batch: Batch) -> None: ...

    def finished(self, index: int, block: nn.Module) -> Propagation | None: ...


class Activations(dict):
    """Captured layer inputs, ``{name: (tokens, features)}``, plus what is needed to judge them.
    Treat the tensors as read-only: layers fed the same tensor (an expert's gate and up
    projections) may share it.

    Attributes:
        outputs: ``{name: (tokens, out_features)}`` when outputs were asked for, else empty.
        token_counts: real tokens each layer saw, before any subsampling; 0 flags a layer (an
            unrouted expert) whose statistics are meaningless.
        tokens: real tokens in the calibration batches.
        kept_fraction: share of tokens kept; below 1 when ``max_bytes`` forced subsampling.
    """

    def __init__(
        self,
        inputs: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        token_counts: dict[str, int],
        tokens: int,
        kept_fraction: float,
    ) -> None:
        super().__init__(inputs)
        self.outputs = outputs
        self.token_counts = token_counts
        self.tokens = tokens
        self.kept_fraction = kept_fraction

    @property
    def subsampled(self) -> bool:
        return self.kept_fraction < 1.0

    def report(self, done: Done | None) -> None:
        """Tell ``done`` about every layer at once (a memoized capture replayed)."""
        if done is None:
            return
        sides = {"input": self} | ({"output": self.outputs} if self.outputs else {})
        keys = [(name, side) for name in self for side in sides]
        done(keys, {(n, side): sides[side][n] for n, side in keys}, {(n, s): self.token_counts[n] for n, s in keys})


class _Rows:
    """The captured rows of one layer input or output.

    Token-major tensors are gathered straight into one buffer sized for every kept token, so each
    captured byte is written once (fresh memory is the main cost of a capture; concatenating
    chunks would write it twice). Rows that do not fit that pattern (expert inputs, a module called
    more than once per forward pass) are kept as chunks and concatenated at the end, after the
    buffer's rows, so the order is always the order of the calls.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None
        self.filled = 0
        self.chunks: list[torch.Tensor] = []

    def gather(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        if self.chunks or self.filled + len(index) > self.capacity:
            self.chunks.append(rows.index_select(0, index))
            return
        if self.buffer is None:
            self.buffer = rows.new_empty((self.capacity, rows.shape[1]))
        torch.index_select(rows, 0, index, out=self.buffer[self.filled : self.filled + len(index)])
        self.filled += len(index)

    def append(self, rows: torch.Tensor) -> None:
        """Keep rows the caller owns (a fresh tensor, never a view into the model's tensors)."""
        self.chunks.append(rows)

    def result(self) -> torch.Tensor | None:
        parts = ([] if self.buffer is None else [self.buffer[: self.filled]]) + self.chunks
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Recorder:
    """Collects the hooked layers' rows for the batch that is running."""

    def __init__(self, want_outputs: bool, capacity: int, stream: Stream | None = None) -> None:
        self.want_outputs = want_outputs
        self.rows: dict[tuple[str, str], _Rows] = defaultdict(lambda: _Rows(capacity))
        self.counts: dict[str, int] = defaultdict(int)
        self.batch: Batch | None = None
        self.kept_index: torch.Tensor | None = None
        self.valid_index: torch.Tensor | None = None
        self.valid_count = 0
        self.thread = threading.get_ident()
        self.stream = stream
        self.keys: list[Key] = []
        self.pending: dict[Key, list[torch.Tensor]] = {}
        self._fed: dict[int, tuple[torch.Tensor, Key]] = {}
        self.reported: set[str] = set()

    def group(self, names: list[str]) -> None:
        """The layers whose hooks run in the next passes (their keys, in a fixed order, for ``Stream``)."""
        self.flush()
        sides = ("input", "output") if self.want_outputs else ("input",)
        self.keys = [(name, side) for name in names for side in sides]

    def start(self, batch: Batch) -> None:
        self.flush()
        self.batch = batch
        self.kept_index = batch.keep.reshape(-1).nonzero().squeeze(1)
        self.valid_index = batch.valid.reshape(-1).nonzero().squeeze(1)
        self.valid_count = int(batch.valid.sum())

    def flush(self) -> None:
        """Hand the batch that ran to the stream (nothing without one, or before the first batch)."""
        if self.stream is None or self.batch is None or not self.keys:
            self.pending, self._fed, self.batch = {}, {}, None
            return
        rows = {key: chunks[0] if len(chunks) == 1 else torch.cat(chunks) for key, chunks in self.pending.items()}
        self.pending, self._fed, self.batch = {}, {}, None
        self.stream(self.keys, rows)

    def pad(self, rounds: int) -> None:
        """``rounds`` calls with no rows: this rank has fewer batches than the rank with the most."""
        self.flush()
        for _ in range(rounds if self.stream is not None and self.keys else 0):
            self.stream(self.keys, {})

    def report(
        self, names: list[str], done: Done | None, refs: dict[str, LayerRef], device: torch.device
    ) -> Propagation | None:
        """Tell ``done`` that ``names`` have had every batch (each name once); its answer."""
        names = [name for name in names if name not in self.reported]
        self.reported.update(names)
        if done is None or not names:
            return None
        sides = ("input", "output") if self.want_outputs else ("input",)
        keys = [(name, side) for name in names for side in sides]
        kept = {(n, side): _or_empty(self.result(n, side), refs[n], side, device) for n, side in keys}
        return done(keys, kept, {(n, side): self.counts.get(n, 0) for n, side in keys})

    def _feed(self, key: Key, source: torch.Tensor, rows: Callable[[], torch.Tensor]) -> None:
        """Queue ``rows()`` for the stream; a key fed the very tensor an earlier key was fed in this
        batch gets that key's rows (one copy, and the observers can tell them apart by identity).
        ``_fed`` holds the source tensors until the flush, so no id is reused within a batch."""
        if self.stream is None:
            return
        earlier = self._fed.get(id(source))
        if earlier is not None and earlier[0] is source and len(self.pending.get(earlier[1], ())) == 1:
            self.pending.setdefault(key, []).append(self.pending[earlier[1]][0])
            return
        self._fed.setdefault(id(source), (source, key))
        self.pending.setdefault(key, []).append(rows())

    def active(self) -> bool:
        """Only the thread that installed the hooks is recorded."""
        return threading.get_ident() == self.thread

    def token_major(self, x: torch.Tensor) -> bool:
        """True for (batch, seq, ...) tensors and (batch*seq, ...) tensors (inside MoE blocks)."""
        valid = self.batch.valid
        return x.shape[: valid.ndim] == valid.shape or x.shape[0] == valid.numel()

    def flat_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid, keep) masks over the batch's flattened tokens."""
        return self.batch.valid.reshape(-1), self.batch.keep.reshape(-1)

    def record(self, name: str, x: torch.Tensor, y: torch.Tensor | None) -> None:
        """Record a module call: real, kept tokens only when positions are known, else every row."""
        sides = [("input", x), ("output", y)] if self.want_outputs else [("input", x)]
        if self.token_major(x):
            self.counts[name] += self.valid_count
            for side, tensor in sides:
                flat = tensor.reshape(self.batch.valid.numel(), -1)
                self.rows[(name, side)].gather(flat, self.kept_index)
                self._feed((name, side), tensor, lambda flat=flat: flat.index_select(0, self.valid_index))
            return
        self.counts[name] += x.shape[0]
        for side, tensor in sides:
            rows = tensor.reshape(-1, tensor.shape[-1]).clone()
            self.rows[(name, side)].append(rows)
            self._feed((name, side), tensor, lambda rows=rows: rows)

    def record_rows(
        self, name: str, count: int, x: torch.Tensor, y: torch.Tensor, x_all: torch.Tensor, y_all: torch.Tensor
    ) -> None:
        """Record rows already selected by the caller (one expert's tokens): ``x``/``y`` the kept
        ones, ``x_all``/``y_all`` every real one (for the stream)."""
        self.counts[name] += count
        self.rows[(name, "input")].append(x)
        self._feed((name, "input"), x_all, lambda: x_all)
        if self.want_outputs:
            self.rows[(name, "output")].append(y)
            self._feed((name, "output"), y_all, lambda: y_all)

    def result(self, name: str, side: str) -> torch.Tensor | None:
        rows = self.rows.get((name, side))
        return None if rows is None else rows.result()


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def _module_hook(recorder: _Recorder, name: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not recorder.active():
            return
        y = output[0] if isinstance(output, tuple) else output
        recorder.record(name, _first_tensor(args, kwargs), y)

    return hook


def _experts_hook(recorder: _Recorder, wanted: dict[int, dict[str, str]]):
    """One pre-hook per fused experts module; ``wanted`` maps expert -> {projection: layer name}."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder.active():
            return
        names = ("hidden_states", "top_k_index")
        hidden, top_k_index = (args[i] if len(args) > i else kwargs[key] for i, key in enumerate(names))
        if recorder.token_major(hidden):
            valid, keep = recorder.flat_masks()
        else:
            valid = keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for expert, projections in wanted.items():
            routed = (top_k_index == expert).any(dim=-1)
            count = int((routed & valid).sum())
            if recorder.stream is None:
                per_projection = every = _expert_io(module, expert, hidden[routed & keep])
            else:  # one expert pass over every real token; the kept ones are among them
                every = _expert_io(module, expert, hidden[routed & valid])
                kept = keep[routed & valid]
                per_projection = {p: (x[kept], y[kept]) for p, (x, y) in every.items()}
            for projection, name in projections.items():
                x, y = per_projection[projection]
                recorder.record_rows(name, count, x, y, *every[projection])

    return hook


def _expert_io(module: nn.Module, expert: int, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and outputs of one expert's three projections for the tokens routed to it."""
    refs = {p: LayerRef(module, expert, p) for p in ("gate_proj", "up_proj", "down_proj")}
    gate = F.linear(x, refs["gate_proj"].weight(), refs["gate_proj"].bias())
    up = F.linear(x, refs["up_proj"].weight(), refs["up_proj"].bias())
    apply_gate = getattr(module, "_apply_gate", None)
    hidden = apply_gate(torch.cat([gate, up], dim=-1)) if apply_gate else module.act_fn(gate) * up
    down = F.linear(hidden, refs["down_proj"].weight(), refs["down_proj"].bias())
    return {"gate_proj": (x, gate), "up_proj": (x, up), "down_proj": (hidden, down)}


@contextmanager
def hooks_installed(recorder: _Recorder, refs: dict[str, LayerRef]) -> Iterator[None]:
    """Install capture hooks for ``refs`` and remove them on exit, whatever happens."""
    handles: list[RemovableHandle] = []
    experts: dict[nn.Module, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    try:
        for name, ref in refs.items():
            if ref.expert is None:
                handles.append(ref.module.register_forward_hook(_module_hook(recorder, name), with_kwargs=True))
            else:
                experts[ref.module][ref.expert][ref.projection] = name
        for module, wanted in experts.items():
            handles.append(module.register_forward_pre_hook(_experts_hook(recorder, dict(wanted)), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _inputs_then_stop(recorder: _Recorder, refs: dict[str, LayerRef]) -> Iterator[None]:
    """Pre-hooks that record each layer's input and stop the pass once every one of them has it,
    before the layer runs: the pass after the blocks, asked for a head's input, neither loads the
    head nor computes its logits."""
    seen: set[str] = set()

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not recorder.active():
                return
            recorder.record(name, _first_tensor(args, kwargs), None)
            seen.add(name)
            if len(seen) == len(refs):
                seen.clear()
                raise StopPass

        return hook

    handles = [
        ref.module.register_forward_pre_hook(hook_for(name), with_kwargs=True, prepend=True)
        for name, ref in refs.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def eager_attention(module: nn.Module) -> Iterator[None]:
    """``module``'s attention computed eagerly (``softmax(q·kᵀ + mask)·v`` as plain products) while
    the ``with`` runs, as llm-compressor's calibration forwards compute it
    (``calibration_forward_context``): a calibration pass then sees the activations its modifiers
    see, to the bit. sdpa's fused kernel gives the same attention a few float32 ulps apart, and
    AWQ's grid search on int4 turns such ulps into another grid point on a flat loss curve.
    Every configuration the modules read, and its sub-configurations, is switched and put back on
    exit, whatever happens. Callers hold the model's capture lock, under which every pass the lab
    makes over the model runs (a forward of the module made outside the lab meanwhile would
    compute its attention eagerly too). A module without a transformers configuration is left as
    it is."""
    found = [c for m in module.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)]
    configs: dict[int, PretrainedConfig] = {}
    while found:
        config = found.pop()
        if id(config) not in configs:
            configs[id(config)] = config
            found += [c for key in config.sub_configs if isinstance(c := getattr(config, key, None), PretrainedConfig)]
    before = {key: config._attn_implementation_internal for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation_internal = "eager"
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation_internal = before[key]


def forward_kwargs(model: nn.Module, batch: Batch) -> dict:
    """Arguments for one calibration forward pass; the KV cache is off unless asked for."""
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


def capture_activations(
    model: nn.Module,
    refs: dict[str, LayerRef],
    batches: list[Batch],
    outputs: bool,
    kept_fraction: float,
    stream: Stream | None = None,
    rounds: int = 0,
    done: Done | None = None,
) -> Activations:
    """Run ``batches`` through ``model`` and return the hooked layers' activations (the kept
    tokens); ``stream`` gets every real token of each batch, ``rounds`` calls in all, and ``done``
    every layer at the end."""
    recorder = _Recorder(outputs, _kept(batches), stream)
    recorder.group(list(refs))
    with hooks_installed(recorder, refs), torch.no_grad():
        for batch in batches:
            recorder.start(batch)
            model(**forward_kwargs(model, batch))
        recorder.pad(rounds - len(batches))
    device = _device_of(model)
    recorder.report(list(refs), done, refs, device)
    return _activations(recorder, refs, batches, kept_fraction, device)


def capture_sequential(
    runner: SequentialRunner,
    refs: dict[str, LayerRef],
    batches: list[Batch],
    outputs: bool,
    kept_fraction: float,
    stream: Stream | None = None,
    rounds: int = 0,
    done: Done | None = None,
    tap: BlockTap | None = None,
) -> Activations:
    """The same activations as ``capture_activations``, one block in memory at a time: the hooks of
    the layers inside a block are installed while that block runs its batches, those of the layers
    before the blocks (embeddings) during the recording pass, and those after the blocks (head,
    pooler) during a last pass that runs only when one of them is asked for. ``stream`` gets
    each block's batches in turn, and ``done`` each block's layers once they have had them all:
    one pass over the model, whatever the number of layers. When ``done`` answers with a
    ``Propagation``, the block runs its batches again with its chosen tensors fake-quantized
    and the next block calibrates on those outputs (unless no later block and no layer after the
    blocks is asked for: then nothing reads them, and the block does not run again). A ``tap``
    rides the same pass (its hooks on each block, told when the block is done; it says itself
    when it has nothing more to change); both it and ``done`` changing what the next block
    receives is a ``ValueError``."""
    recorder = _Recorder(outputs, _kept(batches), stream)
    device = runner.device
    outer = {name: ref for name, ref in refs.items() if runner.block_of(name) is None}
    recorder.group(list(outer))
    with hooks_installed(recorder, outer):
        runner.head(forward_kwargs, recorder.start)
        recorder.pad(rounds - len(batches))
    recorder.report([name for name in outer if name in recorder.counts], done, refs, device)
    after = {name: ref for name, ref in outer.items() if name not in recorder.counts}
    last = max((runner.block_of(name) for name in refs if runner.block_of(name) is not None), default=-1)
    for index in runner.blocks():
        inside = {name: ref for name, ref in refs.items() if runner.block_of(name) == index}
        recorder.group(list(inside))
        block = runner.block(index)
        with hooks_installed(recorder, inside), tap.hooks(index, block) if tap is not None else nullcontext():
            for batch_index, batch in enumerate(batches):
                recorder.start(batch)
                if tap is not None:
                    tap.start(batch)
                runner.run(index, batch_index)
            recorder.pad(rounds - len(batches))
        propagation = recorder.report(list(inside), done, refs, device)
        tapped = None if tap is None else tap.finished(index, block)
        if propagation is not None and tapped is not None:
            raise ValueError("two stages change what the next block receives: propagation and a block tap")
        if tapped is not None:
            runner.propagate(index, tapped)
        elif propagation is not None and (index < last or after):
            runner.propagate(index, propagation)  # what a later block asked for, or the head, reads
    if after:
        recorder.group(list(after))
        inputs_only = not outputs and all(ref.expert is None for ref in after.values())
        with _inputs_then_stop(recorder, after) if inputs_only else hooks_installed(recorder, after):
            runner.tail(forward_kwargs, recorder.start)
            recorder.pad(rounds - len(batches))
    recorder.report(list(refs), done, refs, device)
    return _activations(recorder, refs, batches, kept_fraction, device)


def _kept(batches: list[Batch]) -> int:
    return int(sum(int(batch.keep.sum()) for batch in batches))


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _activations(
    recorder: _Recorder, refs: dict[str, LayerRef], batches: list[Batch], kept_fraction: float, device: torch.device
) -> Activations:
    tokens = int(sum(int(batch.valid.sum()) for batch in batches))
    inputs = {name: _or_empty(recorder.result(name, "input"), ref, "input", device) for name, ref in refs.items()}
    outs = {name: _or_empty(recorder.result(name, "output"), ref, "output", device) for name, ref in refs.items()}
    counts = {name: recorder.counts.get(name, 0) for name in refs}
    return Activations(inputs, outs if recorder.want_outputs else {}, counts, tokens, kept_fraction)


def _or_empty(rows: torch.Tensor | None, ref: LayerRef, side: str, device: torch.device) -> torch.Tensor:
    """A layer that never ran gives an empty (0, features) tensor. Built from the weight's shape only,
    because in a sequential run the weight is back on the meta device by now."""
    if rows is not None:
        return rows
    weight = ref.weight()
    features = weight.shape[1] if side == "input" else weight.shape[0]
    return torch.empty((0, features), dtype=weight.dtype, device=device)
