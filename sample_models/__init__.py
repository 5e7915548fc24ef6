"""Model side of Observer Lab: open a model, list its layers, read weights lazily, capture
calibration activations and KV states, and measure a layer's output error under quantization.

    from sample_models import open_model
    m = open_model("minilm")                      # or "tiny-llama", "tiny-moe", a dir, a file, a hub id
    m.layers("*.intermediate.dense")
    w = m.weight("encoder.layer.0.intermediate.dense")
    acts = m.capture(["encoder.layer.0.intermediate.dense"])
    acts = m.capture([...], sequential=True)      # one block of weights in memory at a time
"""

from .calibration import CaptureSubsampledWarning, builtin_texts
from .capture import Activations
from .errors import (
    ActivationsUnavailableError,
    FileTooLargeError,
    HubUnreachableError,
    LayerNotFoundError,
    ModelSourceError,
    SequentialUnsupportedError,
)
from .kv import split_heads
from .layer_error import layer_output_error
from .layers import LayerInfo, filter_layers
from .model import DEFAULT_MAX_BYTES, Model, SequentialFallbackWarning
from .sequential import SequentialStats
from .sources import BUILTIN_NAMES, DEFAULT_MAX_FILE_BYTES, open_model, resolve_device, resolve_dtype

__all__ = [
    "BUILTIN_NAMES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_FILE_BYTES",
    "Activations",
    "ActivationsUnavailableError",
    "CaptureSubsampledWarning",
    "FileTooLargeError",
    "HubUnreachableError",
    "LayerInfo",
    "LayerNotFoundError",
    "Model",
    "ModelSourceError",
    "SequentialFallbackWarning",
    "SequentialStats",
    "SequentialUnsupportedError",
    "builtin_texts",
    "filter_layers",
    "layer_output_error",
    "open_model",
    "resolve_device",
    "resolve_dtype",
    "split_heads",
]
