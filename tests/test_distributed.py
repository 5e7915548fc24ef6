"""Sweeps on several ranks (``torchrun ... -m observers run``, ``lab.distributed``): the ranks split
the layers and give bit-identical qparams to one process, rank 0 writes the one file, and ranks
that disagree or fail stop together with one error line each instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lab.distributed import MISMATCH, SINGLE, owner, rank_device
from lab.sweep import partial_path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN = ["run", "tiny-llama", "--layers", "all", "--format", "int8", "--observers", "minmax,percentile"]
RUN += ["--kinds", "weight,input", "--samples", "2", "--seq-len", "16", "--quiet"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_ranks(document: dict) -> dict:
    """What one process writes for the same run: no ``world_size``, no ``rank``, and none of what
    differs between any two runs (creation time, timings)."""
    document = {k: v for k, v in document.items() if k not in ("created", "world_size")}
    document["entries"] = [{k: v for k, v in e.items() if k != "rank"} for e in document["entries"]]
    for entry in document["entries"]:
        for key in ("chosen", "runner_up"):
            if entry[key] is not None:
                entry[key] = {k: v for k, v in entry[key].items() if k != "seconds"}
    return document


def _by_hand(args_of_rank: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Start one ``python -m observers`` per rank with torchrun's environment set by hand, so each
    rank's arguments, exit code and stderr can be told apart."""
    port = str(_free_port())
    processes = []
    for rank, args in enumerate(args_of_rank):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env["WORLD_SIZE"] = str(len(args_of_rank))
        command = [sys.executable, "-m", "observers", *args]
        processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out.decode(), err.decode()))
    return done


@pytest.mark.slow
def test_two_ranks_write_one_file_with_the_qparams_of_one_process(tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    single = subprocess.run(
        [sys.executable, "-m", "observers", *RUN, "--out", str(one)], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert single.returncode == 0, single.stderr
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "observers"]
    ranks = subprocess.run(
        [*command, *RUN, "--out", str(two)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=90
    )
    assert ranks.returncode == 0, ranks.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json", "two.json"]  # rank 1 wrote nothing
    first, second = json.loads(one.read_text()), json.loads(two.read_text())
    assert second["world_size"] == 2 and "world_size" not in first
    assert {e["rank"] for e in second["entries"]} == {0, 1}
    layers = list(dict.fromkeys(e["layer"] for e in first["entries"]))
    assert all(e["rank"] == layers.index(e["layer"]) % 2 for e in second["entries"])
    for a, b in zip(first["entries"], second["entries"], strict=True):
        assert (a["layer"], a["tensor"]) == (b["layer"], b["tensor"])
        assert a["qparams"] == b["qparams"]  # bit for bit: bytes_b64 holds the raw float32 bytes
    assert _without_ranks(first) == _without_ranks(second)
    assert ranks.stdout.count("wrote ") == 1


def test_ranks_started_with_different_arguments_stop_with_one_line(tmp_path):
    out = str(tmp_path / "q.json")
    base = ["run", "tiny-llama", "--layers", "all", "--format", "int8", "--quiet", "--out", out]
    done = _by_hand([[*base, "--observers", "minmax"], [*base, "--observers", "percentile"]])
    for rank in done:
        assert rank.returncode == 2 and rank.stderr == f"error: {MISMATCH}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_error_on_one_rank_stops_every_rank_and_keeps_finished_layers(tmp_path):
    out = tmp_path / "q.json"
    args = ["run", "tiny-moe", "--layers", "all", "--format", "int8", "--observers", "minmax", "--kinds", "input"]
    args += ["--samples", "1", "--seq-len", "8", "--chunk", "1", "--quiet", "--out", str(out)]
    done = _by_hand([args, args])
    for rank in done:
        assert rank.returncode == 2 and rank.stderr.count("\n") == 1, rank.stderr
        assert rank.stderr.startswith("error: rank ") and "saw no calibration tokens" in rank.stderr
    lines = partial_path(out).read_text().splitlines()
    assert json.loads(lines[0])["world_size"] == 2 and any('"unit"' in line for line in lines)
    assert not out.exists()


def test_layers_go_round_robin_and_one_process_needs_no_group():
    assert [[i for i in range(7) if owner(i, 3) == rank] for rank in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert SINGLE.is_main and SINGLE.gather("x") == ["x"] and SINGLE.broadcast(3) == 3
    SINGLE.check_same("anything")  # nothing to compare with
    assert SINGLE.device_for("cuda") == "cuda"  # one process keeps the device it was given
    assert [rank_device(device, 3) for device in ("cuda", "cpu", "cuda:1")] == ["cuda:3", "cpu", "cuda:1"]
