"""``open_model``: turn a source string into a Model.

Sources, tried in this order:
1. a built-in name: "minilm" (default), "tiny-llama", "tiny-moe";
2. a local directory with config.json and safetensors (sharded or not) or weights-only .bin;
   weights only (``weights_only_reason`` says why) when transformers cannot build its architecture
   or it has no usable tokenizer;
3. a single .safetensors (or .bin) file: weights only, no activations;
4. a Hugging Face hub id ("org/name"), downloaded (or found in the local hub cache when
   offline) and then opened as a directory.
Remote code is never run and nothing is unpickled beyond tensors.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

import huggingface_hub
import torch
import transformers
from huggingface_hub.errors import (
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from torch import nn
from transformers import (
    AutoConfig,
    AutoTokenizer,
    LlamaForCausalLM,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from . import builtin
from .errors import FileTooLargeError, HubUnreachableError, ModelSourceError
from .model import Model, Runtime
from .sequential import empty_model, from_config
from .stores import CheckpointWeights, ModuleWeights, checkpoint_files

DEFAULT_MAX_FILE_BYTES = 8 << 30
BUILTIN_NAMES = ("minilm", "tiny-llama", "tiny-moe")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"]
HUB_BIN_PATTERNS = ["*.json", "*.bin", "*.txt", "*.model", "tokenizer*"]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
    "vocab.json",
)
WEIGHTS_ONLY = "activations cannot be captured; weights can be analysed"
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def open_model(
    source: str | os.PathLike = "minilm",
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    cache_dir: str | os.PathLike | None = None,
) -> Model:
    """Open a model source (see the module docstring) on ``device`` ("cpu", "cuda", "cuda:1",
    "auto") in ``dtype`` (fp32, fp16, bf16). Built-ins are cached: calling again with the same
    arguments returns the same shared object. ``max_file_bytes`` limits single-file loads (uploads);
    ``cache_dir`` overrides the hub cache (default: ``HF_HUB_CACHE``)."""
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    text = os.fspath(source)
    if text in BUILTIN_NAMES:
        return _open_builtin(text, str(torch_device), torch_dtype)
    path = Path(text).expanduser()
    if path.is_dir():
        return open_directory(path, torch_device, torch_dtype)
    if path.is_file():
        return open_weights_file(path, torch_device, torch_dtype, max_file_bytes)
    if HUB_ID.match(text):
        return open_hub(text, torch_device, torch_dtype, cache_dir)
    raise ModelSourceError(
        f"{text!r} is not a built-in model ({', '.join(BUILTIN_NAMES)}), an existing file or directory, or a hub id"
    )


def resolve_device(device: str | torch.device) -> torch.device:
    """Resolve "auto" to CUDA when present; asking for CUDA without it is an error, not a silent CPU run."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}: {err}") from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """fp32 / fp16 / bf16 by name or torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r}; use fp32, fp16 or bf16")


@lru_cache(maxsize=16)
def _open_builtin(name: str, device: str, dtype: torch.dtype) -> Model:
    torch_device = torch.device(device)
    if name == "minilm":
        return open_directory(
            builtin.minilm_dir(), torch_device, dtype, name="minilm", description=builtin.MINILM_DESCRIPTION
        )
    build, model_class, config, description = {
        "tiny-llama": (
            builtin.build_tiny_llama,
            LlamaForCausalLM,
            builtin.tiny_llama_config(),
            builtin.TINY_LLAMA_DESCRIPTION,
        ),
        "tiny-moe": (
            builtin.build_tiny_moe,
            MixtralForCausalLM,
            builtin.tiny_moe_config(),
            builtin.TINY_MOE_DESCRIPTION,
        ),
    }[name]
    runtime = Runtime(
        lambda: build().to(device=torch_device, dtype=dtype),
        lambda: _tokenizer(builtin.minilm_dir()),
        lambda: empty_model(lambda: model_class(config), torch_device, dtype),
    )
    return Model(
        name=name,
        source=f"built-in model {name!r}",
        description=description,
        store=ModuleWeights(runtime.module.get, f"built-in model {name!r}"),
        runtime=runtime,
        config=config,
        device=torch_device,
        dtype=dtype,
    )


def open_directory(
    path: Path, device: torch.device, dtype: torch.dtype, *, name: str | None = None, description: str | None = None
) -> Model:
    """A Hugging Face model directory. Layers and weights come from the checkpoint headers;
    the model itself is loaded only when activations are asked for. A directory whose architecture
    transformers cannot build, or without a usable tokenizer, is not refused: its weights are still
    worth analysing, so it opens weights-only with the reason in ``weights_only_reason``."""
    config, model_class, why = _architecture(path)
    files = checkpoint_files(path)
    module_types = None if model_class is None else _meta_module_types(model_class, config)
    store = CheckpointWeights(files, dtype=dtype, device=device, module_types=module_types)
    runtime = None
    if model_class is not None:
        runtime, why = _runtime(path, model_class, config, files, device, dtype)
    kind = "weights only" if runtime is None else f"{type(config).__name__.removesuffix('Config')} model"
    return Model(
        name=name or path.name,
        source=str(path),
        description=description or f"{kind} from {path}",
        store=store,
        runtime=runtime,
        config=config,
        device=device,
        dtype=dtype,
        weights_only_reason=why,
    )


def open_weights_file(path: Path, device: torch.device, dtype: torch.dtype, max_file_bytes: int) -> Model:
    """A bare weights file: layers and weights only; types are inferred from names and shapes."""
    size = path.stat().st_size
    if size > max_file_bytes:
        raise FileTooLargeError(f"{path} is {size} bytes, over the {max_file_bytes}-byte limit for single files")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise ModelSourceError(f"{path}: unsupported file type; expected one of {', '.join(WEIGHT_SUFFIXES)}")
    return Model(
        name=path.name,
        source=str(path),
        description=f"weights only, from {path.name} (no architecture: activations unavailable)",
        store=CheckpointWeights([path], dtype=dtype, device=device),
        runtime=None,
        config=None,
        device=device,
        dtype=dtype,
        weights_only_reason=f"{path} is a bare weights file (no config.json, no tokenizer): {WEIGHTS_ONLY}; "
        "open its model directory for activations",
    )


def open_hub(repo_id: str, device: torch.device, dtype: torch.dtype, cache_dir: str | os.PathLike | None) -> Model:
    """A hub model: download config, tokenizer and weights (safetensors, else .bin), or use the
    local hub cache when offline (HF_HUB_OFFLINE=1), then open the snapshot directory."""
    snapshot = _snapshot(repo_id, HUB_PATTERNS, cache_dir)
    if not any(snapshot.glob("*.safetensors")):
        snapshot = _snapshot(repo_id, HUB_BIN_PATTERNS, cache_dir)
    return open_directory(snapshot, device, dtype, name=repo_id)


def _snapshot(repo_id: str, patterns: list[str], cache_dir: str | os.PathLike | None) -> Path:
    offline = huggingface_hub.constants.HF_HUB_OFFLINE or _env_flag("HF_HUB_OFFLINE")
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id,
                allow_patterns=patterns,
                cache_dir=cache_dir or os.environ.get("HF_HUB_CACHE"),
                local_files_only=offline,
            )
        )
    except (OSError, HFValidationError) as err:
        raise _hub_error(repo_id, err, offline) from err


def _hub_error(repo_id: str, err: Exception, offline: bool) -> ModelSourceError:
    """Tell apart the ways a hub id fails, because each has its own fix: a malformed id (retype
    it), a model the hub does not have (check the name or log in), no connection or offline mode
    (download it elsewhere and open the directory), anything else (the hub's own message)."""
    if isinstance(err, HFValidationError):
        return ModelSourceError(f"{repo_id!r} is neither an existing file or directory nor a valid hub id: {err}")
    if isinstance(err, RepositoryNotFoundError | RevisionNotFoundError):
        return ModelSourceError(
            f"the Hugging Face Hub has no model {repo_id!r} (or it is private or gated and you are not logged in)"
        )
    if offline or isinstance(err, LocalEntryNotFoundError | OfflineModeIsEnabled):
        cause = "HF_HUB_OFFLINE is set" if offline else "no connection"
        return HubUnreachableError(
            f"could not reach the Hugging Face Hub for {repo_id!r} (offline?): download it and open the local "
            f"directory ({cause}, and it is not in the local hub cache)"
        )
    return ModelSourceError(f"downloading {repo_id!r} from the Hugging Face Hub failed: {_first_line(err)}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _first_line(err: BaseException) -> str:
    """Library messages run to paragraphs; the first line is the one a UI can show."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_config_json(path: Path) -> dict:
    """config.json as a dict: without a readable one a directory is not a model directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(
            f"no config.json in {path}: a model directory needs one (open a .safetensors file for weights only)"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{config_file}: unreadable model config: {err}") from err
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{config_file}: a model config is a JSON object, not a {type(raw).__name__}")
    return raw


def _architecture(path: Path) -> tuple[PretrainedConfig | None, type[nn.Module] | None, str | None]:
    """The config and the class that builds the model, or the reason there is none. An architecture
    transformers does not know, or whose code ships with the checkpoint (never run), leaves the
    weights readable, so it is a reason to go weights-only, not an error."""
    raw = _read_config_json(path)
    model_type = raw.get("model_type")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError, TypeError) as err:
        if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
            return None, None, _cannot_build(path, raw, f"cannot read this {model_type!r} config ({_first_line(err)})")
        named = f"does not know model_type {model_type!r}" if model_type else "finds no model_type to go by"
        return None, None, _cannot_build(path, raw, named)
    model_class = _model_class(config)
    if model_class is None:
        architectures = getattr(config, "architectures", None) or [type(config).__name__]
        return config, None, _cannot_build(path, raw, f"does not know architecture {architectures[0]!r}")
    return config, model_class, None


def _cannot_build(path: Path, raw: dict, what: str) -> str:
    """Why a directory is weights-only, naming its config.json and the transformers version (a newer
    one may know the architecture)."""
    remote = " (its code ships with the checkpoint; remote code is never run)" if "auto_map" in raw else ""
    return f"{path / 'config.json'}: transformers {transformers.__version__} {what}{remote}: {WEIGHTS_ONLY}"


def _model_class(config: PretrainedConfig) -> type[nn.Module] | None:
    """The transformers class named in ``architectures`` (so module names match checkpoint keys),
    or the base AutoModel class when the config names none; None when transformers has neither."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        try:
            return transformers.models.auto.modeling_auto.MODEL_MAPPING[type(config)]
        except KeyError:
            return None
    model_class = getattr(transformers, architectures[0], None)
    if not isinstance(model_class, type) or not issubclass(model_class, nn.Module):
        return None
    return model_class


def _meta_module_types(model_class: type[nn.Module], config: PretrainedConfig) -> dict[str, str]:
    """Module class names by module name, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        meta = model_class._from_config(config)
    return {name: type(module).__name__ for name, module in meta.named_modules() if name}


def _load_module(
    model_class: type[nn.Module], path: Path, files: list[Path], device: torch.device, dtype: torch.dtype
) -> nn.Module:
    try:
        model = model_class.from_pretrained(
            str(path),
            local_files_only=True,
            trust_remote_code=False,
            dtype=dtype,
            use_safetensors=files[0].suffix == ".safetensors",
        )
    except (OSError, ValueError, RuntimeError) as err:
        raise ModelSourceError(f"cannot load the model in {path}: {err}") from err
    return model.to(device).eval()


def _runtime(
    path: Path,
    model_class: type[nn.Module],
    config: PretrainedConfig,
    files: list[Path],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Runtime | None, str | None]:
    """What activations need, or why there is none. The tokenizer is loaded when the model is
    opened rather than at the first capture, so that a checkpoint without one opens weights-only
    with a plain reason instead of failing at Run with a message about sentencepiece."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None, f"no tokenizer files (tokenizer.json / tokenizer.model) in {path}: {WEIGHTS_ONLY}"
    try:
        tokenizer = _tokenizer(path)
    except Exception as err:  # transformers, sentencepiece, protobuf and the Rust tokenizers each raise their own
        return None, f"no usable tokenizer in {path} ({type(err).__name__}: {_first_line(err)}): {WEIGHTS_ONLY}"
    runtime = Runtime(
        lambda: _load_module(model_class, path, files, device, dtype),
        lambda: tokenizer,
        lambda: empty_model(from_config(model_class, config, dtype), device),
    )
    return runtime, None


def _tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token (captures pad their batches)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ModelSourceError(f"the tokenizer in {path} has no pad, eos or unk token to pad batches with")
        tokenizer.pad_token = fallback
    return tokenizer
