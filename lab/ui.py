"""Shared state and widget helpers for the Streamlit pages.

Everything a page needs beyond a few widget calls lives here, as small functions that can be
tested without a browser: turning widget values into a ``QuantSpec``, the default layer choice,
formats grouped by family, knob widgets generated from ``ob.knobs``, error messages that say what
to do, and the per-session state (analysis, result cache, choices).

State rules: models are opened once per process with ``st.cache_resource`` and shared read-only;
everything that belongs to one user (settings, the analysis, the result cache, captured
activations, choices) lives in ``st.session_state``, so browser sessions never see each other.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
import torch

import observers as ob
from lab import plots
from lab.pipeline import KV_TENSORS, Analysis, ResultCache, RunConfig, analyse, choose

ANALYSIS = "analysis"
RESULT_CACHE = "result_cache"
CAPTURE_CACHE = "capture_cache"
CHOICES = "choices"
LAST_RUN = "last_run"
LINEAR_TYPES = ("Linear", "Conv1D", "ExpertLinear")
FAMILY_ORDER = ("integer", "float", "MX", "NVFP4", "BFP", "cast")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")
ACTIVATION_STRATEGIES = ("tensor", "channel", "group", "token")
KV_STRATEGIES = ("tensor", "channel")
WANT_KINDS = ("weight", "input", "output", "kv")
FEW_TOKENS = 16
UPLOAD_DIR = Path(tempfile.gettempdir()) / "observer_lab_uploads"


# ---------------------------------------------------------------- widget state that survives pages


def keep(name: str, default: Any) -> Any:
    """The persistent value ``name`` (set to ``default`` the first time)."""
    if name not in st.session_state:
        st.session_state[name] = default
    return st.session_state[name]


def widget(fn: Callable[..., Any], label: str, name: str, default: Any, **kwargs: Any) -> Any:
    """Draw widget ``fn`` bound to the persistent value ``name``.

    Streamlit forgets a widget's state when a page without it runs; the value is therefore kept
    under ``name`` and the widget (key ``w:<name>``) is re-seeded from it when it comes back.
    """
    key = f"w:{name}"
    if key not in st.session_state:
        st.session_state[key] = keep(name, default)
    value = fn(label, key=key, **kwargs)
    st.session_state[name] = value
    return value


def metric_select(label: str, name: str) -> str:
    """A persistent selectbox over ``ob.METRIC_KEYS`` (default SQNR), labelled for people."""
    return widget(
        st.selectbox, label, name, "sqnr_db", options=list(ob.METRIC_KEYS), format_func=plots.METRIC_LABELS.get
    )


def current(name: str, default: Any) -> Any:
    """The latest value of a ``widget``: the widget's own state (which holds a change made in
    this rerun) before the persistent copy."""
    return st.session_state.get(f"w:{name}", st.session_state.get(name, default))


def set_value(name: str, value: Any) -> None:
    """Change a persistent value and the widget bound to it (call before the widget is drawn,
    e.g. in an ``on_change`` callback)."""
    st.session_state[name] = value
    st.session_state[f"w:{name}"] = value


# ---------------------------------------------------------------- errors


def explain(exc: BaseException) -> str:
    """A one-paragraph message for the user: what went wrong and what to do."""
    text = str(exc) or type(exc).__name__
    kind = type(exc).__name__
    if isinstance(exc, torch.OutOfMemoryError) or isinstance(exc, MemoryError):
        return f"Out of memory ({text}). Select fewer layers, fewer samples or a shorter sequence length."
    if "CUDA is not available" in text or "no CUDA" in text.lower():
        return f"{text}. This machine has no usable GPU: choose device 'auto' or 'cpu'."
    if kind == "FileTooLargeError":
        return f"{text}. Open the checkpoint as a local directory instead of uploading it."
    if kind == "LayerNotFoundError":
        return f"{text}. Pick layers from the table on the Model page."
    if kind == "ActivationsUnavailableError":
        return f"{text}. Untick the activation tensors on the Model page, or open a full model directory."
    if kind == "ModelSourceError":
        return f"{text}. Check the path or id, or choose a built-in sample model."
    if isinstance(exc, ValueError):
        return text
    return f"{kind}: {text}"


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show any error inside as ``st.error`` naming ``what`` failed; the page keeps running."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (a UI must not show tracebacks)
        st.error(f"{what} failed: {explain(exc)}")


# ---------------------------------------------------------------- model side


@dataclass(frozen=True)
class ModelRequest:
    """Which model to open: a source (built-in name, directory, file path or hub id), device, dtype."""

    source: str
    device: str = "auto"
    dtype: str = "fp32"


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without a GPU."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@st.cache_resource(show_spinner="Opening model…", max_entries=8)
def open_shared_model(source: str, device: str, dtype: str):
    """The model for ``(source, device, dtype)``, opened once per process and shared read-only."""
    from sample_models import open_model

    return open_model(source, device=device, dtype=dtype)


def current_model():
    """The model of the session's ``ModelRequest`` (None when none was chosen)."""
    request: ModelRequest | None = st.session_state.get("model_request")
    if request is None:
        return None
    return open_shared_model(request.source, request.device, request.dtype)


def save_upload(name: str, data: bytes) -> Path:
    """Store uploaded bytes under a name derived from their hash, so re-uploading the same file
    reuses the opened model and two users' uploads never collide."""
    if not name.endswith(".safetensors"):
        raise ValueError(f"{name!r} is not a .safetensors file")
    if not data:
        raise ValueError(f"{name!r} is empty")
    UPLOAD_DIR.mkdir(parents=True, exist_ok=True)
    path = UPLOAD_DIR / f"{hashlib.sha256(data).hexdigest()[:20]}.safetensors"
    if not path.exists():
        path.write_bytes(data)
    return path


def layer_frame(infos: Sequence) -> pd.DataFrame:
    """The layer table: name, type, shape, params."""
    return pd.DataFrame(
        {
            "name": [i.name for i in infos],
            "type": [i.type for i in infos],
            "shape": [" × ".join(map(str, i.shape)) for i in infos],
            "params": [i.params for i in infos],
        }
    )


def default_layer_names(infos: Sequence, count: int = 6) -> list[str]:
    """The first ``count`` linear layers (else the first 2-D layers): a quick, typical selection."""
    linear = [i.name for i in infos if i.type in LINEAR_TYPES]
    if linear:
        return linear[:count]
    return [i.name for i in infos if len(i.shape) >= 2][:count]


def layer_pattern(text: str) -> str | None:
    """The filter box's text as a ``Model.layers`` pattern: empty means all; a plain word (no glob
    characters, no ``re:``) matches names containing it."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("re:") or any(c in text for c in "*?["):
        return text
    return f"*{text}*"


# ---------------------------------------------------------------- run settings


def formats_by_family() -> dict[str, list[str]]:
    """Every ``ob.FORMATS`` dtype grouped by its ``family`` (known families first, in the order
    integer, float, MX, NVFP4, BFP, cast; any new family after them)."""
    groups: dict[str, list[str]] = {}
    for name, fmt in ob.FORMATS.items():
        groups.setdefault(getattr(fmt, "family", "other"), []).append(name)
    ordered = [f for f in FAMILY_ORDER if f in groups] + [f for f in groups if f not in FAMILY_ORDER]
    return {family: groups[family] for family in ordered}


def dtype_options() -> list[str]:
    """All dtypes in family order (for one selectbox)."""
    return [name for names in formats_by_family().values() for name in names]


def kv_dtype_options() -> list[str]:
    """Formats a KV cache can use: one scale per tensor or head, so no block formats."""
    return [name for name in dtype_options() if not ob.get_format(name).is_block]


def dtype_label(name: str) -> str:
    fmt = ob.get_format(name)
    return f"{getattr(fmt, 'family', 'other')} · {name}"


@dataclass
class SpecSettings:
    """Widget values of one spec editor (weights or activations)."""

    dtype: str = "int8"
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: int = 128
    block_rows: int = 128
    block_cols: int = 128
    scale_rounding: str = "floor"
    dynamic: bool = False

    def spec(self) -> ob.QuantSpec:
        """The ``QuantSpec``: only the fields the strategy and format use are set. Block formats
        (MX, NVFP4, BFP) fix their own group size; float and block formats are symmetric."""
        fmt = ob.get_format(self.dtype)
        fields: dict[str, Any] = {"dtype": self.dtype, "strategy": self.strategy, "dynamic": self.dynamic}
        fields["symmetric"] = self.symmetric if fmt.kind == "int" and not fmt.is_block else True
        if fmt.is_block:
            fields["strategy"] = "group"
        elif self.strategy == "group":
            fields["group_size"] = int(self.group_size)
        elif self.strategy == "block":
            fields["block_size"] = (int(self.block_rows), int(self.block_cols))
        if fmt.scale_kind == "e8m0":
            fields["scale_rounding"] = self.scale_rounding
        return ob.QuantSpec(**fields)

    @classmethod
    def from_spec(cls, spec: ob.QuantSpec) -> SpecSettings:
        block = spec.block_size or (128, 128)
        return cls(
            dtype=spec.dtype,
            symmetric=spec.symmetric,
            strategy=spec.strategy,
            group_size=spec.group_size or 128,
            block_rows=block[0],
            block_cols=block[1],
            scale_rounding=spec.scale_rounding,
            dynamic=spec.dynamic,
        )


def knob_kind(default: Any) -> str:
    """Which widget edits a knob: ``bool`` (checkbox), ``int``/``float`` (number input), ``text``."""
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    return "text"


def knob_choices(observer: str, knob: str) -> tuple[str, ...] | None:
    """Allowed values of a string knob when the observer class declares them (``knob_choices``)."""
    choices = getattr(ob.observer_class(observer), "knob_choices", {}) or {}
    values = choices.get(knob)
    return tuple(values) if values else None


def _number(text: str) -> int | float | str:
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text


def parse_knob(text: str, default: Any) -> Any:
    """A text knob back to its default's type: ``None`` defaults accept a number or nothing,
    tuple/list defaults a comma-separated list of numbers."""
    text = text.strip()
    if isinstance(default, (tuple, list)):
        return tuple(_number(part.strip()) for part in text.split(",") if part.strip())
    if default is None:
        if not text or text.lower() == "none":
            return None
        return _number(text)
    return text


def knob_text(default: Any) -> str:
    if isinstance(default, (tuple, list)):
        return ", ".join(map(str, default))
    return "" if default is None else str(default)


def knob_overrides(values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Only the knobs that differ from their defaults, per observer (what ``RunConfig.knobs`` takes)."""
    overrides = {}
    for name, knobs in values.items():
        defaults = ob.knobs(name)
        changed = {k: v for k, v in knobs.items() if k in defaults and v != defaults[k]}
        if changed:
            overrides[name] = changed
    return overrides


# ---------------------------------------------------------------- running


def progress_text(done: int, total: int, label: str, elapsed: float) -> str:
    return f"{done}/{total} steps · {elapsed:.1f} s · {label}"


class CapturingModel:
    """A model whose ``capture`` is memoized in one session's state: re-running after changing
    only a knob or a format reuses the activations captured for the same layers and texts."""

    def __init__(self, model, store: dict[str, Any]) -> None:
        self._model = model
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def capture(self, names: list[str], **kwargs: Any):
        return self._memo("capture", names, kwargs)

    def capture_kv(self, blocks: list[str], **kwargs: Any):
        return self._memo("capture_kv", blocks, kwargs)

    def _memo(self, method: str, names: list[str], kwargs: dict[str, Any]):
        key = repr((getattr(self._model, "source", ""), str(getattr(self._model, "dtype", "")), names, kwargs))
        slot = self._store.setdefault(method, {})
        if slot.get("key") != key:
            slot.clear()
            slot["value"] = getattr(self._model, method)(names, **kwargs)
            slot["key"] = key
        return slot["value"]


@dataclass
class RunOutcome:
    """What one press of Run produced: the analysis, cache hits/misses of this run, warnings."""

    analysis: Analysis
    hits: int
    misses: int
    warnings: list[str] = field(default_factory=list)


def run_analysis(
    model,
    layers: Sequence[str],
    config: RunConfig,
    progress: Callable[[int, int, str], None] | None = None,
    attention: Sequence[str] = (),
) -> RunOutcome:
    """``analyse`` with this session's result cache and capture memo; capture warnings (e.g.
    tokens subsampled to stay under the memory cap) are returned, not printed."""
    cache: ResultCache = keep(RESULT_CACHE, ResultCache())
    hits, misses = cache.hits, cache.misses
    wrapped = CapturingModel(model, keep(CAPTURE_CACHE, {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analysis = analyse(wrapped, list(layers), config, progress=progress, cache=cache, attention=list(attention))
    notes = list(analysis.warnings) + sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)})
    return RunOutcome(analysis, cache.hits - hits, cache.misses - misses, notes)


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# ---------------------------------------------------------------- results


def current_analysis() -> Analysis | None:
    return st.session_state.get(ANALYSIS)


def tensor_keys(analysis: Analysis) -> list[tuple[str, str]]:
    return [(e.layer, e.tensor) for e in analysis.entries]


def observer_order(analysis: Analysis) -> list[str]:
    """Registry order first (so colors match everywhere), then any other observer of the run."""
    registry = list(ob.available())
    names = list(analysis.config.observer_names)
    return registry + [n for n in names if n not in registry]


def error_table(analysis: Analysis) -> pd.DataFrame:
    """Layer × observer rows with every metric, time and observed tokens (errors kept as text)."""
    frame = analysis.frame()
    wanted = ["layer", "tensor", "observer", *ob.METRIC_KEYS, "seconds", "num_observed_tokens", "error"]
    return frame[[c for c in wanted if c in frame.columns]]


def best_mask(frame: pd.DataFrame, metric: str) -> pd.Series:
    """True on the row(s) holding the best ``metric`` within each (layer, tensor)."""
    sign = 1.0 if ob.HIGHER_IS_BETTER.get(metric, True) else -1.0
    score = sign * pd.to_numeric(frame[metric], errors="coerce")
    best = score.groupby([frame["layer"], frame["tensor"]]).transform("max")
    return (score == best) & score.notna()


def highlight_best(frame: pd.DataFrame, metric: str):
    """A pandas Styler that marks the best observer per tensor in bold with a green tint."""
    mask = best_mask(frame, metric)
    style = "font-weight: bold; background-color: rgba(46, 160, 67, 0.25)"
    numbers = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    styled = frame.style.apply(lambda row: [style if mask[row.name] else "" for _ in row], axis=1)
    return styled.format("{:.4g}", subset=numbers, na_rep="–")


def token_warnings(analysis: Analysis, few: int = FEW_TOKENS) -> list[str]:
    """Messages for activation tensors that saw no or very few tokens (e.g. MoE experts the router
    never chose): their ranges say nothing about real inputs."""
    notes = []
    for e in analysis.entries:
        if e.tensor == "weight":
            continue
        tokens = e.num_tokens
        if tokens == 0:
            notes.append(f"{e.layer} · {e.tensor}: no tokens observed (an expert the router never chose?)")
        elif tokens < few:
            notes.append(f"{e.layer} · {e.tensor}: only {tokens} tokens observed; its ranges are unreliable")
    return notes


def _metric_of(entry, observer: str | None, metric: str) -> float | None:
    if observer is None:
        return None
    return entry.result(observer).metrics.get(metric)


def choices_frame(analysis: Analysis, choices: dict[tuple[str, str], str], metric: str) -> pd.DataFrame:
    """One row per tensor: the chosen observer, the best one by ``metric``, and both metric values."""
    best = choose(analysis, metric)
    rows = []
    for e in analysis.entries:
        key = (e.layer, e.tensor)
        chosen = choices.get(key, best.get(key))
        rows.append(
            {
                "layer": e.layer,
                "tensor": e.tensor,
                "observer": chosen,
                metric: _metric_of(e, chosen, metric),
                "best": best.get(key),
                f"best {metric}": _metric_of(e, best.get(key), metric),
            }
        )
    return pd.DataFrame(rows)


def choices_from_frame(frame: pd.DataFrame) -> dict[tuple[str, str], str]:
    return {(row.layer, row.tensor): row.observer for row in frame.itertuples() if row.observer}


def layer_output_rows(model, analysis: Analysis, observers: Sequence[str]) -> pd.DataFrame:
    """Layer-output error on the captured inputs per layer and observer: weight-only,
    activation-only and both quantized (``sample_models.layer_output_error``)."""
    from sample_models import layer_output_error

    rows = []
    layers = dict.fromkeys(e.layer for e in analysis.entries)
    for layer in layers:
        try:
            weight, inputs = analysis.entry(layer, "weight"), analysis.entry(layer, "input")
        except ValueError:
            continue
        if inputs.data.shape[0] == 0:
            continue
        for name in observers:
            w_res, x_res = weight.result(name), inputs.result(name)
            if w_res.qparams is None or x_res.qparams is None:
                continue
            w_hat = ob.fake_quantize(weight.data, w_res.qparams, weight.spec)
            x_hat = ob.fake_quantize(inputs.data, x_res.qparams, inputs.spec)
            for mode, (qw, qx) in {
                "weight only": (w_hat, None),
                "activation only": (weight.data, x_hat),
                "both": (w_hat, x_hat),
            }.items():
                metrics = layer_output_error(model, layer, inputs.data, qw, qx)
                rows.append({"layer": layer, "observer": name, "quantized": mode, **metrics})
    return pd.DataFrame(rows)


def wanted_tensors(model) -> dict[str, bool]:
    """The Model page's "what to analyse" ticks (``weight``, ``input``, ``output``, ``kv``);
    activations and key/value states only where the model can run."""
    wants = {kind: bool(st.session_state.get(f"want_{kind}", kind in ("weight", "input"))) for kind in WANT_KINDS}
    if model is None or not model.supports_activations:
        wants["input"] = wants["output"] = wants["kv"] = False
    return wants


def attention_choice(model) -> list[str]:
    """The attention blocks chosen on the Model page whose keys and values are analysed (none
    unless the "Key/value states" tick is on)."""
    if not wanted_tensors(model)["kv"]:
        return []
    available = set(model.attention_blocks())
    return [name for name in st.session_state.get("attention", []) if name in available]


def calibration_texts() -> tuple[str, ...] | None:
    """None for the built-in texts, else the pasted text (split into windows by the model)."""
    if st.session_state.get("calib_kind", "built-in") != "pasted":
        return None
    text = st.session_state.get("calib_text", "").strip()
    if not text:
        raise ValueError("the pasted calibration text is empty: paste some text or use the built-in set")
    return (text,)


# ---------------------------------------------------------------- run page widgets


def spec_editor(
    role: str,
    strategies: Sequence[str],
    default: SpecSettings,
    dtypes: Sequence[str] | None = None,
    strategy_labels: dict[str, str] | None = None,
) -> SpecSettings:
    """Widgets for one spec (format by family, symmetric, granularity, group/block size, MX
    rounding); values persist under ``<role>_<field>``. ``dtypes`` limits the formats offered,
    ``strategy_labels`` renames granularities (``channel`` is "per head" for KV states)."""
    dtype = widget(
        st.selectbox,
        "Format",
        f"{role}_dtype",
        default.dtype,
        options=list(dtypes or dtype_options()),
        format_func=dtype_label,
    )
    fmt = ob.get_format(dtype)
    st.caption(fmt.description or fmt.name)
    free_range = fmt.kind == "int" and not fmt.is_block
    symmetric = widget(
        st.radio,
        "Range",
        f"{role}_symmetric",
        default.symmetric,
        options=[True, False],
        format_func=lambda v: "symmetric" if v else "asymmetric",
        horizontal=True,
        disabled=not free_range,
    )
    settings = SpecSettings(dtype=dtype, symmetric=symmetric if free_range else True)
    if fmt.is_block:
        st.caption(f"Block format: one scale per {fmt.block_size} consecutive values along the last dimension.")
        settings.strategy = "group"
    else:
        labels = strategy_labels or {}
        settings.strategy = widget(
            st.selectbox,
            "Granularity",
            f"{role}_strategy",
            default.strategy,
            options=list(strategies),
            format_func=lambda name: labels.get(name, name),
        )
    if settings.strategy == "group" and not fmt.is_block:
        settings.group_size = widget(
            st.number_input, "Group size", f"{role}_group_size", default.group_size, min_value=1, step=1
        )
    if settings.strategy == "block":
        rows, cols = st.columns(2)
        with rows:
            settings.block_rows = widget(
                st.number_input, "Block rows", f"{role}_block_rows", default.block_rows, min_value=1, step=1
            )
        with cols:
            settings.block_cols = widget(
                st.number_input, "Block columns", f"{role}_block_cols", default.block_cols, min_value=1, step=1
            )
    if fmt.scale_kind == "e8m0":
        settings.scale_rounding = widget(
            st.selectbox,
            "MX scale rounding",
            f"{role}_scale_rounding",
            default.scale_rounding,
            options=["floor", "even", "ceil"],
            help="Shared-exponent rounding: floor (OCP), even (Quark), ceil (ModelOpt).",
        )
    if role == "act":
        settings.dynamic = widget(
            st.checkbox,
            "Dynamic (ranges computed at run time; static qparams summarize calibration)",
            f"{role}_dynamic",
            default.dynamic,
        )
    return settings


def apply_preset() -> None:
    """``on_change`` of the preset box: copy the preset's specs into the spec editors; a preset
    that keeps activations in high precision also unticks input activations."""
    name = st.session_state.get("w:preset", "custom")
    st.session_state["preset"] = name
    if name == "custom":
        return
    specs = ob.preset(name)
    for role, spec in (("weight", specs["weight"]), ("act", specs.get("input"))):
        if spec is None:
            continue
        for key, value in asdict(SpecSettings.from_spec(spec)).items():
            set_value(f"{role}_{key}", value)
    set_value("want_input", specs.get("input") is not None)


def knob_editor(observer: str) -> dict[str, Any]:
    """One widget per knob of ``observer`` (from ``ob.knobs``): checkbox, number or text/select."""
    values: dict[str, Any] = {}
    for knob, default in ob.knobs(observer).items():
        name = f"knob:{observer}:{knob}"
        kind = knob_kind(default)
        if kind == "bool":
            values[knob] = widget(st.checkbox, knob, name, default)
        elif kind == "int":
            values[knob] = int(widget(st.number_input, knob, name, default, step=1))
        elif kind == "float":
            values[knob] = float(widget(st.number_input, knob, name, default, format="%.6g", step=None))
        elif (choices := knob_choices(observer, knob)) is not None:
            values[knob] = widget(st.selectbox, knob, name, default, options=list(choices))
        else:
            values[knob] = parse_knob(widget(st.text_input, knob, name, knob_text(default)), default)
    return values


def run_with_status(model, layers: Sequence[str], config: RunConfig, attention: Sequence[str] = ()) -> RunOutcome:
    """``run_analysis`` inside an ``st.status`` box with a progress bar (steps done, elapsed
    seconds, current layer · tensor · observer)."""
    with st.status("Capturing activations and running observers…", expanded=True) as status:
        bar = st.progress(0.0, text="starting")
        timer = Timer()

        def progress(done: int, total: int, label: str) -> None:
            bar.progress(done / total if total else 1.0, text=progress_text(done, total, label, timer.elapsed))

        try:
            outcome = run_analysis(model, layers, config, progress, attention)
        except Exception:
            status.update(label="Run failed", state="error")
            raise
        status.update(
            label=f"Done in {timer.elapsed:.1f} s: {outcome.misses} computed, {outcome.hits} reused from cache",
            state="complete",
            expanded=False,
        )
    return outcome


def require_analysis() -> Analysis:
    """The session's analysis; otherwise an info box with a link to Run, and the page stops."""
    analysis = current_analysis()
    if analysis is None or not analysis.entries:
        st.info("No results yet: choose a model and layers, then press Run.")
        st.page_link("pages/run.py", label="Go to Run", icon=":material/play_arrow:")
        st.stop()
    return analysis


def tensor_picker(analysis: Analysis, name: str = "tensor"):
    """A select box over the analysed (layer, tensor) pairs; returns the ``TensorAnalysis``."""
    keys = tensor_keys(analysis)
    if current(name, None) not in keys:
        set_value(name, keys[0])
    layer, tensor = widget(
        st.selectbox, "Layer · tensor", name, keys[0], options=keys, format_func=lambda k: f"{k[0]} · {k[1]}"
    )
    return analysis.entry(layer, tensor)


def observer_picker(entry, name: str, label: str = "Observers", limit: int | None = None) -> list[str]:
    """A multiselect over the observers that produced qparams on ``entry`` (default: all, or the
    first ``limit``)."""
    ok = [r.name for r in entry.results if r.qparams is not None]
    stored = [n for n in current(name, ok[:limit] if limit else ok) if n in ok]
    set_value(name, stored)
    return widget(st.multiselect, label, name, stored, options=ok)


def granularity_note(spec: ob.QuantSpec, tensor: str = "weight") -> str | None:
    """What the histogram lines mean when there is more than one range per tensor (``tensor``
    ``k``/``v``: per-channel ranges of attention states are per head)."""
    if spec.strategy == "tensor" and not spec.format.is_block:
        return None
    unit = "block" if spec.format.is_block else spec.strategy
    if tensor in KV_TENSORS and unit == "channel":
        unit = "head"
    return (
        f"Granularity is {unit}: each observer chose one range per {unit}. The lines show the tensor-wide "
        "envelope (smallest min, largest max over all of them); see the Scales page for the ranges per group."
    )


def range_table(results: Sequence) -> pd.DataFrame:
    """Per observer: the tensor-wide chosen range, share of values clipped and SQNR."""

    rows = []
    for r in results:
        if r.qparams is None:
            continue
        lo, hi = plots.envelope(r)
        clip = r.metrics.get("clip_ratio")
        rows.append(
            {
                "observer": r.name,
                "min": lo,
                "max": hi,
                "clipped %": None if clip is None else 100 * clip,
                "SQNR dB": r.metrics.get("sqnr_db"),
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- choose & export


def model_source(model) -> dict[str, Any]:
    """``lab.export.describe_source`` of the model (weight-file hashes), computed once per session
    and model."""
    from lab.export import describe_source

    memo = keep("source_memo", {})
    key = f"{getattr(model, 'source', '')}|{getattr(model, 'dtype', '')}"
    if key not in memo:
        memo[key] = describe_source(model)
    return memo[key]


def json_export(analysis: Analysis, choices: dict, metric: str, model, allow_uncalibrated: bool = False) -> str:
    """The Observer Lab JSON of ``choices`` as text (``lab.export.export_json``); tensors that
    saw no calibration tokens make it raise unless ``allow_uncalibrated``."""
    from lab.export import export_json

    buffer = io.StringIO()
    source = model_source(model) if model is not None else None
    export_json(analysis, choices, buffer, metric, source=source, allow_uncalibrated=allow_uncalibrated)
    return buffer.getvalue()


def compressed_tensors_zip(
    analysis: Analysis, choices: dict, model, allow_uncalibrated: bool = False
) -> tuple[bytes, list[str]]:
    """A zip of ``lab.export.export_compressed_tensors``' files (config, qparams.safetensors,
    notes), and the notes on what compressed-tensors cannot express."""
    from lab.export import export_compressed_tensors

    layer_types = {i.name: i.type for i in model.layers()} if model is not None else None
    has_kv = any(tensor in KV_TENSORS for _, tensor in choices)
    attention_blocks = model.attention_blocks() if model is not None and has_kv else None
    with tempfile.TemporaryDirectory() as tmp:
        written = export_compressed_tensors(
            analysis,
            choices,
            tmp,
            layer_types=layer_types,
            allow_uncalibrated=allow_uncalibrated,
            attention_blocks=attention_blocks,
        )
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in written["files"].values():
                archive.write(path, arcname=Path(path).name)
    return buffer.getvalue(), written["notes"]


def html_report(analysis: Analysis, choices: dict, metric: str) -> bytes:
    """The self-contained HTML report (``lab.report.write_report``) as bytes."""
    from lab.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        path = write_report(analysis, choices, Path(tmp) / "observer_lab_report.html", metric)
        return Path(path).read_bytes()


def import_choices(data: bytes, model, analysis: Analysis | None) -> tuple[dict[tuple[str, str], str], list[str]]:
    """Choices from an exported Observer Lab JSON, checked against ``model``; returns the choices
    that apply to the current analysis and a note per entry that does not."""
    from lab.export import apply_choices, load_json

    restored = apply_choices(load_json(io.BytesIO(data)), model)["choices"]
    if analysis is None:
        return restored, []
    present = {(e.layer, e.tensor): {r.name for r in e.results if r.qparams is not None} for e in analysis.entries}
    notes = [
        f"{layer} · {tensor}: {'not analysed in this run' if (layer, tensor) not in present else observer + ' not run'}"
        for (layer, tensor), observer in restored.items()
        if observer not in present.get((layer, tensor), set())
    ]
    kept = {k: v for k, v in restored.items() if v in present.get(k, set())}
    return kept, notes
