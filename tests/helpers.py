"""Test helpers shared by several test modules: a tiny Llama checkpoint written to disk, and a
Streamlit server's port and health check."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sample_models import Activations
from sample_models.builtin import VOCAB_SIZE, minilm_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def tiny_llama(seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """A random Llama (GQA: 4 heads, 2 KV heads) small enough to write and open in a test."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def save_checkpoint(model, directory: Path, tokenizer: bool = True, **kwargs) -> Path:
    """``model.save_pretrained(directory)`` plus MiniLM's tokenizer files (its vocabulary covers
    ``VOCAB_SIZE``), so the directory opens like a downloaded checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **kwargs)
    for name in TOKENIZER_FILES if tokenizer else ():
        shutil.copy(minilm_dir() / name, directory / name)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until a ``streamlit run`` answers on ``/_stcore/health``; fail if it exits first. Over
    https the certificate is not checked (the tests' servers have self-signed ones)."""
    deadline = time.monotonic() + timeout
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"streamlit exited early with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"streamlit did not answer on {url} within {timeout:.0f} s")


class ThreadRanks:
    """``n`` ranks as threads of one process, for checking split-batch merges without torchrun:
    ``run(work)`` calls ``work(rank, reduce)`` on every rank at once, where ``reduce`` meets the
    other threads at a barrier and returns ``observers.shared.local_reduce`` of their tensors
    (what the collectives compute). A rank that waits longer than ``timeout`` for the others is a
    hang, and fails the test instead of blocking it."""

    def __init__(self, n: int, timeout: float = 60.0) -> None:
        import threading

        self.n = n
        self._barrier = threading.Barrier(n, timeout=timeout)
        self._parts: list = [None] * n

    def _reduce_for(self, rank: int):
        from observers.shared import local_reduce

        def reduce(tensor: torch.Tensor, op) -> torch.Tensor:
            self._parts[rank] = tensor.detach().clone()
            self._barrier.wait()
            result = local_reduce(self._parts, op)
            self._barrier.wait()
            return result

        return reduce

    def run(self, work) -> list:
        """Every rank's return value, or the exception it raised, in rank order."""
        import threading

        results: list = [None] * self.n

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank, self._reduce_for(rank))
            except Exception as err:  # returned to the test, which asserts on it
                results[rank] = err

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


def streamed_capture(
    inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor] | None, stream, batches: int, done=None
) -> Activations:
    """What ``Model.capture`` does, for stand-in models: ``batches`` batches of rows through
    ``stream`` as the capture hooks hand them (layers fed the same tensor get the same rows
    object), ``done`` told of every layer, then the ``Activations`` of every token."""
    names = list(inputs)
    tokens = {len(x) for x in inputs.values()}.pop()
    sides = {"input": inputs} | ({"output": outputs} if outputs is not None else {})
    keys = [(name, side) for name in names for side in sides]
    step = -(-tokens // batches)
    for start in range(0, tokens, step):
        fed, batch = {}, {}
        for name, side in keys:
            source = sides[side][name]
            batch[(name, side)] = fed.setdefault(id(source), source[start : start + step])
        if stream is not None:
            stream(keys, batch)
    captured = Activations(inputs, outputs or {}, {name: tokens for name in names}, tokens, 1.0)
    captured.report(done)
    return captured


# ---------------------------------------------------------------- the app under AppTest


def app_workspace(at):
    """The session's ``Workspace`` of an ``AppTest`` run."""
    from lab import ui

    return at.session_state[ui.WORKSPACE]


def app_ok(at) -> None:
    """No exception box and no error box on the page."""
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def app_page(at, name: str):
    """Switch to ``pages/<name>.py`` and run it."""
    return at.switch_page(f"pages/{name}.py").run()


def app_button(at, label: str):
    """The button labelled ``label``."""
    return next(b for b in at.button if b.label == label)


def app_run_page(app: str, layers: list[str], observers: list[str], source: str = "minilm", timeout: int = 300):
    """The app (``app``: its ``app.py``) on the Run page: ``source`` with ``layers``, 4 samples of
    32 tokens, ``observers`` ticked, no error on the page."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(app, default_timeout=timeout).run()
    app_page(at, "model")
    if source != "minilm":
        at.radio(key="w:source_kind").set_value(source).run()
    at.multiselect(key="w:layers").set_value(list(layers))
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    app_page(at, "run")
    at.multiselect(key="w:observers").set_value(list(observers)).run()
    app_ok(at)
    return at
