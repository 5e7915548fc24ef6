"""Calibration sets read with the datasets library (sample_models.calibration_sets): every source
kind, the tokenization convention (llm-compressor's), counts, fingerprint, shuffling, preview and
every bad input as one clear line. Offline: no test touches the network."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sample_models import calibration_sets as cs
from sample_models import open_model
from sample_models.calibration import token_windows
from sample_models.calibration_sets import (
    CalibrationSamples,
    CalibrationSource,
    CalibrationSourceError,
    calibration_samples,
    calibration_stamp,
    preview,
    read_records,
)

SEQ_LEN = 12
CHAT_TEMPLATE = "[CLS]{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Two records are not usable (empty, whitespace); the long one is truncated at SEQ_LEN.
RECORDS = [
    "the quick brown fox",
    "",
    "jumps over the lazy dog " * 6,
    "   ",
    "calibration text number three",
    "a fourth record, with punctuation!",
]
USABLE = [text for text in RECORDS if text.strip()]
CHATS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}],
    [],
    [{"role": "user", "content": "  "}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue " * 5}],
]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network and a private datasets cache. datasets reads the offline flags when imported, so
    its config (and huggingface_hub's) is patched as well as the environment."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


@pytest.fixture(scope="module")
def tokenizer():
    return open_model("minilm").tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    """The MiniLM tokenizer (no chat template, like the built-in decoders that reuse it) with one."""
    assert not tokenizer.chat_template
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


def expected(tokenizer, texts: list[str], seq_len: int = SEQ_LEN) -> list[list[int]]:
    return [tokenizer(text, truncation=True, max_length=seq_len)["input_ids"] for text in texts]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_source(tmp_path: Path, kind: str, texts: list[str] = RECORDS, column: str = "text") -> Path:
    """The same records as each source kind."""
    rows = [{column: text, "id": i} for i, text in enumerate(texts)]
    if kind == "txt":
        path = tmp_path / "data.txt"
        path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    elif kind == "jsonl":
        path = write_jsonl(tmp_path / "data.jsonl", rows)
    elif kind == "json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif kind == "csv":
        path = tmp_path / "data.csv"
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "disk":
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    elif kind == "disk-dict":
        path = tmp_path / "saved-dict"
        half = len(rows) // 2
        parts = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:half])}
        datasets.DatasetDict(parts).save_to_disk(str(path))
    else:
        raise AssertionError(kind)
    return path


KINDS = {
    "txt": "text",
    "jsonl": "jsonl",
    "json": "json",
    "csv": "csv",
    "parquet": "parquet",
    "disk": "disk",
    "disk-dict": "disk",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_source_kind_gives_one_window_per_usable_record(tmp_path, tokenizer, kind):
    source = CalibrationSource(str(write_source(tmp_path, kind)))
    assert source.kind == KINDS[kind]
    found = calibration_samples(tokenizer, source, samples=3, seq_len=SEQ_LEN)
    assert found.windows == expected(tokenizer, USABLE[:3])
    assert found.records == len(USABLE) == 4
    assert found.asked == 3
    assert found.tokens == sum(len(w) for w in found.windows)
    assert found.shortfall is None
    assert found.source == source.to_dict()


def test_dataset_dict_directory_takes_the_split(tmp_path, tokenizer):
    path = write_source(tmp_path, "disk-dict")
    test = calibration_samples(tokenizer, CalibrationSource(str(path), split="test"), 10, SEQ_LEN)
    assert test.records == 2  # rows 0..2 of RECORDS: one empty
    assert test.windows == expected(tokenizer, [RECORDS[0], RECORDS[2]])


def test_records_are_truncated_at_seq_len_with_special_tokens(tmp_path, tokenizer):
    source = CalibrationSource(str(write_source(tmp_path, "jsonl")))
    found = calibration_samples(tokenizer, source, samples=2, seq_len=SEQ_LEN)
    long = found.windows[1]
    assert len(long) == SEQ_LEN < len(tokenizer(RECORDS[2])["input_ids"])
    assert long[0] == tokenizer.cls_token_id and long[-1] == tokenizer.sep_token_id
    wider = calibration_samples(tokenizer, source, samples=2, seq_len=64)
    assert wider.windows == expected(tokenizer, USABLE[:2], seq_len=64)
    assert len(wider.windows[1]) > SEQ_LEN


def test_chat_messages_use_the_template_without_special_tokens_again(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    found = calibration_samples(chat_tokenizer, CalibrationSource(str(path)), samples=5, seq_len=SEQ_LEN)
    usable = [CHATS[0], CHATS[3]]
    rendered = [chat_tokenizer.apply_chat_template(m, tokenize=False) for m in usable]
    assert rendered[0] == "[CLS]user: hello there\nassistant: general kenobi\n"
    want = [
        chat_tokenizer(text, truncation=True, max_length=SEQ_LEN, add_special_tokens=False)["input_ids"]
        for text in rendered
    ]
    assert found.windows == want
    assert found.windows[0].count(chat_tokenizer.cls_token_id) == 1  # the template's, not a second one
    assert found.windows[0] != expected(chat_tokenizer, rendered[:1])[0]
    assert len(found.windows[1]) == SEQ_LEN
    assert (found.records, found.asked) == (2, 5)
    assert found.shortfall == "the calibration set has 2 usable samples; 5 were asked: calibrating on 2"


def test_text_column_beats_messages_and_can_be_named(tmp_path, tokenizer):
    rows = [{"text": "plain words", "prompt": "a prompt here", "messages": CHATS[0]}]
    path = write_jsonl(tmp_path / "both.jsonl", rows)
    assert calibration_samples(tokenizer, CalibrationSource(str(path)), 1, SEQ_LEN).windows == expected(
        tokenizer, ["plain words"]
    )
    named = calibration_samples(tokenizer, CalibrationSource(str(path), text_column="prompt"), 1, SEQ_LEN)
    assert named.windows == expected(tokenizer, ["a prompt here"])


def test_counts_and_shortfall_when_fewer_records_than_asked(tmp_path, tokenizer):
    source = CalibrationSource(str(write_source(tmp_path, "txt")))
    found = calibration_samples(tokenizer, source, samples=512, seq_len=SEQ_LEN)
    assert len(found.windows) == found.records == 4
    assert found.shortfall == "the calibration set has 4 usable samples; 512 were asked: calibrating on 4"
    assert found.to_dict() == {
        "source": source.to_dict(),
        "fingerprint": found.fingerprint,
        "samples": 4,
        "asked": 512,
        "records": 4,
        "tokens": sum(len(w) for w in found.windows),
    }
    json.dumps(found.to_dict())
    one = calibration_samples(tokenizer, CalibrationSource(str(write_source(tmp_path, "jsonl", ["only"]))), 2, 4)
    assert one.shortfall == "the calibration set has 1 usable sample; 2 were asked: calibrating on 1"


def test_fingerprint_is_stable_and_changes_with_one_record(tmp_path, tokenizer):
    path = write_source(tmp_path, "jsonl")
    source = CalibrationSource(str(path))
    first = calibration_samples(tokenizer, source, 4, SEQ_LEN)
    again = calibration_samples(tokenizer, source, 4, SEQ_LEN)
    assert len(first.fingerprint) == 16 and int(first.fingerprint, 16) >= 0
    assert again.fingerprint == first.fingerprint and again.windows == first.windows
    stamp = calibration_stamp(source)
    changed = list(RECORDS)
    changed[4] = "calibration text number four"
    write_source(tmp_path, "jsonl", changed)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # a different mtime even on a coarse clock
    assert calibration_stamp(source) != stamp
    edited = calibration_samples(tokenizer, source, 4, SEQ_LEN)
    assert edited.windows[:2] == first.windows[:2] and edited.windows[2] != first.windows[2]
    assert edited.fingerprint != first.fingerprint
    assert calibration_samples(tokenizer, source, 3, SEQ_LEN).fingerprint != edited.fingerprint


def test_shuffle_seed_is_deterministic_and_none_keeps_file_order(tmp_path, tokenizer):
    texts = [f"record number {i}" if i % 5 else "" for i in range(200)]
    path = write_source(tmp_path, "jsonl", texts)
    usable = [t for t in texts if t]
    in_order = calibration_samples(tokenizer, CalibrationSource(str(path)), 20, SEQ_LEN)
    assert in_order.windows == expected(tokenizer, usable[:20])
    seeded = CalibrationSource(str(path), shuffle_seed=7)
    first = calibration_samples(tokenizer, seeded, 20, SEQ_LEN)
    assert calibration_samples(tokenizer, seeded, 20, SEQ_LEN).windows == first.windows
    shuffled = [t for t in datasets.Dataset.from_dict({"text": texts}).shuffle(seed=7)["text"] if t]
    assert first.windows == expected(tokenizer, shuffled[:20])  # datasets' shuffle(seed), then the first usable
    assert first.windows != in_order.windows
    other = calibration_samples(tokenizer, CalibrationSource(str(path), shuffle_seed=8), 20, SEQ_LEN)
    assert other.windows != first.windows
    assert first.fingerprint != in_order.fingerprint
    assert first.records == in_order.records == len(usable)


class CountingTokenizer:
    """The tokenizer, remembering how many texts each call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []

    def __call__(self, texts, **kwargs):
        self.calls.append(len(texts) if isinstance(texts, list) else 1)
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_only_the_needed_records_are_tokenized_in_one_batched_call(tmp_path, tokenizer):
    texts = [f"line {i} of a larger file" for i in range(5000)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(texts), encoding="utf-8")
    counting = CountingTokenizer(tokenizer)
    found = calibration_samples(counting, CalibrationSource(str(path), shuffle_seed=1), 6, SEQ_LEN)
    assert counting.calls == [6]
    assert found.records == 5000 and len(found.windows) == 6


def test_preview_shows_records_columns_and_first_texts(tmp_path):
    shown = preview(CalibrationSource(str(write_source(tmp_path, "jsonl"))))
    assert shown["records"] == 4 and shown["rows"] == len(RECORDS)
    assert shown["columns"] == ["text", "id"] and shown["column"] == "text" and shown["chat"] is False
    assert shown["texts"] == USABLE[:3]
    assert preview(CalibrationSource(str(tmp_path / "data.jsonl")), count=1)["texts"] == USABLE[:1]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    shown = preview(CalibrationSource(str(chat)), count=5)
    assert shown["chat"] is True and shown["records"] == 2
    assert shown["texts"][0] == "user: hello there\nassistant: general kenobi"
    assert shown["texts"][1].startswith("system: be brief\nuser: why is the sky blue")


def test_source_round_trips_through_a_dict(tmp_path):
    source = CalibrationSource(str(write_source(tmp_path, "csv")), text_column="body", split="val", shuffle_seed=3)
    d = json.loads(json.dumps(source.to_dict()))
    assert d["kind"] == "csv"
    assert CalibrationSource.from_dict(d) == source
    assert CalibrationSource("org/name").kind == "hub"
    with pytest.raises(CalibrationSourceError, match="unknown calibration source key"):
        CalibrationSource.from_dict({"location": "x.txt", "colum": "text"})
    with pytest.raises(CalibrationSourceError, match="shuffle_seed"):
        CalibrationSource("x.txt", shuffle_seed=True)


def test_samples_of_windows_made_elsewhere(tokenizer):
    windows = token_windows(tokenizer, "one pasted paragraph", 4, 64)
    pasted = CalibrationSamples.of(windows, asked=4, records=len(windows), source={"kind": "pasted"})
    assert pasted.windows == expected(tokenizer, ["one pasted paragraph"], 64)
    assert pasted.tokens == len(windows[0])
    assert pasted.shortfall == "the calibration set has 1 usable sample; 4 were asked: calibrating on 1"
    builtin = CalibrationSamples.of(windows, asked=1, records=1, source={"kind": "builtin"})
    assert builtin.shortfall is None and builtin.fingerprint != pasted.fingerprint


def test_read_records_is_a_datasets_dataset(tmp_path):
    records = read_records(CalibrationSource(str(write_source(tmp_path, "parquet"))))
    assert isinstance(records, datasets.Dataset)
    assert list(records["text"]) == RECORDS


# --- bad input: one line, CalibrationSourceError, naming the problem --------------------------------


def one_line_error(call) -> str:
    with pytest.raises(CalibrationSourceError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message and len(message) < 400
    return message


def bad_file(tmp_path: Path, name: str, content: bytes) -> CalibrationSource:
    path = tmp_path / name
    path.write_bytes(content)
    return CalibrationSource(str(path))


BAD_FILES = {
    "corrupt-parquet": ("bad.parquet", b"PAR1 this is not parquet", "is not a readable Parquet file"),
    "corrupt-jsonl": ("bad.jsonl", b'{"text": "fine"}\n{"text": \n', "is not a readable JSON Lines file"),
    "corrupt-json": ("bad.json", b'[{"text": "fine"}, {"text": ', "is not a readable JSON file"),
    "latin1-txt": ("latin.txt", "caf\xe9 au lait\n".encode("latin-1"), "is not UTF-8 text"),
    "latin1-jsonl": ("latin.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "is not UTF-8 text"),
    "latin1-csv": ("latin.csv", "text\ncaf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
    "unknown-extension": ("notes.md", b"# notes\n", "has an extension calibration cannot read (.md); supported:"),
    "empty-file": ("empty.jsonl", b"", "has no usable records (the file is empty)"),
    "blank-records": ("blank.txt", b"\n   \n\t\n", "has no usable records (3 records, none with non-empty text"),
    "ints-column": ("ints.csv", b"text\n1\n2\n", "column 'text' of"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_one_clear_line(tmp_path, tokenizer, case):
    name, content, words = BAD_FILES[case]
    source = bad_file(tmp_path, name, content)
    message = one_line_error(lambda: calibration_samples(tokenizer, source, 4, SEQ_LEN))
    assert words in message
    assert source.location in message


def test_missing_file(tmp_path, tokenizer):
    for location in (str(tmp_path / "nowhere.csv"), str(tmp_path / "nowhere")):
        message = one_line_error(lambda loc=location: calibration_samples(tokenizer, CalibrationSource(loc), 4, 8))
        assert message == f"calibration file {location} does not exist"


def test_unreadable_file(tmp_path, tokenizer, monkeypatch):
    source = CalibrationSource(str(write_source(tmp_path, "jsonl")))
    calibration_samples(tokenizer, source, 1, SEQ_LEN)  # read once: datasets' cache must not hide the error
    os.chmod(source.location, 0)
    if os.geteuid() == 0:  # root reads anything: refuse it the way the kernel would refuse a user

        def refuse(path, *args, **kwargs):
            if Path(path) == Path(source.location):
                raise PermissionError(13, "Permission denied", str(path))
            return open(path, *args, **kwargs)

        monkeypatch.setattr(cs, "open", refuse, raising=False)
    message = one_line_error(lambda: calibration_samples(tokenizer, source, 1, SEQ_LEN))
    assert message == f"calibration file {source.location} is not readable (permission denied)"


def test_missing_column_names_the_columns_there_are(tmp_path, tokenizer):
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\nhi,there\n", encoding="utf-8")
    message = one_line_error(lambda: calibration_samples(tokenizer, CalibrationSource(str(path)), 1, SEQ_LEN))
    assert message == f"column 'text' is not in {path}; its columns are: prompt, answer"
    assert one_line_error(lambda: preview(CalibrationSource(str(path)))) == message


def test_messages_without_a_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    message = one_line_error(lambda: calibration_samples(tokenizer, CalibrationSource(str(path)), 1, SEQ_LEN))
    assert "holds chat messages, but the tokenizer has no chat template" in message


@pytest.mark.parametrize(
    ("samples", "seq_len", "words"),
    [
        (0, 8, "samples must be a positive integer, got 0"),
        (-3, 8, "samples must be a positive integer, got -3"),
        (True, 8, "samples must be a positive integer, got True"),
        (4, 1, "seq_len must be at least 2, got 1"),
        (4, 0, "seq_len must be a positive integer, got 0"),
    ],
)
def test_bad_knobs(tmp_path, tokenizer, samples, seq_len, words):
    source = CalibrationSource(str(write_source(tmp_path, "txt")))
    assert one_line_error(lambda: calibration_samples(tokenizer, source, samples, seq_len)) == words


def test_directory_not_written_by_save_to_disk(tmp_path, tokenizer):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "data.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    source = CalibrationSource(str(tmp_path / "plain"))
    message = one_line_error(lambda: calibration_samples(tokenizer, source, 1, SEQ_LEN))
    assert message.startswith(f"directory {source.location} was not written by datasets' save_to_disk")


def test_dataset_dict_without_the_split_lists_the_splits(tmp_path, tokenizer):
    source = CalibrationSource(str(write_source(tmp_path, "disk-dict")), split="validation")
    message = one_line_error(lambda: calibration_samples(tokenizer, source, 1, SEQ_LEN))
    assert message == f"the dataset in {source.location} has no split 'validation'; its splits are: train, test"


@pytest.mark.parametrize("flags_read_at_import", [True, False])
def test_hub_id_offline_is_one_line_and_immediate(tokenizer, monkeypatch, flags_read_at_import):
    if not flags_read_at_import:  # set in the environment after datasets was imported: still honoured
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    start = time.perf_counter()
    message = one_line_error(lambda: calibration_samples(tokenizer, CalibrationSource("org/name"), 4, SEQ_LEN))
    assert time.perf_counter() - start < 10
    assert message.startswith("dataset 'org/name' is not a local path, and loading it from the hub needs the network")
    assert "HF_HUB_OFFLINE" in message
    assert datasets.config.HF_HUB_OFFLINE is flags_read_at_import  # restored afterwards
