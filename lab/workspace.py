"""One browser session's state, as one typed object.

The app creates a ``Workspace`` once per session (``app.py``) and every page reads and writes its
fields: which model, the run settings, the caches that make re-runs cheap, the analysis with the
choices made on it, and what each page shows. Nothing here imports streamlit, so the state rules
can be tested without a browser; ``lab.ui`` binds widgets to these fields.

Results stay tied to their model: ``analysis`` carries its own ``ModelFacts``, and
``stale_reason`` says when the model now chosen on the Model page is not the one the results
came from, so pages can say so instead of exporting one model's qparams under another's name.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from lab.history.index import RunRecord
from lab.history.run_file import KeptRun
from lab.results import Choices, valid_choices
from lab.results.calibration import calibration_text
from lab.serve import roots
from lab.serve.config import ServeConfig
from lab.serve.session_runs import ComputedRun, Keep, SessionRun, kept
from lab.serve.shared_runs import SharedRuns, Waiting, tensor_bytes
from lab.serve.uploads import SessionUploads, UploadError
from lab.settings import CalibrationForm, RunSettings, SpecSettings
from lab.vocab import DEFAULT_METRIC
from sample_models.calibration_sets import CalibrationSource, CalibrationSourceError, calibration_stamp, preview
from sample_models.capture import BlockTap

DEMO_MODEL = "minilm"
DEMO_LAYERS = 6
"""The one-click demo: the default sample and how many of its layers (the default selection)."""
CHECKS_KEPT = 16


@dataclass(frozen=True)
class ModelRequest:
    """Which model to open: a source (built-in name, directory, file path or hub id), device, dtype."""

    source: str
    device: str = "auto"
    dtype: str = "fp32"


@dataclass
class ModelForm:
    """The Model page's source fields: which kind of source, the path or id typed for each, the
    device and weights dtype, and the layer filter."""

    kind: str = "minilm"
    directory: str = ""
    hub_id: str = ""
    device: str = "auto"
    dtype: str = "fp32"
    layer_filter: str = ""


@dataclass(frozen=True)
class CalibrationCheck:
    """What the Model page shows of a calibration set before a run: ``preview`` (``calibration_sets.
    preview``), the samples and tokens it gives with the page's settings, the shortfall line, or
    ``error``: one line saying why it cannot be used."""

    source: CalibrationSource | None = None
    preview: dict[str, Any] | None = None
    samples: int = 0
    tokens: int = 0
    shortfall: str | None = None
    error: str | None = None


@dataclass
class RunOutcome:
    """What one press of Run produced: the analysis, cache hits/misses of this run, warnings,
    ``shared``: how the server had it ("computed" here, "joined" another session's computation of
    the same run, "cached" from an earlier one, ``lab.serve.shared_runs``; "kept": opened from the
    history), and ``kept``: the run's record in the team's history (None: not kept)."""

    analysis: Analysis
    hits: int
    misses: int
    warnings: list[str] = field(default_factory=list)
    shared: str = "computed"
    kept: RunRecord | None = None


@dataclass
class ImportState:
    """The last imported lab file: its digest (so it is imported once), what it restored, the rest noted."""

    digest: str = ""
    name: str = ""
    restored: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class EffectState:
    """The Model effect page's state for one analysis: the held-out settings, the evaluator (the
    float run on held-out text, cached at every block boundary, so each evaluation and sensitivity
    run reuses it) with the settings it was built for, the sensitivity table and the end-to-end
    evaluations last shown."""

    analysis: Analysis | None = None
    samples: int = 64
    seq_len: int = 128
    evaluator: Any = None
    evaluator_key: tuple | None = None
    sensitivity: Any = None
    evaluations: list = field(default_factory=list)
    choose_by: str | None = None


@dataclass
class Workspace:
    """Everything that belongs to one browser session.

    Model page: ``form`` (what was typed), ``request`` (the opened model; ``last_request`` the one
    the results came from), ``layers`` and ``attention`` (chosen names; None: the first two
    blocks), ``pasted_text`` (kept while the built-in texts are chosen), ``calibration`` (the
    calibration set's fields; ``uploads``: this session's uploaded calibration and weights
    files, removed with the session; ``calibration_checks``: previews and token counts already computed).
    Run page: ``settings`` (what to analyse, specs, observers, knobs, calibration). Results: ``analysis``,
    ``last_run``, ``overrides`` (observer choices a person made or imported, on top of the best by
    ``metric``). Caches: ``result_cache`` (per tensor × spec × observer × knobs),
    ``capture_memo`` (the last capture), ``layer_output`` (layer-output error per analysis and
    observer set). ``view`` holds what the result pages show (picked tensor, observers), so a
    choice made on one page holds on the next. ``who``: who the session is signed in as (the runs
    and exports it asks for say so).
    """

    request: ModelRequest | None = None
    last_request: ModelRequest | None = None
    form: ModelForm = field(default_factory=ModelForm)
    layers: list[str] = field(default_factory=list)
    attention: list[str] | None = None
    pasted_text: str = ""
    calibration: CalibrationForm = field(default_factory=CalibrationForm)
    uploads: SessionUploads = field(default_factory=SessionUploads, repr=False)
    own_models: dict[ModelRequest, Any] = field(default_factory=dict, repr=False)
    """Models opened from this session's uploads: this session's alone, dropped with it."""
    calibration_checks: dict[tuple, Any] = field(default_factory=dict, repr=False)
    settings: RunSettings = field(default_factory=RunSettings)
    analysis: Analysis | None = None
    transformed: Analysis | None = None
    """The same run through the settings' transform (rotation, smoothing): viewed beside
    ``analysis``, never exported (a checkpoint holds the untransformed tensors)."""
    unpropagated: Analysis | None = None
    """With propagation, the same run calibrated on the float model: its activation ranges are
    shown beside the propagated ones (``analysis``, which exports take)."""
    last_run: RunOutcome | None = None
    metric: str = DEFAULT_METRIC
    overrides: Choices = field(default_factory=dict)
    imported: ImportState = field(default_factory=ImportState)
    result_cache: ResultCache = field(default_factory=ResultCache)
    capture_memo: dict[str, Any] = field(default_factory=dict)
    layer_output: dict[tuple, pd.DataFrame] = field(default_factory=dict)
    report_html: bytes | None = None
    view: dict[str, Any] = field(default_factory=dict)
    effect: EffectState = field(default_factory=EffectState)
    allocation: Any = None  # the Allocate page's state (lab.allocate.session.AllocateState), made on its first visit
    awq: Any = None  # the AWQ switch and its last run (lab.awq.session.AWQState), made on the first page that asks
    who: str = "none"

    # ------------------------------------------------------------ model

    def choose_model(self, request: ModelRequest, layer_names: Sequence[str]) -> bool:
        """Record the opened model; a new model resets the layer and attention choice to
        ``layer_names`` (its default). True when the model changed."""
        if request == self.request:
            return False
        self.request = request
        self.layers = list(layer_names)
        self.attention = None
        return True

    def wants_for(self, model: Any) -> dict[str, bool]:
        """What to analyse on ``model``: the ticks, with activations and key/value states off
        where the model cannot run (weights-only sources)."""
        wants = dict(self.settings.wants)
        if model is None or not model.supports_activations:
            wants.update(input=False, output=False, kv=False)
        return wants

    def attention_for(self, model: Any) -> list[str]:
        """The attention blocks whose keys and values are analysed: none unless key/value states
        are ticked; the first two of the model until a person chooses."""
        if not self.wants_for(model)["kv"]:
            return []
        blocks = model.attention_blocks()
        chosen = blocks[:2] if self.attention is None else self.attention
        return [name for name in chosen if name in blocks]

    def stale_reason(self) -> str | None:
        """Why the results do not belong to the model now chosen (None when they do)."""
        if self.analysis is None or self.request is None or self.last_run is None:
            return None
        ran = self.last_request
        if ran is not None and ran != self.request:
            return (
                f"These results are of {ran.source!r} ({ran.dtype}); the Model page now has {self.request.source!r} "
                f"({self.request.dtype}). Press Run to analyse it; exports and imports use the results' model."
            )
        return None

    def start_demo(self, layer_names: Sequence[str]) -> None:
        """Set up the one-click demo on the default sample (MiniLM): its first linear layers
        (``layer_names``), weights as int4 groups of 128 and inputs as int8 per tensor, every
        observer, the built-in calibration text. The Model and Run pages then show these
        settings, so a person can change one thing and run again."""
        self.request = ModelRequest(DEMO_MODEL)
        self.form = ModelForm()
        self.calibration = CalibrationForm()
        self.layers = list(layer_names)[:DEMO_LAYERS]
        self.attention = None
        self.settings = RunSettings(
            weight=SpecSettings(dtype="int4", strategy="group", group_size=128),
            act=SpecSettings(dtype="int8", strategy="tensor"),
        )

    # ------------------------------------------------------------ running

    def run(
        self,
        model: Any,
        config: RunConfig,
        attention: Sequence[str] = (),
        progress: Callable[[int, int, str], None] | None = None,
        shared: SharedRuns | None = None,
        waiting: Waiting | None = None,
        keep: Keep | None = None,
        tap: BlockTap | None = None,
    ) -> RunOutcome:
        """``analyse`` ``self.layers`` with this session's result cache and capture memo (``tap``
        riding the pass it computes: the Run page's AWQ); the outcome replaces the analysis, and
        choices made on the old one are dropped. Capture warnings are returned, not printed.
        With ``shared`` (the server's ``SharedRuns``), a run another session computes or computed
        with the same model, layers and settings is read from there instead of computed again, and
        a different run waits for a free slot; ``waiting`` is told what this session waits for.
        ``keep`` keeps a computed run in the team's history (``lab.history``)."""
        session = SessionRun(model, list(self.layers), config, attention, self.result_cache, self.capture_memo, tap)
        request = asdict(self.request) if self.request is not None else {}
        if shared is None:
            computed, how = session.compute(progress), "computed"
            computed = computed if keep is None else kept(computed, keep, request)
        else:
            computed, how = shared.run(session.key(), session.sharing(progress, keep, request), tensor_bytes, waiting)
        counts = (computed.hits, computed.misses) if how == "computed" else (0, 0)
        return self._show(computed, RunOutcome(computed.analysis, *counts, list(computed.notes), how, computed.kept))

    def open_kept(self, run: KeptRun, record: RunRecord) -> RunOutcome:
        """Show a run of the team's history (``lab.history``) as if it had just run: its model,
        layers and analyses become the session's, nothing is recomputed."""
        self.request = ModelRequest(**record.request)
        self.layers = list(record.layers)
        computed = ComputedRun(run.analysis, run.transformed, run.unpropagated, (), 0, 0, record)
        return self._show(computed, RunOutcome(run.analysis, 0, 0, list(run.analysis.warnings), "kept", record))

    def _show(self, computed: ComputedRun, outcome: RunOutcome) -> RunOutcome:
        """Make ``computed`` the session's results (choices made on the old ones are dropped)."""
        self.analysis, self.transformed = computed.analysis, computed.transformed
        self.unpropagated = computed.unpropagated
        self.last_run, self.last_request = outcome, self.request
        self.overrides, self.imported = {}, ImportState()
        self.report_html, self.layer_output = None, {}
        return outcome

    def release(self) -> None:
        """Give back what the session held once it ended: its uploads (removed), its analyses,
        caches, models and evaluator (dropped), and the freed memory to the operating system. A
        result other sessions still read stays in the server's shared cache."""
        from sample_models.sequential import return_freed_memory

        self.uploads.remove()
        fresh = Workspace()
        dropped = ("analysis", "transformed", "unpropagated", "last_run", "result_cache", "capture_memo", "own_models")
        for name in (*dropped, "layer_output", "calibration_checks", "report_html", "effect", "allocation", "awq"):
            setattr(self, name, getattr(fresh, name))
        gc.collect()
        return_freed_memory()

    def transformed_entry(self, entry: TensorAnalysis) -> TensorAnalysis | None:
        """``entry`` as the run through the transform saw it (None without a transform)."""
        return _same_entry(self.transformed, entry)

    def unpropagated_entry(self, entry: TensorAnalysis) -> TensorAnalysis | None:
        """An activation ``entry`` as the float model's calibration saw it (None without propagation)."""
        return None if entry.tensor == "weight" else _same_entry(self.unpropagated, entry)

    # ------------------------------------------------------------ calibration set

    def save_calibration_upload(self, name: str, data: bytes) -> Path:
        """Store an uploaded calibration file in this session's folder (``SessionUploads``: the
        uploaded name is never used as a path) and record it as the form's upload."""
        form = self.calibration
        form.upload = form.upload_name = ""
        try:
            target, form.upload_digest = self.uploads.save_calibration(name, data, form.upload_digest)
        except UploadError as err:
            raise CalibrationSourceError(str(err)) from None
        form.upload, form.upload_name = str(target), Path(name).name
        return target

    def save_model_upload(self, name: str, data: bytes) -> Path:
        """Store an uploaded weights file in this session's folder (``SessionUploads.save_model``)."""
        return self.uploads.save_model(name, data)

    @property
    def upload_dir(self) -> Path | None:
        """This session's upload folder (None before its first upload)."""
        return self.uploads.folder

    def check_calibration(
        self, model: Any, samples: int, seq_len: int, served: ServeConfig | None = None
    ) -> CalibrationCheck:
        """The chosen calibration set as the Model page shows it: its preview (computed once per
        source and file state) and the samples and tokens ``model`` makes of it (once per source,
        model, samples and sequence length); a set that cannot be used has ``error`` (and the
        preview when only the tokenizing failed). Failures are remembered too, but a hub's.

        With ``served`` (the server's declared settings), a local path typed in the browser is
        resolved and refused outside the data roots, and a hub id refused on an offline server,
        before anything of it is read or even looked up."""
        form, shown, found = self.calibration, None, None
        try:
            source = self._calibration_source(served)
            stamp = calibration_stamp(source)
            shown = self._checked(("preview", stamp), source, lambda: preview(source))
            key = ("set", stamp, getattr(model, "source", None), samples, seq_len)
            found = self._checked(key, source, lambda: model.calibration_set(source, int(samples), int(seq_len)))
        except (ValueError, OSError) as err:
            check = CalibrationCheck(preview=shown, error=str(err) or type(err).__name__)
        else:
            check = CalibrationCheck(source, shown, len(found.windows), found.tokens, found.shortfall)
        form.problem = check.error
        return check

    def _calibration_source(self, served: ServeConfig | None) -> CalibrationSource:
        """The form's ``CalibrationSource``, confined to what the server serves when ``served``."""
        form = self.calibration
        if served is not None and form.kind == "local path" and form.path.strip():
            return replace(form, path=str(roots.data_path(form.path, served))).source()
        if served is not None and form.kind == "hub id" and form.hub_id.strip():
            roots.hub_id(form.hub_id, served, "hub dataset id")
        return form.source()

    def _checked(self, key: tuple, source: CalibrationSource, compute: Callable[[], Any]) -> Any:
        """``compute()``, or what it gave (or raised) before for ``key``."""
        if key not in self.calibration_checks:
            if len(self.calibration_checks) >= CHECKS_KEPT:
                self.calibration_checks.pop(next(iter(self.calibration_checks)))
            try:
                self.calibration_checks[key] = compute()
            except (ValueError, OSError) as err:
                if source.kind == "hub":  # the network may come back
                    raise
                self.calibration_checks[key] = err
        found = self.calibration_checks[key]
        if isinstance(found, Exception):
            raise found
        return found

    def calibration_line(self, analysis: Analysis) -> str | None:
        """One line on the set an analysis was calibrated on (``lab.results.calibration``; an upload
        by the name the person's file had); None when nothing was calibrated."""
        text = calibration_text(analysis.calibration, {self.calibration.upload: self.calibration.upload_name})
        return None if text is None else f"Calibrated on {text}."

    @staticmethod
    def calibration_shortfall(analysis: Analysis) -> str | None:
        """The shortfall line of an analysis calibrated on fewer samples than asked (the first of
        its warnings), else None."""
        found = analysis.calibration
        if not found or found.get("samples", 0) >= found.get("asked", 0) or not analysis.warnings:
            return None
        return analysis.warnings[0]

    # ------------------------------------------------------------ choices

    def choices(self) -> tuple[Choices, list[str]]:
        """The best observer per tensor by ``metric`` with this session's overrides on top, and a
        note per override that no longer applies (an observer that gave no qparams there)."""
        from lab.results import choose

        if self.analysis is None:
            return {}, []
        overrides, notes = valid_choices(self.analysis, self.overrides)
        return {**choose(self.analysis, self.metric), **overrides}, notes

    # ------------------------------------------------------------ model-level effect

    def effect_for(self, analysis: Analysis) -> EffectState:
        """The Model effect state of ``analysis``: results of an earlier analysis are dropped (they
        describe other choices), the held-out settings are kept."""
        if self.effect.analysis is not analysis:
            self.effect = EffectState(analysis, self.effect.samples, self.effect.seq_len)
        return self.effect

    def effect_evaluator(self, model: Any, slot: AbstractContextManager[Any] | None = None) -> Any:
        """The ``lab.effect.evaluate.Evaluator`` of ``model`` on the state's held-out settings, built once
        per model and settings (its float run is what every later evaluation compares with); it is
        built inside ``slot`` (the server's heavy-run slot, in the app)."""
        from lab.effect.evaluate import Evaluator

        state = self.effect
        key = (self.last_request, state.samples, state.seq_len)
        if state.evaluator is None or state.evaluator_key != key:
            state.evaluator, state.evaluator_key = None, None
            with slot or nullcontext():
                state.evaluator = Evaluator(model, samples=state.samples, seq_len=state.seq_len)
            state.evaluator_key = key
            state.sensitivity, state.evaluations = None, []
        return state.evaluator


def _same_entry(analysis: Analysis | None, entry: TensorAnalysis) -> TensorAnalysis | None:
    """``entry``'s tensor in ``analysis`` (None when there is none)."""
    key = (entry.layer, entry.tensor)
    return next((e for e in analysis.entries if (e.layer, e.tensor) == key), None) if analysis else None
