"""The user's own calibration set through the CLI (issue 24): ``--dataset`` and its flags, the
calibration record in the Observer Lab file, never silently fewer samples, and each bad input as
one line with exit 2 and nothing written."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from lab.cli import main
from sample_models import open_model

LAYER = "encoder.layer.0.intermediate.dense"
RUN = ["run", "minilm", "--layers", LAYER, "--kinds", "input", "--format", "int8", "--observers", "minmax", "--quiet"]
RECORDS = [
    f"Record {i}: the calibration text of a user, {'with more words ' * (i % 7)}and numbers {i * 37}."
    for i in range(20)
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """datasets converts each file once into its cache: a test's own, not the user's."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "records.jsonl"
    rows = [{"text": text, "id": i} for i, text in enumerate(RECORDS)] + [{"text": "   ", "id": 99}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_jsonl_calibrates_each_record_as_one_sample_and_is_recorded(tmp_path, jsonl):
    out = tmp_path / "q.json"
    code, _, err = _main([*RUN, "--dataset", str(jsonl), "--samples", "16", "--seq-len", "24", "--out", str(out)])
    assert code == 0, err
    document = json.loads(out.read_text())
    tokenizer = open_model("minilm").tokenizer()
    lengths = [len(ids) for ids in tokenizer(RECORDS[:16], truncation=True, max_length=24)["input_ids"]]
    calibration = document["calibration"]
    assert calibration["source"]["kind"] == "jsonl" and calibration["source"]["location"] == str(jsonl)
    assert (calibration["samples"], calibration["asked"], calibration["tokens"]) == (16, 16, sum(lengths))
    (entry,) = document["entries"]
    assert entry["tensor_shape"][0] == sum(lengths)  # every token of the 16 records, none of the 17th
    assert document["config"]["dataset"]["location"] == str(jsonl)


def test_fewer_usable_records_than_asked_goes_on_and_says_both_numbers(tmp_path, jsonl):
    out = tmp_path / "q.json"
    code, _, err = _main([*RUN, "--dataset", str(jsonl), "--samples", "64", "--out", str(out)])
    assert code == 0, err
    assert "warning: the calibration set has 20 usable samples; 64 were asked: calibrating on 20" in err
    calibration = json.loads(out.read_text())["calibration"]
    assert (calibration["samples"], calibration["asked"]) == (20, 64)


def test_the_built_in_set_says_so_when_it_has_fewer_samples_than_asked(tmp_path):
    out = tmp_path / "q.json"
    code, _, err = _main([*RUN, "--samples", "512", "--seq-len", "256", "--out", str(out)])
    assert code == 0, err
    calibration = json.loads(out.read_text())["calibration"]
    assert calibration["source"] == {"kind": "builtin"} and calibration["asked"] == 512
    assert 0 < calibration["samples"] < 512
    assert f"has {calibration['samples']} usable samples; 512 were asked" in err


def test_shuffle_seed_changes_which_records_are_taken_and_is_reproducible(tmp_path, jsonl):
    shapes = []
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        out = tmp_path / f"{name}.json"
        argv = [*RUN, "--dataset", str(jsonl), "--samples", "5", "--shuffle-seed", seed, "--out", str(out)]
        assert _main(argv)[0] == 0
        shapes.append(json.loads(out.read_text())["calibration"]["fingerprint"])
    assert shapes[0] == shapes[1] != shapes[2]


def _bad_inputs(folder: Path) -> dict[str, tuple[list[str], str]]:
    corrupt_json = folder / "corrupt.jsonl"
    corrupt_json.write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    corrupt_parquet = folder / "corrupt.parquet"
    corrupt_parquet.write_bytes(b"PAR1 this is not a parquet file at all")
    latin = folder / "latin.txt"
    latin.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    empty = folder / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "  "}\n', encoding="utf-8")
    columns = folder / "columns.csv"
    columns.write_text("prompt,answer\nhello,world\n", encoding="utf-8")
    return {
        "missing file": (["--dataset", str(folder / "nothing.jsonl")], "does not exist"),
        "corrupt json": (["--dataset", str(corrupt_json)], "corrupt.jsonl"),
        "corrupt parquet": (["--dataset", str(corrupt_parquet)], "corrupt.parquet"),
        "not utf-8": (["--dataset", str(latin)], "UTF-8"),
        "no usable records": (["--dataset", str(empty)], "no usable records"),
        "missing column": (["--dataset", str(columns)], "prompt, answer"),
        "zero samples": (["--samples", "0"], "samples must be a positive integer"),
        "hub id offline": (["--dataset", "someone/calibration-set"], "network"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "corrupt json",
        "corrupt parquet",
        "not utf-8",
        "no usable records",
        "missing column",
        "zero samples",
        "hub id offline",
    ],
)
def test_bad_calibration_input_is_one_line_exit_2_and_nothing_written(tmp_path, case, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv, needle = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out" / "q.json"
    out.parent.mkdir()
    code, _, err = _main([*RUN, *argv, "--out", str(out)])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert needle in err and "Traceback" not in err
    assert list(out.parent.iterdir()) == []


def test_a_hub_id_without_network_is_one_line_at_once(tmp_path, monkeypatch):
    """No offline flag, and the hub's name does not resolve: refused before the hub client's retries."""
    import socket

    import datasets

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    out = tmp_path / "q.json"
    code, _, err = _main([*RUN, "--dataset", "someone/calibration-set", "--out", str(out)])
    assert code == 2 and err.count("\n") == 1 and "needs the network" in err and "cannot be reached" in err
    assert not out.exists()


def test_streamed_ranges_over_a_dataset_equal_the_whole_capture(jsonl):
    """The records' tokens, every one of them, set the min-max range."""
    import observers as ob
    from lab.analyse.pipeline import analyse
    from lab.analyse.run_config import RunConfig
    from sample_models.calibration_sets import CalibrationSource

    model = open_model("minilm")
    source = CalibrationSource(str(jsonl))
    config = RunConfig(
        specs={"input": ob.QuantSpec("int8")}, observers=("minmax",), samples=20, seq_len=32, dataset=source
    )
    entry = analyse(model, [LAYER], config).entries[0]
    whole = model.capture([LAYER], texts=source, samples=20, seq_len=32, max_bytes=1 << 30)[LAYER]
    assert entry.num_tokens == whole.shape[0]
    expected = ob.run_one("minmax", whole, ob.QuantSpec("int8"), "activation").qparams.scale
    assert torch.equal(entry.result("minmax").qparams.scale, expected)
