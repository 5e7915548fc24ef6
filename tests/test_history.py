"""The team's run history (``lab.history``): a kept run opens as it was (every figure and qparam,
nothing recomputed), in a number of bytes a tensor that the calibration tokens do not change and
without copying a sample, the index keeps every run two writers add at once (threads and
processes), a person deletes only their own runs, the history prunes the oldest past its size and
its bytes and refuses a run larger than them all, and the CLI's runs join it (``python -m observers
history add``). Also who asked, in the files: the lab JSON's ``provenance`` and the checkpoint's
notes."""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.profiler import ProfilerActivity, profile

import observers as ob
from lab import provenance
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.kept_values import HISTOGRAM_BINS, KEPT_VALUES
from lab.analyse.result_cache import ResultCache
from lab.cli import main
from lab.export import compressed_tensors, lab_json, recipe
from lab.history import compare, run_file
from lab.history.index import RunIndex, RunRecord
from lab.history.run_file import KeptRun, RunFileError
from lab.history.store import HISTORY_DIR, LAB_FILE, History, HistoryError, parse_history_bytes
from lab.results import choose, report
from lab.serve import roots
from lab.serve.access import local_path, sign_in_page
from lab.serve.config import Auth, ServeConfig
from lab.serve.session_runs import SessionRun, kept
from lab.settings import RunSettings, SpecSettings
from observers.suite import SuiteResult
from sample_models import open_model

LAYERS = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")] + [
    "encoder.layer.0.attention.output.dense"
]


def _computed(weight: SpecSettings, **settings) -> object:
    model = open_model("minilm")
    run = RunSettings(
        weight=weight, act=SpecSettings(dtype="int8", strategy="tensor"), samples=4, seq_len=32, **settings
    )
    config = run.config(has_layers=True, has_attention=False)
    return SessionRun(model, LAYERS, config, [], ResultCache(), {}).compute()


@pytest.fixture(scope="module")
def nvfp4():
    """q, k, v share their global scales (fused), GPTQ ran, the tools' defaults ran, and the run
    went through a Hadamard rotation too: every part of an analysis a kept run must hold."""
    return _computed(SpecSettings(dtype="nvfp4"), gptq=ob.GPTQSpec(), tools=("llm-compressor",), transform="hadamard")


@pytest.fixture(scope="module")
def int8():
    """Another format and a few observers (the histogram searches take seconds per channel)."""
    return _computed(SpecSettings(dtype="int8", strategy="channel"), observers=("minmax", "mse_grid", "percentile"))


def _weight_of(layer: str) -> torch.Tensor:
    return open_model("minilm").weight(layer)


def same_result(mine: SuiteResult, theirs: SuiteResult) -> None:
    """The same observer result: name, error, tokens, time, every metric (NaN where NaN), every
    qparam tensor (dtype and values) and every knob (tensors by value)."""
    assert (mine.name, mine.error, mine.num_observed_tokens, mine.seconds) == (
        theirs.name,
        theirs.error,
        theirs.num_observed_tokens,
        theirs.seconds,
    )
    assert mine.metrics.keys() == theirs.metrics.keys()
    for name, value in mine.metrics.items():
        other = theirs.metrics[name]
        assert value == other or (value is not None and other is not None and math.isnan(value) and math.isnan(other))
    assert mine.knobs.keys() == theirs.knobs.keys()
    for name, value in mine.knobs.items():
        assert (
            torch.equal(value, theirs.knobs[name]) if isinstance(value, torch.Tensor) else value == theirs.knobs[name]
        )
    assert (mine.qparams is None) == (theirs.qparams is None)
    if mine.qparams is not None:
        a, b = mine.qparams, theirs.qparams
        assert a.kind == b.kind and a.extras.keys() == b.extras.keys()
        for name in ("scale", "zero_point", "min_val", "max_val", "global_scale"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
        assert all(torch.equal(a.extras[name], b.extras[name]) for name in a.extras)


def assert_same_analysis(kept: Analysis, original: Analysis) -> None:
    """Every figure a page shows is the same: facts, config, calibration, warnings and per tensor
    its data, spec, results (qparams, metrics, knobs), each layer's own, GPTQ rows and Hessian,
    the tools' defaults and how a server fuses it."""
    assert kept.facts == original.facts
    assert kept.config.to_dict() == original.config.to_dict()
    assert (kept.seconds, kept.warnings, kept.calibration) == (
        original.seconds,
        original.warnings,
        original.calibration,
    )
    assert kept.keys() == original.keys()
    for mine, theirs in zip(kept.entries, original.entries, strict=True):
        assert_same_entry(mine, theirs)


def assert_same_entry(mine: TensorAnalysis, theirs: TensorAnalysis) -> None:
    assert (mine.spec, mine.total_shape, mine.rank, mine.metrics_tokens) == (
        theirs.spec,
        theirs.total_shape,
        theirs.rank,
        theirs.metrics_tokens,
    )
    assert torch.equal(mine.data, theirs.data)
    assert mine.served == theirs.served and mine.gptq == theirs.gptq
    for a, b in ((mine.hessian, theirs.hessian), (mine.g_idx, theirs.g_idx)):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in [*zip(mine.results, theirs.results, strict=True), *zip(mine.per_layer, theirs.per_layer, strict=True)]:
        same_result(a, b)
    for a, b in zip(mine.tool_results, theirs.tool_results, strict=True):
        assert a.tool == b.tool and a.profile == b.profile
        same_result(a.result, b.result)


def test_a_kept_run_opens_as_it_was_computed(nvfp4, tmp_path):
    history = History(tmp_path / HISTORY_DIR, 10)
    run = KeptRun(nvfp4.analysis, nvfp4.transformed, None, {"source": "minilm", "device": "cpu", "dtype": "fp32"})
    record = history.record(run, "alice@example.com")
    opened = History(tmp_path / HISTORY_DIR, 10).open(record.id, _weight_of)  # as after a restart
    assert_same_analysis(opened.analysis, nvfp4.analysis)
    assert_same_analysis(opened.transformed, nvfp4.transformed)
    assert opened.unpropagated is None and opened.request == run.request
    weights = [e for part in (opened.analysis, opened.transformed) for e in part.entries if e.tensor == "weight"]
    assert weights and all(callable(e.source) for e in weights)  # read from the model (rotated by the seed), not kept
    assert all(not callable(e.source) for e in opened.transformed.entries if e.tensor == "input")
    served = [e for e in opened.analysis.entries if e.served is not None]
    assert {e.layer for e in served} >= set(LAYERS[:3])
    assert any(e.gptq for e in opened.analysis.entries) and any(e.tool_results for e in opened.analysis.entries)
    assert record.gptq and record.who == "alice@example.com" and record.layers == LAYERS
    assert record.formats == "weight: nvfp4 sym group 16; input: int8 sym tensor"
    assert record.calibration.startswith("4 samples, ") and record.tensors == len(nvfp4.analysis.entries)
    assert record.size == sum(p.stat().st_size for p in (history.root / record.id).iterdir())


def test_a_kept_run_stores_each_sample_once(nvfp4, tmp_path):
    """q, k and v read one input: the run file keeps its sample once (a kept run is mostly samples)."""
    run_file.save(KeptRun(nvfp4.analysis), tmp_path / "run")
    document = json.loads((tmp_path / "run" / run_file.DOCUMENT).read_text())
    inputs = [e["sample"] for e in document["analysis"]["entries"] if e["tensor"] == "input"]
    assert len(inputs) == 4 and len(set(inputs[:3])) == 1 and inputs[3] != inputs[0]


def _with_samples(analysis: Analysis, tokens: int) -> Analysis:
    """``analysis`` as if it had kept ``tokens`` seeded tokens of each input (the layers reading
    one input share one sample, as q, k and v do)."""
    samples: dict[bytes, torch.Tensor] = {}

    def sampled(entry: TensorAnalysis) -> TensorAnalysis:
        if entry.tensor != "input":
            return entry
        width, read = entry.data.shape[1], entry.data.numpy().tobytes()
        if read not in samples:
            generator = torch.Generator().manual_seed(len(samples))
            samples[read] = torch.randn(tokens, width, generator=generator) * (1 + torch.arange(width))
        return replace(entry, source=samples[read], total_shape=(tokens, width), metrics_tokens=tokens)

    return replace(analysis, entries=[sampled(entry) for entry in analysis.entries])


def test_a_kept_run_takes_the_same_bytes_whatever_the_calibration_tokens(int8, tmp_path):
    """Of each input a run keeps what the pages draw (its histogram, each channel's extremes, at most
    ``KEPT_VALUES`` values of tokens), so 8 times the tokens take the very same bytes, and a
    reopened run draws the histogram and channel ranges of every token (issue 54)."""
    sizes = []
    for tokens in (2_000, 16_000):
        run = KeptRun(_with_samples(int8.analysis, tokens))
        run_file.save(run, tmp_path / str(tokens))
        sizes.append((tmp_path / str(tokens) / run_file.TENSORS).stat().st_size)
        opened = run_file.load(tmp_path / str(tokens), _weight_of).analysis
        for mine, theirs in zip(opened.entries, run.analysis.entries, strict=True):
            for a, b in zip(mine.results, theirs.results, strict=True):
                same_result(a, b)  # the metrics on the whole sample, as computed
            if mine.tensor != "input":
                assert mine.kept_values is None and callable(mine.source)
                continue
            assert mine.data.numel() <= KEPT_VALUES and mine.data.shape[1] == theirs.data.shape[1]
            assert float(mine.kept_values.histogram.counts.sum()) == theirs.data.numel()
            assert (mine.kept_values.histogram.lo, mine.kept_values.histogram.hi) == (
                float(theirs.data.min()),
                float(theirs.data.max()),
            )
            assert torch.equal(mine.extremes, theirs.extremes) and mine.shape == theirs.shape
            assert mine.kept_note == f"{mine.data.shape[0]:,} of the {tokens:,} tokens the metrics saw"
    assert sizes[0] == sizes[1]
    document = json.loads((tmp_path / "16000" / run_file.DOCUMENT).read_text())
    with safe_open(str(tmp_path / "16000" / run_file.TENSORS), "pt") as stored:
        for entry in document["analysis"]["entries"]:
            if entry["tensor"] == "input":
                width = entry["total_shape"][1]
                keys = [entry["sample"], entry["values"]["histogram"], entry["values"]["extremes"]]
                held = sum(stored.get_tensor(key).nbytes for key in keys)
                assert held <= 4 * KEPT_VALUES + 8 * HISTOGRAM_BINS + 2 * 4 * width


def test_a_kept_run_holds_attention_states_the_same_bounded_way(int8, tmp_path):
    """Keys and values ``(batch, heads, seq, head_dim)``: whole sequence positions of every head are
    kept, each head's and channel's extremes are of every position."""
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(1, 12, 3_000, 32, generator=generator)
    states[0, 5, 17, 9] = 90.0
    spec = ob.QuantSpec("int8")
    results = ob.run_suite(states, spec, names=["minmax"], kind="attention")
    block = "encoder.layer.0.attention.self"
    entry = TensorAnalysis(block, "k", spec, states, results, total_shape=tuple(states.shape), rank=None)
    entry.metrics_tokens = 3_000
    run_file.save(KeptRun(replace(int8.analysis, entries=[entry])), tmp_path / "run")
    (kept,) = run_file.load(tmp_path / "run", _weight_of).analysis.entries
    assert kept.data.shape == (1, 12, KEPT_VALUES // 384, 32)
    assert torch.equal(kept.extremes, entry.extremes) and kept.extremes.shape == (2, 12, 1, 32)
    assert float(kept.kept_values.histogram.counts.sum()) == states.numel() and kept.kept_values.histogram.hi == 90.0
    assert kept.kept_note == f"{KEPT_VALUES // 384:,} of the 3,000 tokens the metrics saw"
    assert kept.num_tokens == entry.num_tokens == 3_000


def test_keeping_a_run_copies_no_sample(int8, tmp_path):
    """The CLI's calibration peak grew with the samples once ``run --out`` kept its run, which
    copied every sample whole (issue 54): keeping one allocates nothing near a sample's size."""
    run = KeptRun(_with_samples(int8.analysis, 32_000))
    sample = 32_000 * 384 * 4
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as allocations:
        run_file.save(run, tmp_path / "run")
    largest = max(event.cpu_memory_usage for event in allocations.events())
    assert 0 < largest <= sample / 4


def test_a_smoothquant_runs_weights_are_read_again_through_its_kept_scales(tmp_path):
    computed = _computed(SpecSettings(dtype="int8", strategy="channel"), observers=("minmax",), transform="smoothquant")
    run_file.save(KeptRun(computed.analysis, computed.transformed), tmp_path / "run")
    opened = run_file.load(tmp_path / "run", _weight_of)
    assert_same_analysis(opened.transformed, computed.transformed)  # the weights included, bit for bit
    weights = [e for e in opened.transformed.entries if e.tensor == "weight"]
    assert weights and all(callable(e.source) and e.smoothing is not None for e in weights)
    assert not torch.equal(weights[0].data, _weight_of(weights[0].layer))  # scaled, not the model's own


def test_a_version_1_run_reads_as_it_did(int8, tmp_path):
    """Version 1 kept whole samples (no histogram, no extremes): such a run opens with them."""
    run_file.save(KeptRun(int8.analysis), tmp_path / "run")
    path = tmp_path / "run" / run_file.DOCUMENT
    document = json.loads(path.read_text())
    for entry in document["analysis"]["entries"]:
        del entry["values"], entry["smoothing"]
    path.write_text(json.dumps(document | {"version": 1}))
    opened = run_file.load(tmp_path / "run", _weight_of).analysis
    assert_same_analysis(opened, int8.analysis)
    assert all(entry.kept_values is None for entry in opened.entries)


def test_a_kept_run_writes_each_hessian_to_a_file_of_its_own_read_when_asked(nvfp4, tmp_path):
    # a 7B model's Hessians are 28 GB: neither saving nor opening a run holds them all at once
    run_file.save(KeptRun(nvfp4.analysis), tmp_path / "run")
    files = sorted(p.name for p in (tmp_path / "run").glob("hessian-*.safetensors"))
    with_hessian = [e for e in nvfp4.analysis.entries if e.hessian_source is not None]
    distinct = {id(e.hessian_source) for e in with_hessian}
    assert files and len(files) == len(distinct) < len(with_hessian)  # q, k and v share one input: one file
    opened = run_file.load(tmp_path / "run", _weight_of).analysis
    kept = [e for e in opened.entries if e.hessian_source is not None]
    assert [e.layer for e in kept] == [e.layer for e in with_hessian]
    assert all(callable(e.hessian_source) for e in kept)  # read when a page or the checkpoint asks
    assert all(torch.equal(a.hessian, b.hessian) for a, b in zip(kept, with_hessian, strict=True))
    document = json.loads((tmp_path / "run" / run_file.DOCUMENT).read_text())
    document["analysis"]["entries"][0]["hessian"] = "../../etc/passwd"
    (tmp_path / "run" / run_file.DOCUMENT).write_text(json.dumps(document))
    with pytest.raises(RunFileError, match="not a Hessian file a run names"):
        run_file.load(tmp_path / "run", _weight_of)
    (tmp_path / "run" / files[0]).unlink()
    with pytest.raises(RunFileError, match="holds no Hessian"):
        kept[0].hessian_source()


def test_a_version_2_run_reads_its_hessians_from_its_tensors(nvfp4, tmp_path):
    """Version 2 kept each Hessian among the tensors, under the key its document named."""
    from safetensors.torch import load_file, save_file

    run_file.save(KeptRun(nvfp4.analysis), tmp_path / "run")
    folder = tmp_path / "run"
    document = json.loads((folder / run_file.DOCUMENT).read_text())
    tensors = load_file(str(folder / run_file.TENSORS))
    for entry in document["analysis"]["entries"]:
        if entry["hessian"] is not None:
            tensors[f"v2.{entry['hessian']}"] = load_file(str(folder / entry["hessian"]))["hessian"]
            entry["hessian"] = f"v2.{entry['hessian']}"
    for path in folder.glob("hessian-*.safetensors"):
        path.unlink()
    save_file(tensors, str(folder / run_file.TENSORS))
    (folder / run_file.DOCUMENT).write_text(json.dumps(document | {"version": 2}))
    opened = run_file.load(folder, _weight_of).analysis
    assert_same_analysis(opened, nvfp4.analysis)
    assert any(isinstance(e.hessian_source, torch.Tensor) for e in opened.entries)


def test_the_kept_lab_json_names_the_run_and_who_asked(int8, tmp_path):
    history = History(tmp_path, 10)
    record = history.record(KeptRun(int8.analysis, request={"source": "minilm"}), "bob@example.com")
    lab_file = lab_json.load(history.lab_file(record.id))
    assert lab_file.choices == choose(int8.analysis)
    assert lab_file.provenance["asked_by"] == "bob@example.com"
    assert lab_file.provenance["run"] == {"id": record.id, "who": "bob@example.com", "when": record.when}
    assert record.when.startswith(record.id[:4]) and record.provenance() == lab_file.provenance["run"]


def test_the_history_lists_newest_first_and_survives_a_restart(int8, tmp_path):
    first = History(tmp_path, 10)
    ids = [first.record(KeptRun(int8.analysis), who).id for who in ("alice", "bob", "carol")]
    again = History(tmp_path, 10)
    assert [r.id for r in again.runs()] == ids[::-1]
    assert [r.who for r in again.runs()] == ["carol", "bob", "alice"]
    assert again.get(ids[0]).request == {}


def test_a_person_deletes_only_their_own_runs(int8, tmp_path):
    history = History(tmp_path, 10)
    mine, theirs = (history.record(KeptRun(int8.analysis), who).id for who in ("alice", "bob"))
    with pytest.raises(HistoryError, match=f"run {theirs} was asked for by bob: only they may delete it"):
        history.delete(theirs, "alice")
    assert (tmp_path / theirs).is_dir()
    history.delete(mine, "alice")
    assert [r.id for r in history.runs()] == [theirs] and not (tmp_path / mine).exists()
    with pytest.raises(HistoryError, match="no kept run"):
        history.open(mine, _weight_of)


def test_the_history_prunes_the_oldest_past_its_size(int8, tmp_path):
    history = History(tmp_path, 2)
    ids = [history.record(KeptRun(int8.analysis), "alice").id for _ in range(4)]
    assert [r.id for r in history.runs()] == ids[:1:-1] and history.pruned == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(ids[2:])
    with pytest.raises(HistoryError, match="at least 1"):
        History(tmp_path, 0)


def test_the_history_prunes_the_oldest_past_its_bytes_and_says_so(int8, tmp_path):
    run = KeptRun(_with_samples(int8.analysis, 2_000))
    size = History(tmp_path / "probe", 10).record(run, "alice").size
    history = History(tmp_path / "runs", 10, int(2.5 * size))
    ids = [history.record(run, "alice").id for _ in range(4)]
    assert [r.id for r in history.runs()] == ids[:1:-1] and history.pruned == 2
    assert sum(r.size for r in history.runs()) <= history.max_bytes
    assert sorted(p.name for p in history.root.iterdir() if p.is_dir()) == sorted(ids[2:])
    bound = f"{int(2.5 * size) / 1e6:.3g} MB"
    assert history.bounds == f"the newest 10 runs within {bound}"
    assert history.pruned_note() == f"2 older run(s) were removed to keep the newest 10 runs within {bound}"
    assert History(tmp_path / "runs", 10).pruned_note() is None


def test_a_run_larger_than_the_whole_history_is_refused_and_the_others_stay(int8, tmp_path):
    """Keeping it would remove every other run for one: it is refused in one line, nothing of it is
    left on disk, and the server shows it with that note."""
    history = History(tmp_path, 10, 1_500_000)
    small = history.record(KeptRun(int8.analysis), "alice")
    large = KeptRun(_with_samples(int8.analysis, 2_000))
    words = (
        r"this run takes \d\.\d+ MB on disk, more than the whole history keeps \(--history-bytes 1\.5 MB\): it is not"
    )
    with pytest.raises(HistoryError, match=words):
        history.record(large, "bob")
    assert [r.id for r in history.runs()] == [small.id] and history.pruned == 0
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [small.id]
    shown = kept(replace(int8, analysis=large.analysis), lambda run: history.record(run, "bob"), {})
    assert shown.kept is None and shown.notes[-1].startswith("This run was not kept in the team's history: this run")


@pytest.mark.parametrize(
    "text, words",
    [
        ("5G", "--history-bytes: memory size '5G' must be a positive number with an optional unit"),
        ("-1GB", "--history-bytes: memory size '-1GB' must be a positive number"),
        ("0", "--history-bytes: memory size '0' must be a positive number"),
        ("1.5", "--history-bytes must be at least 1 MB, got 1 bytes"),
        ("20", "--history-bytes must be at least 1 MB, got 20 bytes \\(write a unit: 20GB\\)"),
    ],
)
def test_a_bad_history_bytes_is_one_line(text, words, tmp_path):
    with pytest.raises(HistoryError, match=words):
        parse_history_bytes(text)
    assert parse_history_bytes("20GB") == 20 * 10**9 and parse_history_bytes("1.5 GiB") == 3 * 2**29
    with pytest.raises(HistoryError, match="at least 1 MB"):
        History(tmp_path, 10, 999_999)


def _record(i: int, who: str) -> RunRecord:
    return RunRecord(
        f"run-{who}-{i}", float(i), who, "app", "minilm", {}, ["l"], "int8", ["minmax"], "none", False, 1.0, 1, 1
    )


def _add_many(path: str, who: str, count: int) -> None:
    index = RunIndex(Path(path))
    for i in range(count):
        index.add(_record(i, who))


def test_sessions_and_processes_writing_at_once_lose_nothing(int8, tmp_path):
    """Two server processes (and a CLI) index runs at once, each of many threads keeping whole
    runs: every run is listed afterwards, and the index is a real WAL database."""
    history = History(tmp_path, 1000)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_add_many, args=(str(history.index.path), f"p{n}", 40)) for n in range(2)]
    for worker in workers:
        worker.start()
    kept, errors = [], []

    def session(who: str) -> None:
        try:
            kept.extend(history.record(KeptRun(int8.analysis), who).id for _ in range(3))
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=session, args=(f"s{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads + workers:
        thread.join(timeout=300)
    assert not errors and all(worker.exitcode == 0 for worker in workers)
    listed = {r.id for r in history.runs()}
    assert len(kept) == 12 and set(kept) <= listed and len(listed) == 12 + 80
    assert all(history.open(run_id, _weight_of).analysis.keys() == int8.analysis.keys() for run_id in kept[:2])
    with sqlite3.connect(history.index.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_directory_that_is_not_a_run_is_refused_in_one_line(int8, tmp_path):
    for broken, words in [
        ({}, "is not a readable run"),
        ({run_file.DOCUMENT: "{", run_file.TENSORS: b""}, "is not a readable run"),
        ({run_file.DOCUMENT: json.dumps({"format": "other"})}, "is not a readable run"),
    ]:
        folder = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for name, data in broken.items():
            (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        with pytest.raises(RunFileError, match=words):
            run_file.load(folder, _weight_of)
    run_file.save(KeptRun(int8.analysis), tmp_path / "good")
    document = json.loads((tmp_path / "good" / run_file.DOCUMENT).read_text())
    (tmp_path / "good" / run_file.DOCUMENT).write_text(json.dumps(document | {"version": 99}))
    with pytest.raises(RunFileError, match="not an Observer Lab run of version 1 or 2 or 3"):
        run_file.load(tmp_path / "good", _weight_of)
    (tmp_path / "good" / run_file.DOCUMENT).write_text(json.dumps(document | {"analysis": {"facts": {}}}))
    with pytest.raises(RunFileError, match="holds a broken run: KeyError"):
        run_file.load(tmp_path / "good", _weight_of)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a person's file")
    with pytest.raises(RunFileError, match="is not a run this lab wrote: it is left alone"):
        run_file.save(KeptRun(int8.analysis), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a person's file"


def test_two_runs_compare_side_by_side(nvfp4, int8):
    key = ("encoder.layer.0.attention.self.query", "weight")
    first, second = nvfp4.analysis.entry(*key), int8.analysis.entry(*key)
    frame = compare.side_by_side(first, second)
    own = compare.figures(first).set_index("observer")
    assert list(frame["observer"][: len(own)]) == list(own.index)
    for observer in own.index:
        row = frame.set_index("observer").loc[observer]
        assert row["sqnr_db · A"] == own.loc[observer, "sqnr_db"]
        result = first.result(observer)
        assert row["scale max · A"] == pytest.approx(float(result.qparams.scale.float().max()))
        assert row["global scale · A"] == pytest.approx(float(result.qparams.global_scale.flatten()[0]))
    b = frame.set_index("observer")["sqnr_db · B"].dropna()
    assert dict(b) == {r.name: r.metrics["sqnr_db"] for r in second.results if r.qparams is not None}
    assert frame["global scale · B"].isna().all()  # int8 has none, NVFP4 has: the pair stays
    only_a = [name for name in own.index if name not in ("minmax", "mse_grid", "percentile")]
    assert only_a and frame.set_index("observer").loc[only_a, "sqnr_db · B"].isna().all()  # B did not run them
    same = compare.side_by_side(second, second)
    assert not any(column.startswith("global scale") for column in same.columns)
    bars = compare.bars(first, second)
    assert set(bars["layer"]) == {"A", "B"} and set(bars["tensor"]) == {f"{key[0]} weight"}
    assert compare.common_tensors(nvfp4.analysis, int8.analysis) == nvfp4.analysis.keys()
    a, b = _record(1, "alice"), replace(_record(2, "bob"), formats="nvfp4", calibration="other")
    assert compare.differences(a, b) == ["formats", "calibration set"] and compare.differences(a, a) == []


def test_who_asked_is_in_the_lab_json_and_every_other_export(int8):
    run = {"id": "20261127-070905-a1b2c3", "who": "alice@example.com", "when": "2026-11-27T07:09:05+00:00"}
    made = provenance.made_by("bob@example.com", run)
    choices = choose(int8.analysis)
    document = lab_json.build_document(int8.analysis, choices, provenance=made)
    assert document["provenance"] == made and not lab_json.schema_problems(document)
    assert lab_json.schema_problems(document | {"provenance": {"asked_by": ""}})
    parsed = lab_json.parse_document(json.loads(lab_json.dumps(document)))
    assert parsed.provenance == made
    lines = provenance.provenance_lines(parsed.provenance)
    assert lines == [
        f"asked for by bob@example.com at {made['asked_at']}",
        "from run 20261127-070905-a1b2c3, asked for by alice@example.com at 2026-11-27T07:09:05+00:00",
    ]
    notes = compressed_tensors.build(int8.analysis, choices, provenance=made).files()[compressed_tensors.NOTES_FILE]
    assert notes.decode().startswith("\n".join(lines) + "\n")
    text = recipe.build(int8.analysis, choices, provenance=made).to_yaml()
    assert all(f"# note: {line}\n" in text for line in lines) and "QuantizationModifier" in text
    page = report.render(int8.analysis, choices, provenance=made)
    assert "<p class='note'>Asked for by bob@example.com at " in page and "From run 20261127-070905-a1b2c3" in page
    assert provenance.provenance_lines(None) == [] and "provenance" not in lab_json.build_document(
        int8.analysis, choices
    )
    assert "asked for by" not in recipe.build(int8.analysis, choices).to_yaml()


def test_the_cli_keeps_its_runs_and_adds_them_to_a_servers_history(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", "minilm", "--layers", ",".join(LAYERS[:2]), "--format", "int8", "--out", "a.json", "--quiet"]
    argv += ["--samples", "4", "--seq-len", "32"]
    assert main(argv, out, err) == 0, err.getvalue()
    assert "wrote a.json, a.run" in out.getvalue()
    document = json.loads(Path("a.json").read_text())
    assert document["provenance"]["asked_by"].startswith("cli") and document["provenance"]["run"] is None
    out = io.StringIO()
    assert main(["history", "add", "a.json", "--output-root", "served"], out, err) == 0, err.getvalue()
    history = History(tmp_path / "served" / HISTORY_DIR, 10)
    (record,) = history.runs()
    assert f"kept run {record.id} (minilm, 2 layer(s))" in out.getvalue()
    assert record.origin == "cli" and record.who.startswith("cli") and record.layers == LAYERS[:2]
    assert record.request == {"source": "minilm", "device": "cpu", "dtype": "fp32"}
    assert (history.root / record.id / LAB_FILE).read_bytes() == Path("a.json").read_bytes()
    kept = history.open(record.id, _weight_of)
    assert [e.layer for e in kept.analysis.entries if e.tensor == "weight"] == LAYERS[:2]
    out = io.StringIO()
    assert main(["history", "list", "--output-root", "served"], out, err) == 0
    assert out.getvalue().startswith(f"{record.id}\t{record.when}\t{record.who}\tminilm\tweight: int8")
    err = io.StringIO()
    assert main(["history", "add", "missing.json", "--output-root", "served"], io.StringIO(), err) == 2
    assert err.getvalue().count("\n") == 1 and "has no run beside it (missing.run)" in err.getvalue()
    assert main(["history", "add", "a.json", "--output-root", "served", "--history-size", "0"], io.StringIO(), err) == 2
    err = io.StringIO()
    assert (
        main(["history", "add", "a.json", "--output-root", "served", "--history-bytes", "5G"], io.StringIO(), err) == 2
    )
    assert err.getvalue().count("\n") == 1 and "--history-bytes: memory size '5G'" in err.getvalue()


def test_the_cli_keeps_the_same_bytes_whatever_the_samples(tmp_path, monkeypatch):
    """``run --out`` keeps its run in the bounded form: three times the samples, the same bytes."""
    monkeypatch.chdir(tmp_path)
    for samples in (8, 24):
        argv = ["run", "minilm", "--layers", "encoder.layer.0.output.dense", "--kinds", "input", "--format", "int8"]
        argv += ["--observers", "minmax", "--samples", str(samples), "--seq-len", "64", "--out", f"s{samples}.json"]
        assert main([*argv, "--quiet"], io.StringIO(), err := io.StringIO()) == 0, err.getvalue()
    sizes = [(tmp_path / f"s{samples}.run" / run_file.TENSORS).stat().st_size for samples in (8, 24)]
    assert sizes[0] == sizes[1]
    (entry,) = run_file.load(tmp_path / "s24.run", _weight_of).analysis.entries
    assert entry.data.shape == (KEPT_VALUES // 1536, 1536) and entry.metrics_tokens > 3 * entry.data.shape[0]
    assert float(entry.kept_values.histogram.counts.sum()) == entry.metrics_tokens * 1536


def test_a_kept_runs_model_is_held_to_the_servers_roots(tmp_path):
    config = ServeConfig(data_roots=(tmp_path,), model_roots=(tmp_path,), output_root=tmp_path)
    assert roots.model_source("minilm", config) == "minilm"
    inside = tmp_path / "model"
    inside.mkdir()
    assert roots.model_source(str(inside), config) == str(inside.resolve())
    with pytest.raises(roots.OutsideRootsError, match="outside the model roots"):
        roots.model_source("/etc", config)


def test_the_sign_in_page_goes_on_to_the_run_a_link_named():
    page = sign_in_page(Auth.TOKEN, path="/runs", params=[("run", "20261127-070905-a1b2c3")])
    assert '<form method="get" action="/runs">' in page
    assert '<input type="hidden" name="run" value="20261127-070905-a1b2c3">' in page
    assert 'value="&quot;&gt;' in sign_in_page(Auth.TOKEN, params=[("run", '">')])  # escaped, not markup
    assert [local_path(p) for p in ("/", "/runs", "//evil.example/x", "/\\evil", "https://evil.example")] == [
        "/",
        "/runs",
        "/",
        "/",
        "/",
    ]


def test_a_run_that_cannot_be_kept_is_still_shown_with_a_note(int8):
    def full_disk(run: KeptRun) -> RunRecord:
        raise OSError(28, "No space left on device")

    shown = kept(int8, full_disk, {})
    assert shown.kept is None and shown.analysis is int8.analysis
    assert shown.notes[-1] == "This run was not kept in the team's history: [Errno 28] No space left on device"
