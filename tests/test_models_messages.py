"""What the model side tells the user when a source is only partly usable or unreachable: weights-only
sources open (with ``weights_only_reason`` for the UI) instead of being refused or failing at Run, a hub
id that cannot be reached is told apart from a malformed or unknown one, and the tiny-moe description
and the README say what the code does. Small files generated in tmp_path; nothing is downloaded."""

import http.server
import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import save_checkpoint, tiny_llama
from huggingface_hub import constants
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

import observers as ob
from sample_models import ActivationsUnavailableError, HubUnreachableError, ModelSourceError, open_model
from sample_models.builtin import TINY_MOE_DESCRIPTION

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS_ONLY = "activations cannot be captured; weights can be analysed"


def _assert_weights_only(model, reason: str) -> None:
    """Weights-only: the reason is given, layers and weights are readable, captures raise it."""
    assert not model.supports_activations
    assert reason in model.weights_only_reason and WEIGHTS_ONLY in model.weights_only_reason
    assert model.layers() and model.weight(model.layers()[0].name).ndim >= 2
    with pytest.raises(ActivationsUnavailableError, match=re.escape(reason)):
        model.capture([model.layers()[0].name], texts=["A short sentence."])


# ---------------------------------------------------------------- architectures transformers cannot build


def test_unknown_model_type_opens_weights_only(tmp_path):
    weight = torch.randn(8, 4)
    save_file({"blocks.0.proj.weight": weight, "blocks.0.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-model"}))
    model = open_model(tmp_path)
    _assert_weights_only(model, f"{tmp_path / 'config.json'}: transformers")
    assert "'not-a-real-model'" in model.weights_only_reason
    assert [info.name for info in model.layers()] == ["blocks.0.proj"]
    torch.testing.assert_close(model.weight("blocks.0.proj"), weight)
    assert model.config is None and "weights only" in model.description


def test_remote_code_architecture_opens_weights_only_without_running_it(tmp_path):
    directory = save_checkpoint(tiny_llama(layers=1), tmp_path / "remote")
    marker = tmp_path / "ran"
    (directory / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["EvilForCausalLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    model = open_model(directory)
    _assert_weights_only(model, "'EvilForCausalLM'")
    assert "remote code is never run" in model.weights_only_reason
    reference = tiny_llama(layers=1)
    torch.testing.assert_close(model.weight("model.layers.0.mlp.up_proj"), reference.model.layers[0].mlp.up_proj.weight)
    assert not marker.exists()


def test_config_that_is_not_json_is_an_error_naming_it(tmp_path):
    save_file({"a.weight": torch.randn(4, 4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match=re.escape(str(tmp_path / "config.json"))):
        open_model(tmp_path)


# ---------------------------------------------------------------- tokenizers


def test_checkpoint_without_tokenizer_says_so_when_opened(tmp_path):
    directory = save_checkpoint(tiny_llama(layers=1), tmp_path / "no-tokenizer", tokenizer=False)
    model = open_model(directory)
    expected = f"no tokenizer files (tokenizer.json / tokenizer.model) in {directory}: {WEIGHTS_ONLY}"
    assert model.weights_only_reason == expected
    _assert_weights_only(model, expected)
    with pytest.raises(ValueError, match="no tokenizer files"):
        model.capture_kv(["model.layers.0.self_attn"])


def test_weights_only_checkpoint_keeps_the_layer_types_of_its_architecture(tmp_path):
    """GPT-2 stores Conv1D weights (in, out): without a tokenizer they must still come out (out, in)."""
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    model = open_model(save_checkpoint(reference, tmp_path / "gpt2", tokenizer=False))
    assert not model.supports_activations
    info = model.layer("transformer.h.0.attn.c_attn")
    assert info.type == "Conv1D" and info.shape == (96, 32)
    torch.testing.assert_close(model.weight(info.name), reference.transformer.h[0].attn.c_attn.weight.t())


def test_unloadable_tokenizer_says_so_when_opened(tmp_path):
    directory = save_checkpoint(tiny_llama(layers=1), tmp_path / "bad-tokenizer", tokenizer=False)
    (directory / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    _assert_weights_only(open_model(directory), f"no usable tokenizer in {directory}")


def test_bare_weights_file_says_why_it_is_weights_only(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"proj.weight": torch.randn(8, 4)}, path)
    _assert_weights_only(open_model(path), f"{path} is a bare weights file")


def test_a_full_directory_supports_activations(tmp_path):
    model = open_model(save_checkpoint(tiny_llama(layers=1), tmp_path / "llama"))
    assert model.supports_activations and model.weights_only_reason is None


# ---------------------------------------------------------------- hub ids


@pytest.fixture
def online(tmp_path, monkeypatch) -> None:
    """Online mode against an empty hub cache (the endpoint is set by each test: never the real hub)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_hub_id_offline_and_not_cached_says_the_hub_is_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError) as caught:
        open_model("org/absent")
    message = str(caught.value)
    assert message.startswith("could not reach the Hugging Face Hub for 'org/absent' (offline?)")
    assert "download it and open the local directory" in message and "HF_HUB_OFFLINE" in message


def test_hub_id_without_a_connection_says_the_hub_is_unreachable(online, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(HubUnreachableError, match=r"could not reach the Hugging Face Hub for 'org/name' \(offline\?\)"):
        open_model("org/name")


class _RepoNotFound(http.server.BaseHTTPRequestHandler):
    """The hub's answer for a repository that does not exist (or that the caller may not see)."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub_without_repos(online, monkeypatch) -> Iterator[None]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RepoNotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield
    server.shutdown()
    server.server_close()


def test_hub_id_the_hub_does_not_have_is_not_called_unreachable(hub_without_repos):
    with pytest.raises(ModelSourceError, match="the Hugging Face Hub has no model 'org/absent'") as caught:
        open_model("org/absent")
    assert not isinstance(caught.value, HubUnreachableError)


def test_malformed_hub_id_is_told_apart_from_an_unreachable_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="nor a valid hub id") as caught:
        open_model("org/na--me")
    assert not isinstance(caught.value, HubUnreachableError)


# ---------------------------------------------------------------- descriptions and README


def _routed_experts() -> dict[int, set[int]]:
    """Per layer of tiny-moe, the experts that received at least one token in a capture."""
    moe = open_model("tiny-moe")
    names = [info.name for info in moe.layers("model.layers.*.mlp.experts.*.gate_proj")]
    counts = moe.capture(names, samples=8, seq_len=64).token_counts
    routed: dict[int, set[int]] = {}
    for name in names:
        layer, expert = (int(part) for part in re.findall(r"\.(\d+)\.", name))
        routed.setdefault(layer, set())
        if counts[name] > 0:
            routed[layer].add(expert)
    return routed


def test_tiny_moe_description_and_readme_name_the_experts_the_router_really_skips():
    readme = " ".join((ROOT / "README.md").read_text().split())
    for layer, routed in _routed_experts().items():
        skipped = sorted(set(range(4)) - routed)
        first, second = sorted(routed)
        for text in (TINY_MOE_DESCRIPTION, readme):
            assert f"{first} and {second} in layer {layer}" in text
            assert f"experts {skipped[0]} and {skipped[1]} of layer {layer}" in text


def test_readme_counts_the_observers():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{len(ob.available())} observers," in readme
