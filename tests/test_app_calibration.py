"""The app's calibration sets (issue 24): built-in, pasted, an uploaded file, a local path or a hub
id on the Model page, with a preview (records, columns, first records) and the tokens the run will
take; one error line for a source that cannot be used, and the Run page refusing it; after a run,
the set in one line and the shortfall once. Driven headless with AppTest; offline."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import datasets
import huggingface_hub
import pytest
from streamlit.testing.v1 import AppTest

from lab import ui, workspace
from lab.analyse.analysis import Analysis
from lab.serve import config as serve_config
from lab.serve import uploads
from lab.settings import CalibrationForm, RunSettings
from lab.workspace import Workspace
from sample_models.calibration_sets import CalibrationSourceError

APP = str(Path(__file__).resolve().parents[1] / "app.py")
TIMEOUT = 300
LAYERS = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]  # one fused unit
RECORDS = [
    "the first calibration record, about rivers and the sea",
    "",
    "a second record: def f(x): return x * 2",
    "a third record with numbers 1, 2, 3 and 4",
    "the fourth record is a little longer than the others " * 4,
    "a fifth one",
    "and the sixth record closes the file",
]
USABLE = [text for text in RECORDS if text.strip()]
SAMPLES, SEQ_LEN = 4, 32


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, a private datasets cache and a private folder of uploads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(serve_config, "UPLOADS_ROOT", tmp_path / "uploads")


@pytest.fixture
def records(tmp_path) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(RECORDS)))
    return path


def _ws(at: AppTest) -> Workspace:
    return at.session_state[ui.WORKSPACE]


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"pages/{name}.py").run()


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def _no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def _ok(at: AppTest) -> None:
    _no_exception(at)
    assert not at.error, [e.value for e in at.error]


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def _model_page(samples: int = SAMPLES) -> AppTest:
    """The Model page on MiniLM with two layers, weights and inputs, a small calibration set."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    _page(at, "model")
    at.multiselect(key="w:layers").set_value(LAYERS)
    at.number_input(key="w:samples").set_value(samples)
    at.number_input(key="w:seq_len").set_value(SEQ_LEN).run()
    _ok(at)
    return at


def _local_path(at: AppTest, path: Path | str, column: str | None = None) -> AppTest:
    at.radio(key="w:calib_kind").set_value("local path").run()
    if column is not None:
        at.text_input(key="w:calib_column").input(column)
    return at.text_input(key="w:calib_path").input(str(path)).run()


def _tokens(texts: list[str]) -> int:
    tokenizer = ui.open_shared_model("minilm", "auto", "fp32").tokenizer()
    return sum(len(tokenizer(text, truncation=True, max_length=SEQ_LEN)["input_ids"]) for text in texts)


def _run(at: AppTest) -> AppTest:
    _page(at, "run")
    at.multiselect(key="w:observers").set_value(["minmax", "mse_grid"]).run()
    _button(at, "Run").click().run()
    _ok(at)
    return at


# ---------------------------------------------------------------- the Model page


def test_local_jsonl_shows_its_preview_and_the_tokens_the_run_takes(records):
    at = _local_path(_model_page(), records)
    _ok(at)
    assert _metric(at, "Usable records") == str(len(USABLE))
    assert _metric(at, "Rows") == str(len(RECORDS))
    assert _metric(at, "Samples used") == str(SAMPLES)
    assert _metric(at, "Tokens") == f"{_tokens(USABLE[:SAMPLES]):,}"
    assert any("reading `text`, in file order" in c.value for c in at.caption)
    labels = [e.label for e in at.expander]
    assert [label for label in labels if label.startswith("Record ")][:1] == [f"Record 1: {USABLE[0]}"]
    assert any(t.value == USABLE[1] for t in at.text)
    assert not at.warning  # 6 usable records, 4 asked
    run = _ws(at).settings
    assert run.dataset is not None and run.dataset.location == str(records) and run.texts is None


def test_the_preview_is_computed_once_per_source(records, monkeypatch):
    at = _local_path(_model_page(), records)
    calls = []
    monkeypatch.setattr(workspace, "preview", lambda *a, **k: calls.append(a) or {})
    at.number_input(key="w:batch_size").set_value(2).run()
    _ok(at)
    assert calls == [] and _ws(at).settings.batch_size == 2


def test_shuffle_seed_changes_the_order_and_a_bad_seed_is_one_error(records):
    at = _local_path(_model_page(), records)
    at.text_input(key="w:calib_seed").input("7").run()
    _ok(at)
    assert any("shuffled (seed 7)" in c.value for c in at.caption)
    assert _ws(at).settings.dataset.shuffle_seed == 7
    at.text_input(key="w:calib_seed").input("seven").run()
    _no_exception(at)
    assert [e.value for e in at.error] == [
        "Calibration set: the shuffle seed must be a whole number (0 or more) or empty, got 'seven'"
    ]
    assert _ws(at).settings.dataset is None


def test_a_missing_path_is_one_error_and_the_run_is_refused(tmp_path):
    missing = tmp_path / "nope.jsonl"
    at = _local_path(_model_page(), missing)
    _no_exception(at)
    assert len(at.error) == 1 and str(missing) in at.error[0].value and "does not exist" in at.error[0].value
    assert _ws(at).settings.dataset is None
    _page(at, "run")
    _no_exception(at)
    assert _button(at, "Run").disabled
    assert any("calibration set on the Model page cannot be used" in c.value for c in at.caption)
    _page(at, "model")
    at.radio(key="w:calib_kind").set_value("built-in").run()
    _ok(at)
    _page(at, "run")
    assert not _button(at, "Run").disabled


def test_an_empty_path_asks_for_one_without_an_error():
    at = _model_page()
    at.radio(key="w:calib_kind").set_value("local path").run()
    _ok(at)
    assert any("Enter the path of a calibration file" in i.value for i in at.info)


def test_a_column_that_is_not_there_names_the_columns(records):
    at = _local_path(_model_page(), records, column="body")
    _no_exception(at)
    assert len(at.error) == 1
    assert "column 'body' is not in" in at.error[0].value and "its columns are: text, id" in at.error[0].value


def test_a_chat_messages_column_is_read_when_the_text_column_is_absent(tmp_path):
    path = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    at = _local_path(_model_page(), path)
    _no_exception(at)
    assert any("reading the chat column `messages`" in c.value for c in at.caption)
    # MiniLM's tokenizer has no chat template: the token count says so in one line
    assert len(at.error) == 1 and "no chat template" in at.error[0].value


def test_hub_dataset_on_an_offline_server_is_one_error(monkeypatch):
    """``scripts/app.sh`` starts the server offline: a hub dataset id typed in a browser is refused
    before ``datasets`` looks anything up, and the page says why on the field itself."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    at = _model_page()
    at.radio(key="w:calib_kind").set_value("hub id").run()
    assert any("runs offline" in c.value for c in at.caption)
    at.text_input(key="w:calib_hub").input("nobody/no-such-dataset").run()
    _no_exception(at)
    assert len(at.error) == 1 and "runs offline (HF_HUB_OFFLINE=1)" in at.error[0].value


def test_more_samples_than_records_warns_on_the_model_page(records):
    at = _local_path(_model_page(samples=10), records)
    _ok(at)
    assert _metric(at, "Samples used") == str(len(USABLE))
    assert [w.value for w in at.warning] == [
        f"The calibration set has {len(USABLE)} usable samples; 10 were asked: calibrating on {len(USABLE)}."
    ]


# ---------------------------------------------------------------- uploads


def test_an_uploaded_file_is_saved_under_a_fixed_name_and_previewed(records):
    at = _model_page()
    at.radio(key="w:calib_kind").set_value("uploaded file").run()
    assert any("Upload a calibration file" in i.value for i in at.info)
    at.file_uploader(key="calib_upload").set_value(("../../evil name.jsonl", records.read_bytes(), "application/json"))
    at.run()
    _ok(at)
    ws = _ws(at)
    saved = Path(ws.calibration.upload)
    assert saved == ws.upload_dir / "calibration.jsonl" and saved.read_bytes() == records.read_bytes()
    assert ws.upload_dir.parent == serve_config.UPLOADS_ROOT and ws.calibration.upload_name == "evil name.jsonl"
    assert _metric(at, "Usable records") == str(len(USABLE))
    assert ws.settings.dataset.location == str(saved)
    at.file_uploader(key="calib_upload").set_value(None).run()  # removed with its x
    _no_exception(at)
    assert ws.calibration.upload == "" and ws.settings.dataset is None


def test_save_calibration_upload_keeps_one_file_per_session(tmp_path):
    ws = Workspace()
    first = ws.save_calibration_upload("a/b/records.JSONL", b'{"text": "one"}\n')
    assert first.name == "calibration.jsonl" and first.parent.parent == serve_config.UPLOADS_ROOT
    stamp = first.stat().st_mtime_ns
    time.sleep(0.01)
    assert ws.save_calibration_upload("records.jsonl", b'{"text": "one"}\n') == first
    assert first.stat().st_mtime_ns == stamp  # the same bytes are not written again: the caches hold
    second = ws.save_calibration_upload("table.csv", b"text\nhello\n")
    assert sorted(p.name for p in second.parent.iterdir()) == ["calibration.csv"]
    for name, data, why in (("x.exe", b"1", "is not a calibration file"), ("x.txt", b"", "is empty")):
        with pytest.raises(CalibrationSourceError, match=why):
            ws.save_calibration_upload(name, data)
        assert ws.calibration.upload == ""
    folder = ws.upload_dir
    del ws
    gc.collect()
    assert not folder.exists()  # dropped with the session


def test_old_session_folders_are_removed(tmp_path):
    stale = serve_config.UPLOADS_ROOT / "session-old"
    fresh = serve_config.UPLOADS_ROOT / "session-fresh"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
        (folder / "calibration.txt").write_text("x")
    old = time.time() - uploads.STALE_UPLOAD_SECONDS - 60
    os.utime(stale, (old, old))
    ws = Workspace()
    ws.save_calibration_upload("notes.txt", b"hello\n")
    assert not stale.exists() and fresh.exists() and ws.upload_dir.exists()


# ---------------------------------------------------------------- settings and the line after a run


def test_calibration_form_and_run_settings():
    assert not CalibrationForm().reads_dataset and not CalibrationForm(kind="pasted").reads_dataset
    assert CalibrationForm(kind="hub id").reads_dataset
    with pytest.raises(CalibrationSourceError, match="enter a hub dataset id"):
        CalibrationForm(kind="hub id", hub_id="  ").source()
    source = CalibrationForm(
        kind="hub id", hub_id="org/set", split="validation", text_column="", shuffle_seed="3"
    ).source()
    assert (source.location, source.split, source.text_column, source.shuffle_seed) == (
        "org/set",
        "validation",
        "text",
        3,
    )
    weights_only = RunSettings(wants={"weight": True, "input": False, "output": False, "kv": False})
    assert not weights_only.calibrates() and RunSettings().calibrates()
    assert RunSettings(wants=weights_only.wants, transform="smoothquant").calibrates()
    assert not RunSettings(wants={**weights_only.wants, "kv": True}).calibrates(has_attention=False)


def test_calibration_line_says_where_the_set_came_from(tmp_path):
    ws = Workspace()
    ws.calibration.upload, ws.calibration.upload_name = "/tmp/x/calibration.csv", "mine.csv"

    def line(source: dict, samples: int = 512, asked: int = 512, tokens: int = 0) -> tuple[str | None, str | None]:
        found = {"source": source, "fingerprint": "1a2b3c4d5e6f7a8b", "samples": samples, "asked": asked}
        analysis = Analysis(None, None, [], warnings=["short"] if samples < asked else [], calibration=found)
        analysis.calibration["tokens"] = tokens
        return ws.calibration_line(analysis), ws.calibration_shortfall(analysis)

    file = {"kind": "jsonl", "location": "/data/records.jsonl", "shuffle_seed": None}
    assert line(file, tokens=65536) == (
        "Calibrated on 512 samples, 65,536 tokens from records.jsonl (fingerprint 1a2b3c4d…).",
        None,
    )
    assert line({"kind": "builtin"}, 1, 4)[0].startswith("Calibrated on 1 sample, 0 tokens from the built-in texts")
    assert line({"kind": "builtin"}, 1, 4)[1] == "short"
    assert "from the pasted text" in line({"kind": "pasted"})[0]
    assert "from the uploaded mine.csv" in line({"kind": "csv", "location": "/tmp/x/calibration.csv"})[0]
    hub = line({"kind": "hub", "location": "org/set", "split": "train", "shuffle_seed": 42})[0]
    assert "from hub dataset org/set (split train), shuffled with seed 42 (" in hub
    assert ws.calibration_line(Analysis(None, None, [])) is None


def test_a_run_on_a_local_jsonl_records_the_set_and_says_it(records):
    at = _run(_local_path(_model_page(), records))
    analysis = _ws(at).analysis
    found = analysis.calibration
    assert found["source"]["location"] == str(records) and found["samples"] == SAMPLES == found["asked"]
    assert found["tokens"] == _tokens(USABLE[:SAMPLES])
    expected = f"Calibrated on {SAMPLES} samples, {found['tokens']:,} tokens from records.jsonl"
    assert any(c.value.startswith(expected) for c in at.caption)
    assert not at.warning
    _page(at, "overview")
    _ok(at)
    assert any(expected in c.value for c in at.caption)


def test_a_short_set_warns_once_after_a_run_through_a_transform(records):
    at = _local_path(_model_page(samples=10), records)
    _page(at, "run")
    at.selectbox(key="w:transform").set_value("hadamard").run()
    _run(at)
    found = _ws(at).analysis.calibration
    assert (found["samples"], found["asked"]) == (len(USABLE), 10)
    short = [w.value for w in at.warning if "usable samples" in w.value]
    assert short == [
        f"The calibration set has {len(USABLE)} usable samples; 10 were asked: calibrating on {len(USABLE)}."
    ]


def test_ranges_and_error_pages_say_when_metrics_saw_a_sample(records):
    at = _run(_model_page())
    analysis = _ws(at).analysis
    entry = analysis.entry(LAYERS[0], "input")
    assert entry.metrics_note is None
    entry.metrics_tokens = entry.num_tokens // 2
    for page in ("ranges", "error"):
        _page(at, page)
        at.selectbox(key="w:tensor").set_value((LAYERS[0], "input")).run()
        _ok(at)
        notes = [c.value for c in at.caption if "seeded sample" in c.value]
        assert notes == [
            f"Metrics on {entry.num_tokens // 2:,} of {entry.num_tokens:,} tokens: the histogram and error metrics "
            "are computed on a seeded sample; the qparams saw every token."
        ]
