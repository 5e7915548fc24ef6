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

import hashlib
import shutil
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from lab.analyse.pipeline import Analysis, ResultCache, RunConfig, TensorAnalysis, analyse
from lab.calibrate.capture_memo import CapturingModel
from lab.results import Choices, valid_choices
from lab.settings import CalibrationForm, RunSettings, SpecSettings
from lab.vocab import DEFAULT_METRIC
from sample_models.calibration_sets import CalibrationSource, CalibrationSourceError, calibration_stamp, preview

DEMO_MODEL = "minilm"
DEMO_LAYERS = 6
"""The one-click demo: the default sample and how many of its layers (the default selection)."""
UPLOAD_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
UPLOAD_ROOT = Path(tempfile.gettempdir()) / "observer_lab_calibration"
STALE_UPLOAD_SECONDS = 24 * 3600
"""Session folders of calibration uploads untouched this long are removed when a session makes one."""
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
    """What one press of Run produced: the analysis, cache hits/misses of this run, warnings."""

    analysis: Analysis
    hits: int
    misses: int
    warnings: list[str] = field(default_factory=list)


@dataclass
class ImportState:
    """The last imported Observer Lab file: its digest (so a re-run does not import it again),
    what it restored and the notes on what it did not."""

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
    calibration set's fields; ``upload_dir``: this session's folder of uploaded calibration files,
    removed with the session; ``calibration_checks``: previews and token counts already computed).
    Run page: ``settings`` (what to analyse, specs, observers, knobs, calibration). Results: ``analysis``,
    ``last_run``, ``overrides`` (observer choices a person made or imported, on top of the best by
    ``metric``). Caches: ``result_cache`` (per tensor × spec × observer × knobs),
    ``capture_memo`` (the last capture), ``layer_output`` (layer-output error per analysis and
    observer set). ``view`` holds what the result pages show (picked tensor, observers), so a
    choice made on one page holds on the next.
    """

    request: ModelRequest | None = None
    last_request: ModelRequest | None = None
    form: ModelForm = field(default_factory=ModelForm)
    layers: list[str] = field(default_factory=list)
    attention: list[str] | None = None
    pasted_text: str = ""
    calibration: CalibrationForm = field(default_factory=CalibrationForm)
    upload_dir: Path | None = None
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
    ) -> RunOutcome:
        """``analyse`` ``self.layers`` with this session's result cache and capture memo; the
        outcome replaces the analysis, and choices made on the old one are dropped. Capture
        warnings (e.g. tokens subsampled to stay under the memory cap) are returned, not printed."""
        cache = self.result_cache
        hits, misses = cache.hits, cache.misses
        wrapped = CapturingModel(model, self.capture_memo)
        run = partial(analyse, wrapped, list(self.layers), progress=progress, cache=cache, attention=attention)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            analysis = run(replace(config, transform=None))
            transformed = None if config.transform is None else run(config)
            unpropagated = run(replace(config, transform=None, propagate=False)) if config.propagate else None
        notes = (
            list(analysis.warnings)
            + list(transformed.warnings if transformed else [])
            + sorted({str(w.message) for w in caught if issubclass(w.category, UserWarning)})
        )
        outcome = RunOutcome(analysis, cache.hits - hits, cache.misses - misses, list(dict.fromkeys(notes)))
        self.analysis = analysis
        self.transformed = transformed
        self.unpropagated = unpropagated
        self.last_run = outcome
        self.last_request = self.request
        self.overrides = {}
        self.imported = ImportState()
        self.report_html = None
        return outcome

    def transformed_entry(self, entry: TensorAnalysis) -> TensorAnalysis | None:
        """``entry`` as the run through the transform saw it (None without a transform)."""
        return _same_entry(self.transformed, entry)

    def unpropagated_entry(self, entry: TensorAnalysis) -> TensorAnalysis | None:
        """An activation ``entry`` as the float model's calibration saw it (None without propagation)."""
        return None if entry.tensor == "weight" else _same_entry(self.unpropagated, entry)

    # ------------------------------------------------------------ calibration set

    def save_calibration_upload(self, name: str, data: bytes) -> Path:
        """Store an uploaded calibration file in this session's folder as ``calibration<suffix>``
        (the uploaded name is never used as a path; only its suffix, one of ``UPLOAD_SUFFIXES``, is
        kept) and record it as the form's upload. The same bytes again are not written again (the
        file's time stamp keys the caches); other files of the folder are removed."""
        suffix = Path(name).suffix.lower()
        self.calibration.upload = self.calibration.upload_name = ""
        if suffix not in UPLOAD_SUFFIXES:
            raise CalibrationSourceError(f"{name!r} is not a calibration file: upload {', '.join(UPLOAD_SUFFIXES)}")
        if not data:
            raise CalibrationSourceError(f"{name!r} is empty")
        folder = self._upload_folder()
        target = folder / f"calibration{suffix}"
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.calibration.upload_digest or not target.is_file():
            for old in folder.iterdir():
                old.unlink(missing_ok=True)
            target.write_bytes(data)
        self.calibration.upload, self.calibration.upload_name = str(target), Path(name).name
        self.calibration.upload_digest = digest
        return target

    def _upload_folder(self) -> Path:
        """This session's upload folder, made on first use (private, removed when the workspace is
        dropped; folders of sessions gone for a day are removed on the way)."""
        if self.upload_dir is not None and self.upload_dir.is_dir():
            self.upload_dir.touch()
            return self.upload_dir
        UPLOAD_ROOT.mkdir(parents=True, exist_ok=True)
        for old in UPLOAD_ROOT.iterdir():
            try:
                if old.is_dir() and time.time() - old.stat().st_mtime > STALE_UPLOAD_SECONDS:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                continue
        self.upload_dir = Path(tempfile.mkdtemp(prefix="session-", dir=UPLOAD_ROOT))
        weakref.finalize(self, shutil.rmtree, str(self.upload_dir), True)
        return self.upload_dir

    def check_calibration(self, model: Any, samples: int, seq_len: int) -> CalibrationCheck:
        """The chosen calibration set as the Model page shows it: its preview (computed once per
        source and file state) and the samples and tokens ``model`` makes of it (once per source,
        model, samples and sequence length); a set that cannot be used has ``error`` (and the
        preview when only the tokenizing failed). Failures are remembered too, but a hub's."""
        form, shown, found = self.calibration, None, None
        try:
            source = form.source()
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
        """One line on the set an analysis was calibrated on: samples, tokens, where from (an upload
        by the name the person's file had) and the fingerprint; None when nothing was calibrated."""
        found = analysis.calibration
        if not found:
            return None
        source = found.get("source") or {}
        kind, location = source.get("kind"), str(source.get("location", ""))
        if kind == "builtin":
            where = "the built-in texts"
        elif kind == "pasted":
            where = "the pasted text"
        elif kind == "hub":
            where = f"hub dataset {location} (split {source.get('split')})"
        elif location and location == self.calibration.upload:
            where = f"the uploaded {self.calibration.upload_name}"
        else:
            where = Path(location).name or location
        if source.get("shuffle_seed") is not None:
            where += f", shuffled with seed {source['shuffle_seed']}"
        samples, tokens = found.get("samples", 0), found.get("tokens", 0)
        return (
            f"Calibrated on {samples:,} sample{'' if samples == 1 else 's'}, {tokens:,} tokens from {where} "
            f"(fingerprint {str(found.get('fingerprint', ''))[:8]}…)."
        )

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

    def effect_evaluator(self, model: Any) -> Any:
        """The ``lab.effect.evaluate.Evaluator`` of ``model`` on the state's held-out settings, built once
        per model and settings (its float run is what every later evaluation compares with)."""
        from lab.effect.evaluate import Evaluator

        state = self.effect
        key = (self.last_request, state.samples, state.seq_len)
        if state.evaluator is None or state.evaluator_key != key:
            state.evaluator, state.evaluator_key = None, None
            state.evaluator = Evaluator(model, samples=state.samples, seq_len=state.seq_len)
            state.evaluator_key = key
            state.sensitivity, state.evaluations = None, []
        return state.evaluator


class Timer:
    """Seconds since it was made (for progress lines)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _same_entry(analysis: Analysis | None, entry: TensorAnalysis) -> TensorAnalysis | None:
    """``entry``'s tensor in ``analysis`` (None when there is none)."""
    key = (entry.layer, entry.tensor)
    return next((e for e in analysis.entries if (e.layer, e.tensor) == key), None) if analysis else None
