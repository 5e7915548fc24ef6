"""Random Llama-shaped checkpoints written to disk shard by shard, so that tests and benchmarks can try
models larger than the memory they are given without a model hub (and without ever holding the whole
model in memory while writing one): plain random decoders with a word-level tokenizer
(``write_llama_checkpoint``), and tiny-llama's planted decoder at any width with the MiniLM tokenizer
(``write_planted_llama``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .builtin import minilm_dir, planted_parameters, planted_shapes
from .calibration import builtin_texts

WEIGHT_STD = 0.02
SHARD_BYTES = 512 * 2**20


def write_llama_checkpoint(directory: Path, config: LlamaConfig, layers_per_shard: int = 4, seed: int = 0) -> int:
    """Write config, a word-level tokenizer and random safetensors shards (embedding, then
    ``layers_per_shard`` blocks per shard, then the head) with their index; returns the bytes of
    weights written. Names and shapes come from the model built on the meta device."""
    directory.mkdir(parents=True, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    write_word_tokenizer(directory, config.vocab_size)
    with init_empty_weights():
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    groups = [[n for n in shapes if ".layers." not in n and n != "lm_head.weight"]]
    for start in range(0, config.num_hidden_layers, layers_per_shard):
        prefixes = tuple(f"model.layers.{i}." for i in range(start, start + layers_per_shard))
        groups.append([n for n in shapes if n.startswith(prefixes)])
    groups.append([n for n in shapes if n == "lm_head.weight"])
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for number, names in enumerate(groups, 1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random(shapes[name], generator) for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def write_planted_llama(directory: Path, config: LlamaConfig, shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``sample_models.builtin.build_planted_llama(config)`` as a Hugging Face directory
    (config, the MiniLM tokenizer whose vocabulary it has, safetensors shards with their index)
    without building the model: the parameters are put in shards of at most ``shard_bytes`` (or one
    parameter) in the order they are made (``planted_parameters``), and each shard is written as its
    last parameter is made, so one shard is in memory at a time (hidden 4096 with 1 block is 1.8 GB
    in float32). Returns the bytes of weights written."""
    directory.mkdir(parents=True, exist_ok=True)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True).save_pretrained(directory)
    shards: list[list[str]] = [[]]
    held_bytes = 0
    sizes = {name: shape.numel() * 4 for name, shape in planted_shapes(LlamaForCausalLM, config).items()}
    for name, size in sizes.items():
        if shards[-1] and held_bytes + size > shard_bytes:
            shards.append([])
            held_bytes = 0
        shards[-1].append(name)
        held_bytes += size
    files = [f"model-{number:05d}-of-{len(shards):05d}.safetensors" for number in range(1, len(shards) + 1)]
    closing = {names[-1]: file for names, file in zip(shards, files, strict=True)}
    held: dict[str, torch.Tensor] = {}
    for name, value in planted_parameters(LlamaForCausalLM, config):
        held[name] = value
        del value  # the shard holds it; written, it is freed before the next one is made
        if name in closing:
            save_file(held, str(directory / closing[name]), metadata={"format": "pt"})
            held.clear()
    weight_map = {name: file for names, file in zip(shards, files, strict=True) for name in names}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(sizes.values())


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the built-in calibration texts with at most ``vocab_size`` ids,
    so that any vocabulary size can be fed real text."""
    pre = pre_tokenizers.Whitespace()
    words = sorted({word for text in builtin_texts() for word, _ in pre.pre_tokenize_str(text)})
    vocab = {"[PAD]": 0, "[UNK]": 1} | {word: i + 2 for i, word in enumerate(words[: vocab_size - 2])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(directory)


def _random(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Norm gains 1, matrices N(0, 0.02): activations stay in a realistic range through many blocks."""
    return torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * WEIGHT_STD
