"""The app's widgets, bound to the session's ``Workspace``; with ``lab.ui.serving`` the only lab
modules that import streamlit.

Pages read like a description of the UI and call these helpers; everything they compute comes
from the floors below (``lab.settings``, ``lab.results``, ``lab.workspace``, ``lab.results.plots``).

State rules: models are opened once per process with ``st.cache_resource`` and shared read-only;
everything that belongs to one user lives in that session's ``Workspace`` (created once in
``app.py``), so browser sessions never see each other. Widgets are bound with ``bound``: the
workspace holds the value, the widget's own state (key ``w:<name>``) is seeded from it whenever
the widget is drawn after a page without it, and the page writes the widget's value back.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import streamlit as st
import torch
from streamlit.runtime.scriptrunner import get_script_run_ctx

import observers as ob
from lab import results
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.run_config import RunConfig
from lab.messages import explain
from lab.results import plots
from lab.serve.config import MAX_UPLOAD_MB
from lab.serve.session_runs import how_had
from lab.serve.uploads import UPLOAD_SUFFIXES
from lab.settings import SpecSettings, dtype_label, dtype_options, strategies
from lab.ui import serving
from lab.vocab import DEFAULT_METRIC
from lab.workspace import ModelRequest, RunOutcome, Workspace
from sample_models.capture import BlockTap

WORKSPACE = "workspace"
WIDGET_PAGES = "widget_pages"


# ---------------------------------------------------------------- the session's workspace


def workspace() -> Workspace:
    """This session's ``Workspace`` (created on first use; ``app.py`` calls this first)."""
    if WORKSPACE not in st.session_state:
        st.session_state[WORKSPACE] = Workspace()
    ctx = get_script_run_ctx()
    if ctx is not None:
        serving.watch_session(ctx.session_id, st.session_state[WORKSPACE])
    return st.session_state[WORKSPACE]


def bound(fn: Callable[..., Any], label: str, name: str, value: Any, **kwargs: Any) -> Any:
    """Draw widget ``fn`` showing ``value`` (a workspace field) and return what it holds now.

    Streamlit forgets a widget's state when a page without it runs, and a widget of the same key
    on another page does not take it over; its key ``w:<name>`` is therefore seeded from
    ``value`` whenever it is missing, was last drawn on another page, or holds a value no longer
    among ``options``. Otherwise it is assigned the value it holds: a widget whose value the
    browser alone remembers is redrawn from its declared default when the browser mounts it anew,
    and the next rerun reports that default back (after a model switch, all four "What to
    analyse" boxes came back unticked); an assigned value travels with the widget on every run.
    Callers assign the result back to the workspace field.
    """
    key = f"w:{name}"
    owners = st.session_state.setdefault(WIDGET_PAGES, {})
    page = _page_id()
    stale = owners.get(key) != page or not _valid(st.session_state.get(key), kwargs.get("options"))
    st.session_state[key] = value if key not in st.session_state or stale else st.session_state[key]
    owners[key] = page
    return fn(label, key=key, **kwargs)


def _page_id() -> str:
    """The page this script run draws (Streamlit's hash of the page's script)."""
    ctx = get_script_run_ctx()
    return "" if ctx is None else ctx.page_script_hash


def _valid(current: Any, options: Sequence[Any] | None) -> bool:
    """Whether a widget's remembered value is still among its options (a select box over the
    tensors of an earlier run must not keep a tensor this run lacks)."""
    if options is None:
        return True
    options = list(options)
    if isinstance(current, list):
        return all(value in options for value in current)
    return current in options


def reseed(*names: str) -> None:
    """Forget the widget state of ``names`` so they show the workspace's values again (call after
    the workspace changed a value a widget shows, before the widget is drawn)."""
    for name in names:
        st.session_state.pop(f"w:{name}", None)


def metric_select(label: str, ws: Workspace) -> str:
    """The one "choose by" metric of the session (Overview, Error, Choose & export share it)."""
    options = results.metric_options(ws.analysis)
    if ws.metric not in options:
        ws.metric = DEFAULT_METRIC
    ws.metric = bound(st.selectbox, label, "metric", ws.metric, options=options, format_func=plots.METRIC_LABELS.get)
    return ws.metric


# ---------------------------------------------------------------- errors


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show any error inside as ``st.error`` naming ``what`` failed; the page keeps running."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001  (a UI must not show tracebacks)
        st.error(f"{what} failed: {explain(exc)}")


# ---------------------------------------------------------------- model


def gpu_name() -> str | None:
    """The first CUDA device's name, or None without a GPU."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@st.cache_resource(show_spinner="Opening model…", max_entries=8)
def open_shared_model(source: str, device: str, dtype: str):
    """The model for ``(source, device, dtype)``, opened once per process and shared read-only."""
    from sample_models import open_model

    return open_model(source, device=device, dtype=dtype)


def open_request(request: ModelRequest | None):
    """The model of ``request`` (None for None): shared by every session, except a model opened
    from this session's own upload, which is this session's alone and goes with it."""
    if request is None:
        return None
    ws = workspace()
    if ws.uploads.owns(request.source):
        if request not in ws.own_models:
            from sample_models import open_model

            ws.own_models.clear()
            ws.own_models[request] = open_model(request.source, device=request.device, dtype=request.dtype)
        return ws.own_models[request]
    return open_shared_model(request.source, request.device, request.dtype)


def calibration_upload(ws: Workspace) -> None:
    """The calibration file uploader: a file is saved in the session's folder
    (``Workspace.save_calibration_upload``); removing it forgets it; coming back to the page,
    where the uploader starts empty, keeps the file uploaded before."""
    form = ws.calibration

    def removed() -> None:
        if st.session_state.get("calib_upload") is None:
            form.upload = form.upload_name = ""

    kinds = [suffix.lstrip(".") for suffix in UPLOAD_SUFFIXES]
    label = f"Calibration file (up to {MAX_UPLOAD_MB} MB)"
    upload = st.file_uploader(label, type=kinds, key="calib_upload", on_change=removed)
    if upload is not None:
        with guard(f"Saving {upload.name}"):
            ws.save_calibration_upload(upload.name, upload.getvalue())
    elif form.upload:
        st.caption(f"Using {form.upload_name}, uploaded earlier.")


# ---------------------------------------------------------------- run page


def spec_editor(role: str, editor: SpecSettings, strategy_labels: dict[str, str] | None = None) -> SpecSettings:
    """Widgets for one spec (format by family, range, granularity, group/block size, MX rounding,
    dynamic); they show and update ``editor`` in place (keys ``<role>_<field>``).
    ``strategy_labels`` renames granularities (``channel`` is "per head" for KV states)."""
    editor.dtype = bound(
        st.selectbox, "Format", f"{role}_dtype", editor.dtype, options=dtype_options(role), format_func=dtype_label
    )
    fmt = ob.get_format(editor.dtype)
    st.caption(fmt.description or fmt.name)
    symmetric = bound(
        st.radio,
        "Range",
        f"{role}_symmetric",
        editor.symmetric,
        options=[True, False],
        format_func=lambda v: "symmetric" if v else "asymmetric",
        horizontal=True,
        disabled=not editor.free_range,
    )
    if editor.free_range:
        editor.symmetric = symmetric
    if fmt.is_block:
        st.caption(f"Block format: one scale per {fmt.block_size} consecutive values along the last dimension.")
    else:
        labels = strategy_labels or {}
        editor.strategy = bound(
            st.selectbox,
            "Granularity",
            f"{role}_strategy",
            editor.strategy,
            options=list(strategies(role)),
            format_func=lambda name: labels.get(name, name),
        )
        if editor.strategy == "group":
            editor.group_size = bound(
                st.number_input, "Group size", f"{role}_group_size", editor.group_size, min_value=1, step=1
            )
        if editor.strategy == "block":
            rows, cols = st.columns(2)
            with rows:
                editor.block_rows = bound(
                    st.number_input, "Block rows", f"{role}_block_rows", editor.block_rows, min_value=1, step=1
                )
            with cols:
                editor.block_cols = bound(
                    st.number_input, "Block columns", f"{role}_block_cols", editor.block_cols, min_value=1, step=1
                )
    if fmt.scale_kind == "e8m0":
        editor.scale_rounding = bound(
            st.selectbox,
            "MX scale rounding",
            f"{role}_scale_rounding",
            editor.scale_rounding,
            options=[str(r) for r in ob.ScaleRounding],
            help="Shared-exponent rounding: floor (OCP), even (Quark), ceil (ModelOpt), compressed-tensors "
            "(amax rounded at FP4's one mantissa bit, for every MX format).",
        )
    if role == "act":
        editor.dynamic = bound(
            st.checkbox,
            "Dynamic (ranges computed at run time; static qparams summarize calibration)",
            f"{role}_dynamic",
            editor.dynamic,
        )
    return editor


def reseed_spec_editors() -> None:
    """Make the spec editors show the workspace's settings again (after a preset filled them)."""
    from dataclasses import fields

    reseed(*(f"{role}_{f.name}" for role in ("weight", "act", "kv") for f in fields(SpecSettings)))
    reseed("want_input")


def knob_editor(observer: str, values: dict[str, Any]) -> dict[str, Any]:
    """One widget per editable knob of ``observer``, from its declaration (``ob.knob_specs``)."""
    return knob_widgets(ob.knob_specs(observer), values, f"knob:{observer}")


def knob_widgets(knobs: dict[str, ob.Knob], values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """One widget per editable knob of ``knobs`` (keys ``<prefix>:<knob>``), its kind, bounds and
    help from the knob's declaration: checkbox, bounded number input, select box or text; ``values``
    holds the session's values and is updated in place. Returns the values."""
    for knob, declared in knobs.items():
        if not declared.editable:
            continue
        name = f"{prefix}:{knob}"
        current = values.get(knob, declared.default)
        help_text = declared.describe()
        if declared.type is bool:
            values[knob] = bound(st.checkbox, knob, name, current, help=help_text)
        elif declared.choices:
            values[knob] = bound(st.selectbox, knob, name, current, options=list(declared.choices), help=help_text)
        elif declared.type in (int, float):
            shown = {"format": "%.6g"} if declared.type is float else {"step": 1}
            values[knob] = bound(
                st.number_input, knob, name, current, help=help_text, **shown, **declared.widget_bounds()
            )
        else:
            values[knob] = bound(st.text_input, knob, name, str(current), help=help_text)
    return values


def run_with_status(
    ws: Workspace, model, config: RunConfig, attention: Sequence[str] = (), tap: BlockTap | None = None
) -> RunOutcome:
    """``Workspace.run`` inside an ``st.status`` box with a progress bar (steps done, elapsed
    seconds, current layer · tensor · observer), ``tap`` riding its pass; a computed run is kept in
    the team's history."""
    with st.status("Capturing activations and running observers…", expanded=True) as status:
        bar = st.progress(0.0, text="starting")
        timer = Timer()

        def progress(done: int, total: int, label: str) -> None:
            text = f"{done}/{total} steps · {timer.elapsed:.1f} s · {label}"
            bar.progress(done / total if total else 1.0, text=text)

        def waiting(line: str) -> None:
            status.update(label=f"{line[:1].upper()}{line[1:]}…")
            bar.progress(0.0, text=f"{timer.elapsed:.1f} s · {line}")

        try:
            shared, keep = serving.shared_runs(), serving.keeper(ws)
            outcome = ws.run(model, config, attention, progress, shared=shared, waiting=waiting, keep=keep, tap=tap)
        except Exception:
            status.update(label="Run failed", state="error")
            raise
        status.update(label=f"Done in {timer.elapsed:.1f} s: {run_summary(outcome)}", state="complete", expanded=False)
    return outcome


def run_summary(outcome: RunOutcome) -> str:
    """How a run's results were had (``lab.serve.session_runs.how_had``)."""
    return how_had(outcome.shared, outcome.hits, outcome.misses)


class Timer:
    """Seconds since it was made (for progress lines)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# ---------------------------------------------------------------- result pages


def require_analysis(ws: Workspace) -> Analysis:
    """The session's analysis (with a warning when it belongs to another model than the one now
    chosen); without one, an info box with links to a demo run and to Run, and the page stops."""
    if ws.analysis is None or not ws.analysis.entries:
        st.info("No results yet: run the one-click demo on the Overview, or choose a model and layers, then Run.")
        cols = st.columns(2)
        cols[0].page_link("pages/overview.py", label="Overview (demo run)", icon=":material/grid_view:")
        cols[1].page_link("pages/run.py", label="Go to Run", icon=":material/play_arrow:")
        st.stop()
    stale = ws.stale_reason()
    if stale:
        st.warning(stale)
    return ws.analysis


def tensor_picker(ws: Workspace, analysis: Analysis) -> TensorAnalysis:
    """A select box over the analysed (layer, tensor) pairs, shared by every result page."""
    keys = analysis.keys()
    if ws.view.get("tensor") not in keys:
        ws.view["tensor"] = keys[0]
        reseed("tensor")
    layer, tensor = bound(
        st.selectbox,
        "Layer · tensor",
        "tensor",
        ws.view["tensor"],
        options=keys,
        format_func=lambda k: f"{k[0]} · {k[1]}",
    )
    ws.view["tensor"] = (layer, tensor)
    return analysis.entry(layer, tensor)


def observer_picker(ws: Workspace, entry: TensorAnalysis, name: str, limit: int | None = None) -> list[str]:
    """A multiselect over the observers that produced qparams on ``entry``. The session keeps
    the observers a person *left out*, so moving to a tensor where more observers apply shows
    them again (the default is all, or the first ``limit``)."""
    usable = results.usable_observers(entry)
    hidden = set(ws.view.get(f"{name}:hidden", usable[limit:] if limit else []))
    state = st.session_state.get(f"w:{name}")
    if state is not None and ws.view.get(f"{name}:options") == usable:
        hidden = (hidden - set(usable)) | (set(usable) - set(state))  # the person's own change
    shown = [n for n in usable if n not in hidden]
    if state != shown:
        reseed(name)
    ws.view[f"{name}:options"] = usable
    ws.view[f"{name}:hidden"] = sorted(hidden)
    return bound(st.multiselect, "Observers", name, shown, options=usable)


def reseed_all() -> None:
    """Make every bound widget show the workspace again (after the workspace was replaced
    wholesale, e.g. by the demo)."""
    for key in [k for k in st.session_state if str(k).startswith("w:")]:
        del st.session_state[key]


def plain(text: str) -> str:
    """``text`` shown as it is where Streamlit reads Markdown (labels, captions)."""
    return re.sub(r"([\\`*_\[\]|~<>$])", r"\\\1", text)


def metrics_note(entry: TensorAnalysis) -> None:
    """Under an activation's histogram or metrics: a caption when they saw a sample of its tokens,
    and one when a reopened run holds a subset of that sample (``TensorAnalysis.kept_note``)."""
    if entry.metrics_note:
        note = entry.metrics_note
        st.caption(
            f"{note[:1].upper()}{note[1:]}: the histogram and error metrics are computed on a seeded sample; "
            "the qparams saw every token."
        )
    if entry.kept_note:
        st.caption(
            f"This kept run holds {entry.kept_note}, a seeded subset: the error histogram, run-time scales and "
            "per-token abs-max are drawn on them; the value histogram and per-channel ranges on every one."
        )


def highlight_best(frame, metric: str):
    """A pandas Styler that marks the best observer per tensor (``results.best_mask``) in bold
    with a green tint."""
    mask = results.best_mask(frame, metric)
    style = "font-weight: bold; background-color: rgba(46, 160, 67, 0.25)"
    numbers = [c for c in frame.columns if frame[c].dtype.kind == "f"]
    styled = frame.style.apply(lambda row: [style if mask[row.name] else "" for _ in row], axis=1)
    return styled.format("{:.4g}", subset=numbers, na_rep="–")


def layer_output(ws: Workspace, analysis: Analysis):
    """``results.layer_output_rows`` for the analysis's observers, computed once per analysis and
    kept in the workspace (running every layer on its inputs takes seconds to a minute)."""
    key = (id(analysis), analysis.config.observer_names)
    if key not in ws.layer_output:
        model = open_request(ws.last_request)
        ws.layer_output = {key: results.layer_output_rows(model, analysis, analysis.config.observer_names)}
    return ws.layer_output[key]
