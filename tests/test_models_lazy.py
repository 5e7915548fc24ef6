"""Lazy loading: opening a multi-GB sharded checkpoint and reading one layer's weight costs about
what a direct safe_open read of that tensor costs, in bytes read, peak RSS and page faults.

Each measurement runs in a fresh subprocess; the peak RSS (VmHWM) is reset after the imports so it
measures the read alone. The checkpoint is bf16 and weights are read as fp32: safetensors and
transformers map fp32 files zero-copy, which would let even a full model instantiation look
cheap, while a conversion touches every byte it loads, so an eager load shows in memory and page
faults; reading whole files (hashing every shard, say) shows in the bytes read through read().
Wall time is reported, not asserted: on a shared 2-core machine it measures the neighbours too.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

SHARD_BYTES = 512 << 20
LAYER = "model.layers.5.mlp.down_proj"
PAGE = 4096

MEASURE = r"""
import json, sys, time
import sample_models, transformers
from transformers import LlamaForCausalLM
from safetensors import safe_open
mode, directory, key, file = sys.argv[1:]

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

def chars_read():
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")

def faults():
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])

open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS so imports do not mask the read
rss_before, faults_before, read_before = status("VmRSS"), faults(), chars_read()
start = time.perf_counter()
if mode == "open":
    weight = sample_models.open_model(directory).weight(key.removesuffix(".weight"))
else:
    with safe_open(file, framework="pt") as handle:
        weight = handle.get_tensor(key).float()
checksum = float(weight.sum())  # touch every page of the result: a lazy view must not pass for a read
elapsed = time.perf_counter() - start
print(json.dumps({
    "seconds": elapsed,
    "peak_rss_growth": status("VmHWM") - rss_before,
    "page_faults": faults() - faults_before,
    "bytes_read": chars_read() - read_before,
    "shape": list(weight.shape),
}))
"""


def _write_checkpoint(directory: Path) -> tuple[int, str]:
    """A ~2.3 GB bf16 Llama checkpoint in 512 MB shards with an index; returns (bytes, shard of LAYER)."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shard.items()}, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(2 * torch.Size(shape).numel() for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, weight_map[f"{LAYER}.weight"]


def _measure(mode: str, directory: Path, shard: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    args = [sys.executable, "-c", MEASURE, mode, str(directory), f"{LAYER}.weight", str(directory / shard)]
    done = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def big_checkpoint(tmp_path):
    directory = tmp_path / "big"
    directory.mkdir()
    yield directory, *_write_checkpoint(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_open_and_one_weight_cost_about_a_direct_read(big_checkpoint):
    directory, total_bytes, shard = big_checkpoint
    assert total_bytes > 2 << 30 and len(list(directory.glob("*.safetensors"))) >= 5
    direct = _measure("direct", directory, shard)
    lazy = _measure("open", directory, shard)
    assert lazy["shape"] == direct["shape"] == [2048, 5632]
    slack = 64 << 20
    assert lazy["peak_rss_growth"] < direct["peak_rss_growth"] + slack
    assert lazy["peak_rss_growth"] < total_bytes // 10
    assert lazy["page_faults"] < direct["page_faults"] + slack // PAGE
    assert lazy["bytes_read"] < direct["bytes_read"] + slack, (lazy, direct)


def test_stored_bytes_come_from_the_header_for_every_dtype(tmp_path):
    """What a checkpoint stores per tensor (the allocation's budget counts it) is read from the
    safetensors header, never from the data, and is each tensor's own bytes in its own dtype."""
    from sample_models import open_model

    tensors = {
        "layer.weight": torch.randn(8, 16),
        "other.weight": torch.randn(4, 16).to(torch.bfloat16),
        "packed.weight": torch.randn(4, 16).to(torch.float8_e4m3fn),
        "count": torch.arange(3, dtype=torch.int64),
        "flags": torch.ones(5, dtype=torch.bool),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    model = open_model(str(tmp_path / "w.safetensors"))
    for key, tensor in tensors.items():
        assert model.stored_bytes(key) == tensor.numel() * tensor.element_size(), key
