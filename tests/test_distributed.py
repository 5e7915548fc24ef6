"""Sweeps on several ranks (``torchrun ... -m observers run``, ``lab.scale.distributed``): ranks that split
the layers give bit-identical qparams to one process, ranks that split the calibration batches
merge to them (exactly for min-max and histograms), rank 0 writes the one file, and ranks that
disagree or fail stop together with one error line each instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lab.runtime.fusion import fused_groups
from lab.scale.distributed import MISMATCH, SINGLE, owner, rank_device
from lab.scale.sweep import partial_path

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
    differs between any two runs (creation time, timings, who asked when)."""
    document = {k: v for k, v in document.items() if k not in ("created", "world_size", "provenance")}
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


def _one_and_two_ranks(
    tmp_path: Path, args: list[str], one: tuple[str, ...] = ()
) -> tuple[dict, dict, subprocess.CompletedProcess]:
    """The documents one process (with ``args`` and ``one``) and two torchrun ranks write for ``args``."""
    one_file, two = tmp_path / "one.json", tmp_path / "two.json"
    single = subprocess.run(
        [sys.executable, "-m", "observers", *args, *one, "--out", str(one_file)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert single.returncode == 0, single.stderr
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "observers"]
    ranks = subprocess.run(
        [*command, *args, "--out", str(two)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=90
    )
    assert ranks.returncode == 0, ranks.stderr
    # rank 1 wrote nothing; one process not sweeping keeps its whole run beside its file, ranks sweep and keep none
    assert {p.name for p in tmp_path.iterdir()} - {"one.run"} == {"one.json", "two.json"}
    assert ranks.stdout.count("wrote ") == 1
    return json.loads(one_file.read_text()), json.loads(two.read_text()), ranks


@pytest.mark.slow
def test_two_ranks_splitting_layers_write_one_file_with_the_qparams_of_one_process(tmp_path):
    first, second, _ = _one_and_two_ranks(tmp_path, [*RUN, "--split", "layers"])
    assert second["world_size"] == 2 and "world_size" not in first
    assert {e["rank"] for e in second["entries"]} == {0, 1}
    layers = list(dict.fromkeys(e["layer"] for e in first["entries"]))
    group_of = {layer: i for i, (_, members) in enumerate(fused_groups(layers)) for layer in members}
    assert all(e["rank"] == group_of[e["layer"]] % 2 for e in second["entries"])  # a fused group on one rank
    for a, b in zip(first["entries"], second["entries"], strict=True):
        assert (a["layer"], a["tensor"]) == (b["layer"], b["tensor"])
        assert a["qparams"] == b["qparams"]  # bit for bit: bytes_b64 holds the raw float32 bytes
    assert _without_ranks(first) == _without_ranks(second)


@pytest.mark.slow
def test_two_ranks_splitting_batches_merge_to_the_qparams_of_one_process(tmp_path):
    """16 samples make two batches, one per rank: together they observe what one process with
    twice the batch size observes (the memoryless mse_grid included); min-max and the histogram
    merge exactly."""
    args = [*RUN, "--samples", "16", "--observers", "minmax,percentile,mse_grid"]
    first, second, _ = _one_and_two_ranks(tmp_path, args, one=["--batch-size", "16"])
    layers = list(dict.fromkeys(e["layer"] for e in first["entries"]))
    # the weights of fused group i (q/k/v, gate/up: their inputs share one static scale) go to rank i % 2
    group_of = {layer: i for i, (_, members) in enumerate(fused_groups(layers)) for layer in members}
    assert len(set(group_of.values())) < len(layers)
    for a, b in zip(first["entries"], second["entries"], strict=True):
        assert (a["layer"], a["tensor"], a["tensor_shape"]) == (b["layer"], b["tensor"], b["tensor_shape"])
        assert b["rank"] == (group_of[a["layer"]] % 2 if a["tensor"] == "weight" else "all")
        assert a["chosen"]["observer"] == b["chosen"]["observer"]
        sqnr = a["chosen"]["metrics"]["sqnr_db"], b["chosen"]["metrics"]["sqnr_db"]
        assert sqnr[1] == pytest.approx(sqnr[0], rel=1e-5)
        if a["chosen"]["observer"] != "mse_grid":  # min-max and histograms merge bit for bit
            assert a["qparams"] == b["qparams"]


@pytest.mark.slow
def test_moe_experts_that_one_rank_never_routes_to_still_merge(tmp_path):
    args = ["run", "tiny-moe", "--layers", "re:.*experts.*", "--format", "int8", "--observers", "minmax"]
    args += ["--kinds", "input", "--samples", "16", "--seq-len", "16", "--allow-uncalibrated", "--quiet"]
    first, second, _ = _one_and_two_ranks(tmp_path, args)
    assert [(e["layer"], e["tensor_shape"], e["qparams"]) for e in first["entries"]] == [
        (e["layer"], e["tensor_shape"], e["qparams"]) for e in second["entries"]
    ]
    assert first["uncalibrated"] == second["uncalibrated"]


def test_fewer_calibration_batches_than_ranks_by_default_split_the_layers_with_a_note(tmp_path):
    """Two samples make one batch: the default split must not fail where splitting layers works."""
    args = [*RUN, "--kinds", "weight,input"]
    first, second, ranks = _one_and_two_ranks(tmp_path, args)
    assert "note: the calibration set makes 1 batch(es), fewer than the 2 ranks" in ranks.stderr
    assert "split the layers" in ranks.stderr and ranks.stderr.count("note: the calibration set") == 1
    assert {e["rank"] for e in second["entries"]} == {0, 1}  # layers, not batches ("all")
    assert _without_ranks(first) == _without_ranks(second)


def test_fewer_calibration_batches_than_ranks_with_split_batches_is_one_error_line_on_each(tmp_path):
    out = str(tmp_path / "q.json")
    args = ["run", "tiny-llama", "--layers", "all", "--format", "int8", "--observers", "minmax", "--kinds", "input"]
    args += ["--samples", "2", "--seq-len", "16", "--split", "batches", "--quiet", "--out", out]
    for rank in _by_hand([args, args]):
        assert rank.returncode == 2 and rank.stderr.count("\n") == 1, rank.stderr
        assert "fewer than the 2 ranks" in rank.stderr


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
    args += ["--samples", "1", "--seq-len", "8", "--chunk", "1", "--split", "layers", "--quiet", "--out", str(out)]
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


COLLECTIVES = """
import json, torch
from lab.scale.distributed import ranks_for
from observers.shared import Op
with ranks_for("cpu") as ranks:
    mine = torch.tensor([1.0, 5.0]) if ranks.rank == 0 else torch.tensor([3.0, 2.0])
    found = {op.value: ranks.reduce(mine, op).tolist() for op in (Op.MIN, Op.MAX, Op.SUM)}
    found["cat"] = ranks.reduce(torch.full((ranks.rank + 1, 2), float(ranks.rank)), Op.CAT).tolist()
    found["input unchanged"] = mine.tolist()
    try:
        ranks.agree(ValueError("bad part") if ranks.rank == 1 else None)
    except ValueError as err:
        found["agree"] = str(err)
    print(json.dumps(found))
"""


def test_rank_collectives_reduce_gather_unequal_parts_and_agree_on_failure():
    """Two gloo ranks started from torchrun's environment (``ranks_for``) run every ``reduce``
    operation and ``agree``."""
    port = str(_free_port())
    processes = []
    for rank in range(2):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env["WORLD_SIZE"] = "2"
        command = [sys.executable, "-c", COLLECTIVES]
        processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    found = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err.decode()
        found.append(json.loads(out.decode().strip().splitlines()[-1]))
    for each in found:
        assert each["min"] == [1.0, 2.0] and each["max"] == [3.0, 5.0] and each["sum"] == [4.0, 7.0]
        assert each["cat"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # rank 0's one row, then rank 1's two
    assert found[0]["input unchanged"] == [1.0, 5.0]
    assert "another rank" in found[0]["agree"] and found[1]["agree"] == "bad part"
