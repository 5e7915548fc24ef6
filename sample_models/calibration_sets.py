"""Calibration sets read from the user's own data with the ``datasets`` library.

A ``CalibrationSource`` names where the records are (a file, a ``save_to_disk`` directory or a hub
id) and which column holds the text; ``calibration_samples`` turns its first usable records into
one token window each; ``preview`` shows what a source holds without a tokenizer.

Tokenization follows llm-compressor (0.14), so that the same records give the same tokens in both
tools:

- a text record is tokenized alone, with the tokenizer's special tokens, truncated to ``seq_len``:
  ``tokenizer(text, truncation=True, max_length=seq_len)``, as
  ``TextGenerationDataset.tokenize`` in ``llmcompressor/transformers/data/base.py`` calls the
  processor (``padding=False``: no concatenation, no padding);
- a chat record (a ``messages`` column of ``{"role", "content"}``) is rendered with
  ``tokenizer.apply_chat_template(messages, tokenize=False)`` and tokenized with
  ``add_special_tokens=False``, as llm-compressor's custom-dataset recipe does
  (``examples/custom_dataset_example.py``: ``preprocess`` then ``tokenize(..., truncation=True,
  add_special_tokens=False)``): the template already holds the special tokens. (Its built-in
  chat datasets, ``ultrachat_200k`` and ``perfectblend``, instead tokenize the rendered text
  with special tokens again, which doubles a template's BOS; those are not matched.)
- ``shuffle_seed``: ``dataset.shuffle(seed=...)`` before the first ``samples`` records are taken,
  as ``ds.shuffle(seed=42).select(range(n))`` in llm-compressor's examples; ``None`` keeps the
  file's order. Unlike llm-compressor, records whose text is empty or only whitespace are skipped.

Every failure is a ``CalibrationSourceError`` with one readable line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # datasets takes about a second to import: it is imported when a source is read
    import datasets
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED = ".txt (one record per line), .jsonl, .json, .csv, .parquet, or a directory saved by save_to_disk"
MESSAGES_COLUMN = "messages"
CHUNK_ROWS = 1024  # records read (not tokenized) at a time while looking for usable ones
COUNT_ROWS = 65536  # records per Arrow batch when counting the usable ones
MAX_REASON = 200
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class CalibrationSourceError(ValueError):
    """A calibration source cannot be read or used; the message is one line naming the problem."""


@dataclass(frozen=True)
class CalibrationSource:
    """Where calibration records come from: a plain text file, JSONL/JSON/CSV/Parquet with a text
    column (or a chat ``messages`` column), a directory saved by datasets' ``save_to_disk``, or a
    hub id.

    ``text_column`` is used when the data has it; otherwise a ``messages`` column is rendered
    with the tokenizer's chat template. A .txt file always has one column, ``text`` (datasets'
    ``text`` builder: one record per line). ``split`` is used for hub ids and for directories
    holding a ``DatasetDict``. ``shuffle_seed=None`` keeps the file's order."""

    location: str
    text_column: str = "text"
    split: str = "train"
    shuffle_seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("location", "text_column", "split"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise CalibrationSourceError(f"calibration {name} must be a non-empty string, got {value!r}")
        seed = self.shuffle_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise CalibrationSourceError(f"shuffle_seed must be a non-negative integer or None, got {seed!r}")

    @property
    def path(self) -> Path:
        return Path(self.location).expanduser()

    @property
    def kind(self) -> str:
        """``"text"``, ``"jsonl"``, ``"json"``, ``"csv"``, ``"parquet"``, ``"disk"`` or ``"hub"``."""
        path = self.path
        if path.is_dir():
            return "disk"
        suffix = path.suffix.lower()
        if suffix in KINDS:
            return KINDS[suffix]
        if path.exists():
            raise CalibrationSourceError(
                f"{self.location} has an extension calibration cannot read ({suffix or 'none'}); supported: {SUPPORTED}"
            )
        if not _looks_like_hub_id(self.location):
            raise CalibrationSourceError(f"calibration file {self.location} does not exist")
        return "hub"

    def to_dict(self) -> dict:
        """JSON-able; ``from_dict`` reads it back (``kind`` is informative and ignored there)."""
        return {
            "kind": self.kind,
            "location": self.location,
            "text_column": self.text_column,
            "split": self.split,
            "shuffle_seed": self.shuffle_seed,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CalibrationSource:
        if not isinstance(d, dict):
            raise CalibrationSourceError(f"a calibration source must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"kind"})
        if unknown:
            raise CalibrationSourceError(f"unknown calibration source key(s): {', '.join(map(str, unknown))}")
        if "location" not in d:
            raise CalibrationSourceError("a calibration source needs a 'location'")
        return cls(**{key: d[key] for key in known if key in d})


@dataclass(frozen=True)
class CalibrationSamples:
    """The tokenized calibration set: one sample per usable record."""

    windows: list[list[int]]
    asked: int
    records: int
    tokens: int
    fingerprint: str
    source: dict

    @classmethod
    def of(cls, windows: list[list[int]], *, asked: int, records: int, source: dict) -> CalibrationSamples:
        """Counts and fingerprint of windows made elsewhere (built-in or pasted text: ``source`` is
        then ``{"kind": "builtin"}`` or ``{"kind": "pasted"}``)."""
        windows = [[int(t) for t in w] for w in windows]
        return cls(windows, asked, records, sum(map(len, windows)), fingerprint(source, windows), source)

    @property
    def shortfall(self) -> str | None:
        """None when every asked sample is there, else one line saying both numbers."""
        if len(self.windows) == self.asked:
            return None
        have = len(self.windows)
        return (
            f"the calibration set has {have} usable sample{'' if have == 1 else 's'}; "
            f"{self.asked} {'was' if self.asked == 1 else 'were'} asked: calibrating on {have}"
        )

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "samples": len(self.windows),
            "asked": self.asked,
            "records": self.records,
            "tokens": self.tokens,
        }


def fingerprint(source: dict, windows: list[list[int]]) -> str:
    """sha256 (16 hex digits) of the source description and every token id, window by window."""
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode())
    for window in windows:
        digest.update(len(window).to_bytes(8, "little"))
        digest.update(np.asarray(window, dtype="<i8").tobytes())
    return digest.hexdigest()[:16]


def read_records(source: CalibrationSource, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """The source's records as a ``datasets.Dataset`` (Arrow, memory-mapped). Files go through
    datasets' packaged builders (converted once into ``cache_dir``, default datasets' own cache,
    ``HF_DATASETS_CACHE``), directories through ``load_from_disk``, anything else is a hub id."""
    kind = source.kind
    with _quiet_datasets():
        if kind == "hub":
            return _read_hub(source, cache_dir)
        if kind == "disk":
            return _read_disk(source)
        return _read_file(source, kind, cache_dir)


def calibration_samples(
    tokenizer: PreTrainedTokenizerBase,
    source: CalibrationSource,
    samples: int,
    seq_len: int,
    cache_dir: str | os.PathLike | None = None,
) -> CalibrationSamples:
    """The first ``samples`` usable records of ``source`` (after ``shuffle_seed``'s shuffle), each
    tokenized alone into one window of at most ``seq_len`` tokens, in one batched tokenizer call.
    Fewer usable records than asked is not an error: ``shortfall`` says so."""
    _check_knobs(samples, seq_len)
    dataset = read_records(source, cache_dir)
    column, chat = _column(dataset, source)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise CalibrationSourceError(
            f"column '{column}' of {source.location} holds chat messages, but the tokenizer has no chat template: "
            "give a text column (text_column) or a model whose tokenizer has one"
        )
    records = _count_usable(dataset, source, column, chat)
    if records == 0:
        raise CalibrationSourceError(_no_usable(source, column, chat, len(dataset)))
    values = _first_usable(dataset, source, column, chat, samples)
    if chat:
        texts = [_render_chat(tokenizer, messages, source) for messages in values]
    else:
        texts = values
    encoded = tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=not chat)
    windows = [list(ids) for ids in encoded["input_ids"]]
    return CalibrationSamples.of(windows, asked=samples, records=records, source=source.to_dict())


def preview(source: CalibrationSource, count: int = 3, cache_dir: str | os.PathLike | None = None) -> dict:
    """What the source holds, without a tokenizer: ``records`` (usable), ``rows`` (all),
    ``columns``, ``column`` (the one calibration reads), ``chat`` (whether it is a messages
    column), ``order`` and ``texts``: the first ``count`` usable records in calibration order
    (shuffled when ``shuffle_seed`` is set), chat rendered as ``role: content`` lines."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise CalibrationSourceError(f"count must be a non-negative integer, got {count!r}")
    dataset = read_records(source, cache_dir)
    column, chat = _column(dataset, source)
    records = _count_usable(dataset, source, column, chat)
    values = _first_usable(dataset, source, column, chat, count) if records and count else []
    if chat:
        values = ["\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages) for messages in values]
    seed = source.shuffle_seed
    return {
        "records": records,
        "rows": len(dataset),
        "columns": list(dataset.column_names),
        "column": column,
        "chat": chat,
        "order": "file" if seed is None else f"shuffled (seed {seed})",
        "texts": values,
    }


# --- reading -------------------------------------------------------------------------------------


def _read_file(source: CalibrationSource, kind: str, cache_dir: str | os.PathLike | None) -> datasets.Dataset:
    import datasets

    path = source.path
    where = source.location
    if not path.is_file():
        raise CalibrationSourceError(f"calibration file {where} does not exist")
    try:
        with open(path, "rb") as handle:
            empty = not handle.read(1)
    except PermissionError:
        raise CalibrationSourceError(f"calibration file {where} is not readable (permission denied)") from None
    except OSError as err:
        raise CalibrationSourceError(f"calibration file {where} cannot be read: {_reason(err)}") from None
    if empty:
        raise CalibrationSourceError(f"{where} has no usable records (the file is empty)")
    builder = BUILDERS[path.suffix.lower()]
    try:
        return datasets.load_dataset(
            builder, data_files=str(path.resolve()), split="train", cache_dir=str(cache_dir) if cache_dir else None
        )
    except Exception as err:  # datasets, pyarrow, pandas and the codecs each raise their own
        raise _file_error(where, kind, err) from err


def _file_error(where: str, kind: str, err: BaseException) -> CalibrationSourceError:
    chain = list(_chain(err))
    for cause in chain:
        if isinstance(cause, UnicodeDecodeError):
            return CalibrationSourceError(
                f"{where} is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} cannot be decoded): "
                "save it as UTF-8"
            )
    for cause in chain:  # pyarrow's JSON reader says it in words
        if isinstance(cause, ValueError) and re.search(r"utf-?8", str(cause), re.IGNORECASE):
            return CalibrationSourceError(f"{where} is not UTF-8 text ({_reason(cause)}): save it as UTF-8")
    for cause in chain:
        if isinstance(cause, PermissionError):
            return CalibrationSourceError(f"calibration file {where} is not readable (permission denied)")
    if kind == "json" and any(isinstance(cause, StopIteration) for cause in chain):
        return CalibrationSourceError(f"{where} has no usable records (it holds no JSON records)")
    what = {"text": "text", "jsonl": "JSON Lines", "json": "JSON", "csv": "CSV", "parquet": "Parquet"}[kind]
    return CalibrationSourceError(f"{where} is not a readable {what} file: {_reason(chain[-1])}")


def _read_disk(source: CalibrationSource) -> datasets.Dataset:
    import datasets

    where = source.location
    try:
        loaded = datasets.load_from_disk(str(source.path))
    except PermissionError:
        raise CalibrationSourceError(f"directory {where} is not readable (permission denied)") from None
    except FileNotFoundError:
        raise CalibrationSourceError(
            f"directory {where} was not written by datasets' save_to_disk; give a directory saved by "
            f"save_to_disk or one of: {SUPPORTED}"
        ) from None
    except Exception as err:
        raise CalibrationSourceError(f"the dataset in directory {where} cannot be read: {_reason(err)}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise CalibrationSourceError(
                f"the dataset in {where} has no split '{source.split}'; its splits are: {', '.join(loaded)}"
            )
        loaded = loaded[source.split]
    return loaded


def _read_hub(source: CalibrationSource, cache_dir: str | os.PathLike | None) -> datasets.Dataset:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    name = source.location
    with _offline_from_environment():
        offline = datasets.config.HF_HUB_OFFLINE
        unreachable = None if offline else _unreachable_hub()
        if unreachable is not None:  # say so at once, not after the hub client's minute of retries
            raise CalibrationSourceError(
                f"dataset '{name}' is not a local path, and loading it from the hub needs the network: {unreachable}"
            )
        try:
            return datasets.load_dataset(name, split=source.split, cache_dir=str(cache_dir) if cache_dir else None)
        except DatasetNotFoundError:
            raise CalibrationSourceError(
                f"dataset '{name}' is not a local path, and the Hugging Face Hub has no dataset by that name "
                "(or it is private or gated and you are not logged in)"
            ) from None
        except Exception as err:
            chain = list(_chain(err))
            if offline or any(isinstance(c, ConnectionError | TimeoutError) for c in chain) or _is_network(chain):
                reason = "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else _reason(err)
                raise CalibrationSourceError(
                    f"dataset '{name}' is not a local path, and loading it from the hub needs the network: {reason}"
                ) from err
            if isinstance(err, ValueError) and "split" in str(err).lower():
                raise CalibrationSourceError(f"dataset '{name}' has no split '{source.split}': {_reason(err)}") from err
            raise CalibrationSourceError(f"loading dataset '{name}' from the hub failed: {_reason(err)}") from err


def _unreachable_hub() -> str | None:
    """Why the hub's host cannot be reached (its name does not resolve), or None when it resolves."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"{host} cannot be reached ({err.strerror or err})"
    return None


def _is_network(chain: list[BaseException]) -> bool:
    """httpx and requests errors are not ConnectionError subclasses; recognise them by module."""
    return any(type(c).__module__.split(".")[0] in {"httpx", "httpcore", "requests", "urllib3"} for c in chain)


@contextlib.contextmanager
def _offline_from_environment() -> Iterator[None]:
    """datasets and huggingface_hub read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, when imported;
    honour them when they were set afterwards (a test, an app that set them at run time)."""
    import datasets
    import huggingface_hub

    flags = [os.environ.get(name) for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")]
    flag = next((value for value in flags if value is not None), None)
    wanted = flag is not None and flag.strip().upper() in {"1", "ON", "YES", "TRUE"}
    if not wanted or datasets.config.HF_HUB_OFFLINE:
        yield
        return
    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars and no logged errors (datasets logs a failure before raising it; the raised
    one becomes our one-line message)."""
    import datasets

    logger = logging.getLogger("datasets")
    level = logger.level
    bars = datasets.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _looks_like_hub_id(location: str) -> bool:
    if location.startswith((".", "/", "~")) or "\\" in location or location.endswith("/"):
        return False
    return bool(_HUB_ID.match(location)) and ".." not in location and "--" not in location


# --- records -------------------------------------------------------------------------------------


def _column(dataset: datasets.Dataset, source: CalibrationSource) -> tuple[str, bool]:
    """The column calibration reads and whether it holds chat messages."""
    import pyarrow as pa

    columns = list(dataset.column_names)
    if source.text_column in columns:
        column = source.text_column
    elif MESSAGES_COLUMN in columns:
        column = MESSAGES_COLUMN
    else:
        there = ", ".join(columns) if columns else "none"
        raise CalibrationSourceError(
            f"column '{source.text_column}' is not in {source.location}; its columns are: {there}"
        )
    kind = dataset.data.schema.field(column).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind):
        return column, False
    if _is_string_view(kind):
        return column, False
    if _is_messages(kind):
        return column, True
    held = "mixed (JSON)" if isinstance(kind, pa.BaseExtensionType) else str(kind)
    raise CalibrationSourceError(
        f"column '{column}' of {source.location} holds {held} values, not text or chat messages "
        "(a list of {role, content})"
    )


def _is_string_view(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind)


def _is_messages(kind: pa.DataType) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    item = kind.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    content = names.get("content")
    return (
        "role" in names
        and content is not None
        and (pa.types.is_string(content) or pa.types.is_large_string(content) or pa.types.is_null(content))
    )


def _usable(batch: pa.Table, column: str, chat: bool) -> np.ndarray:
    """Which rows of an Arrow batch are usable: text that is not empty or whitespace, or a list of
    messages of which one has such content. The same rule counts and picks records."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = batch.column(column).combine_chunks() if batch.num_rows else pa.array([], batch.schema.field(column).type)
    if not chat:
        return _nonblank(array)
    usable = np.zeros(len(array), dtype=bool)
    if len(array):
        contents = pc.struct_field(pc.list_flatten(array), "content")
        parents = np.asarray(pc.list_parent_indices(array))
        hits = parents[_nonblank(contents)]
        usable[hits] = True
    return usable


def _nonblank(array: pa.Array) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_null(array.type):
        return np.zeros(len(array), dtype=bool)
    if _is_string_view(array.type):
        array = array.cast(pa.large_string())
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(array))
    return np.asarray(pc.fill_null(pc.greater(lengths, 0), False), dtype=bool)


def _count_usable(dataset: datasets.Dataset, source: CalibrationSource, column: str, chat: bool) -> int:
    """Usable records in the whole source: Arrow batches, vectorized, nothing tokenized. Checks
    the column's UTF-8 on the way: pyarrow's JSON reader lets invalid bytes into string arrays."""
    import pyarrow as pa

    table = dataset.select_columns([column]).with_format("arrow")
    usable = 0
    for batch in table.iter(batch_size=COUNT_ROWS):
        try:
            batch.column(column).validate(full=True)
            usable += int(_usable(batch, column, chat).sum())
        except pa.ArrowInvalid as err:
            if "utf8" in str(err).lower().replace("-", ""):
                raise CalibrationSourceError(f"{source.location} is not UTF-8 text: save it as UTF-8") from None
            raise CalibrationSourceError(
                f"column '{column}' of {source.location} cannot be read: {_reason(err)}"
            ) from err
    return usable


def _first_usable(dataset: datasets.Dataset, source: CalibrationSource, column: str, chat: bool, count: int) -> list:
    """The first ``count`` usable values in calibration order, reading ``CHUNK_ROWS`` at a time."""
    ordered = dataset.select_columns([column])
    if source.shuffle_seed is not None:
        ordered = ordered.shuffle(seed=source.shuffle_seed, keep_in_memory=True)  # no cache file beside the data
    taken: list[Any] = []
    for batch in ordered.with_format("arrow").iter(batch_size=CHUNK_ROWS):
        rows = np.flatnonzero(_usable(batch, column, chat))[: count - len(taken)]
        if len(rows):
            taken.extend(batch.column(column).take(rows.tolist()).to_pylist())
        if len(taken) >= count:
            break
    return taken


def _render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], source: CalibrationSource) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # jinja2 template errors, raise_exception() inside templates
        raise CalibrationSourceError(
            f"the tokenizer's chat template cannot render a record of {source.location}: {_reason(err)}"
        ) from err


def _no_usable(source: CalibrationSource, column: str, chat: bool, rows: int) -> str:
    what = "chat messages with content" if chat else "text"
    counted = f"{rows} record{'' if rows == 1 else 's'}"
    return f"{source.location} has no usable records ({counted}, none with non-empty {what} in '{column}')"


def _check_knobs(samples: int, seq_len: int) -> None:
    for knob, value in (("samples", samples), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CalibrationSourceError(f"{knob} must be a positive integer, got {value!r}")
    if seq_len < 2:
        raise CalibrationSourceError(f"seq_len must be at least 2, got {seq_len}")


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _reason(err: BaseException) -> str:
    """One line of a library's message (they run to paragraphs), at most ``MAX_REASON`` characters."""
    text = str(err).strip()
    line = text.splitlines()[0].strip() if text else ""
    line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line if len(line) <= MAX_REASON else line[: MAX_REASON - 1] + "…"


def calibration_stamp(texts: CalibrationSource | list[str] | str | None) -> str:
    """What changes when the calibration records could: a source's settings and its files' sizes
    and modification times (a hub id is taken as named), or the texts themselves."""
    if not isinstance(texts, CalibrationSource):
        return json.dumps(texts)
    found: list[Any] = [texts.to_dict()]
    if texts.path.exists():
        files = sorted(texts.path.rglob("*")) if texts.path.is_dir() else [texts.path]
        found += [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha256(json.dumps(found, default=str).encode()).hexdigest()[:16]
