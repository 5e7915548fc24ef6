"""What vLLM's compressed-tensors loader makes of a checkpoint directory, for the tests: written from
vLLM's source, apart from the lab's own rules (``lab.runtime``), so that a test of the lab's
checkpoints against it can fail.

vLLM loads the shards of a fused layer (``packed_modules_mapping``: a Llama's or Mixtral's
``qkv_proj`` from q/k/v and ``gate_up_proj`` from gate/up, a BERT's ``qkv_proj`` from
query/key/value) into one parameter per tensor and then, in ``process_weights_after_loading``:

- NVFP4 (``compressed_tensors_w4a4_nvfp4.py``): ``weight_global_scale.max()`` and
  ``input_global_scale.max()`` over the shards; every shard's FP4 codes times its block scales are
  read against that one global scale.
- FP8 with per-tensor weight scales (``process_fp8_weight_tensor_strategy``,
  ``requantize_with_max_scale``): every shard dequantized with its own scale and quantized again
  with the largest (``scaled_fp8_quant``: ``clamp(x / s, ±448)`` cast to E4M3); static input
  scales: ``input_scale.max()``.
- Everything else keeps each shard's own scales (integer per-tensor scales are expanded per
  channel), so a shard is served as compressed-tensors decompresses it.

``served(directory)`` gives each quantized layer's dense served weight (fp32) and its served input
scale or global scale; ``own(directory)`` the same read with each layer's own scales, which a
correct checkpoint makes equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

PACKED_MODULES = {
    "llama": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "mixtral": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "qwen2": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "mistral": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "bert": {"qkv_proj": ("query", "key", "value")},
}
"""vLLM's ``packed_modules_mapping`` of the model classes the tests write checkpoints of."""


@dataclass
class Layer:
    """One quantized layer as a server holds it: its dense weight (fp32) and input scale (the
    static per-tensor scale, or NVFP4's input global scale; None without one)."""

    weight: torch.Tensor
    input_scale: torch.Tensor | None


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found |= load_file(str(path))
    return found


def _schemes(config: dict) -> dict[str, dict]:
    """Each target layer's config group (its ``weights``, ``input_activations`` and ``format``), for the
    layers whose weights are quantized (a group of inputs alone leaves its weights as stored)."""
    groups = config["config_groups"].values()
    return {target: group for group in groups if group.get("weights") for target in group["targets"]}


def _shards(layers: list[str], model_type: str) -> list[list[str]]:
    """The quantized layers in the fused parameters vLLM loads them into (a layer alone: itself)."""
    mapping = PACKED_MODULES.get(model_type, {})
    groups: dict[str, list[str]] = {}
    for layer in layers:
        parent, _, name = layer.rpartition(".")
        fused = next((key for key, shards in mapping.items() if name in shards), None)
        groups.setdefault(layer if fused is None else f"{parent}.{fused}", []).append(layer)
    return list(groups.values())


def _local(tensors: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    prefix = layer + "."
    return {name.removeprefix(prefix): value for name, value in tensors.items() if name.startswith(prefix)}


def _nvfp4(state: dict[str, torch.Tensor], global_scale: torch.Tensor) -> torch.Tensor:
    """FP4 codes times block scales, read against ``global_scale`` (NVFP4's element step is
    ``block_scale / global_scale``)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    rows, columns = (int(size) for size in state["weight_shape"])
    codes = unpack_fp4_from_uint8(state["weight_packed"], rows, columns, dtype=torch.float32)
    step = state["weight_scale"].float() / global_scale.float()
    return codes * step.repeat_interleave(columns // step.shape[1], dim=1)


def _fp8_tensor(state: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    return state["weight"].float() * scale.float()


def _decompressed(state: dict[str, torch.Tensor], group: dict) -> torch.Tensor:
    """A shard served with its own scales: compressed-tensors' own decompressor of its format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    return compressor.decompress(dict(state), scheme)["weight"].float()


def _read(directory: Path, collapse: bool) -> dict[str, Layer]:
    config = json.loads((directory / "config.json").read_text())
    schemes = _schemes(config["quantization_config"])
    tensors = _tensors(directory)
    states = {layer: _local(tensors, layer) for layer in schemes}
    served: dict[str, Layer] = {}
    for shards in _shards(list(schemes), config.get("model_type", "")):
        group = schemes[shards[0]]
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        nvfp4 = group["format"] == "nvfp4-pack-quantized"
        per_tensor_fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8
        per_tensor_fp8 = per_tensor_fp8 and weights.get("strategy") == "tensor"
        input_name = "input_global_scale" if nvfp4 else "input_scale"
        input_scales = [states[s][input_name] for s in shards if input_name in states[s]]
        input_scale = torch.stack([x.float().reshape(()) for x in input_scales]).max() if input_scales else None
        for shard in shards:
            state = states[shard]
            own_input = state.get(input_name)
            if nvfp4:
                gs = torch.stack([states[s]["weight_global_scale"].float().reshape(()) for s in shards]).max()
                weight = _nvfp4(state, gs if collapse else state["weight_global_scale"])
            elif per_tensor_fp8:
                own = _fp8_tensor(state, state["weight_scale"])
                top = torch.stack([states[s]["weight_scale"].float().reshape(()) for s in shards]).max()
                requantized = (own / top).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * top
                weight = requantized if collapse else own
            else:
                weight = _decompressed(state, group)
            scale = (input_scale if collapse else own_input) if inputs is not None else None
            served[shard] = Layer(weight, None if scale is None else scale.float().reshape(()))
    return served


def served(directory: str | Path) -> dict[str, Layer]:
    """Every quantized layer of the checkpoint in ``directory`` as vLLM serves it."""
    return _read(Path(directory), collapse=True)


def own(directory: str | Path) -> dict[str, Layer]:
    """Every quantized layer of the checkpoint read with its own scales, as a runtime that does
    not fuse (transformers' own forward) reads it."""
    return _read(Path(directory), collapse=False)
