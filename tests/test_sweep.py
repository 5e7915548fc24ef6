"""Whole-model sweeps (``run --layers all``, ``lab.scale.sweep``): the streamed file equals a run over the
same layers in one go, an interrupted sweep resumes to the same file, the partial file refuses
other settings, and no chunk holds more layers than it should."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.export import lab_json
from lab.progress_bar import ProgressBar
from lab.results import choose
from lab.scale import sweep, sweep_file
from lab.scale.plan import Plan
from lab.scale.sweep import partial_path, run_sweep
from sample_models import open_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--format", "int8", "--observers", "minmax,percentile", "--kinds", "weight,input"]
TINY += ["--samples", "2", "--seq-len", "16", "--quiet"]


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


def comparable(document: dict) -> dict:
    """A document without what differs between any two runs (creation time, timings, who asked when)."""
    document = {k: v for k, v in document.items() if k not in ("created", "provenance")}
    document["entries"] = [dict(e) for e in document["entries"]]
    for entry in document["entries"]:
        for key in ("chosen", "runner_up"):
            if entry[key] is not None:
                entry[key] = {k: v for k, v in entry[key].items() if k != "seconds"}
    return document


def _layer_names(model_name: str) -> list[str]:
    return [info.name for info in open_model(model_name).layers() if len(info.shape) >= 2]


def _run(tmp_path: Path, name: str, argv: list[str]) -> dict:
    out = tmp_path / name
    code, _, err = _main([*argv, "--out", str(out)])
    assert code == 0, err
    assert not partial_path(out).exists()
    return json.loads(out.read_text())


def test_layers_all_equals_every_layer_listed(tmp_path):
    swept = _run(tmp_path, "all.json", ["run", "tiny-llama", "--layers", "all", *TINY])
    listed = _run(tmp_path, "list.json", ["run", "tiny-llama", "--layers", ",".join(_layer_names("tiny-llama")), *TINY])
    assert lab_json.schema_problems(swept) == []
    assert "world_size" not in swept and all("rank" not in e for e in swept["entries"])
    assert comparable(swept) == comparable(listed)
    assert {e["layer"] for e in swept["entries"]} >= {"model.embed_tokens", "lm_head"}


def test_attention_blocks_and_uncalibrated_experts_stream_alike(tmp_path):
    kv = ["--layers", "model.layers.0.*", "--format", "int8", "--observers", "minmax", "--kv-cache", "fp8_e4m3"]
    kv += ["--samples", "2", "--seq-len", "16", "--quiet"]
    assert comparable(_run(tmp_path, "kv.json", ["run", "tiny-llama", *kv, "--chunk", "3"])) == comparable(
        _run(tmp_path, "kv_list.json", ["run", "tiny-llama", *kv])
    )
    moe = ["--format", "int8", "--observers", "minmax", "--kinds", "input", "--samples", "1", "--seq-len", "8"]
    moe += ["--allow-uncalibrated", "--quiet"]
    swept = _run(tmp_path, "moe.json", ["run", "tiny-moe", "--layers", "all", "--chunk", "1", *moe])
    listed = _run(tmp_path, "moe_list.json", ["run", "tiny-moe", "--layers", ",".join(_layer_names("tiny-moe")), *moe])
    assert swept["uncalibrated"] and comparable(swept) == comparable(listed)


def test_uncalibrated_experts_stop_a_sweep_unless_allowed(tmp_path):
    argv = ["run", "tiny-moe", "--layers", "all", "--format", "int8", "--observers", "minmax", "--kinds", "input"]
    argv += ["--samples", "1", "--seq-len", "8", "--chunk", "1", "--quiet", "--out", str(tmp_path / "q.json")]
    code, _, err = _main(argv)
    assert code == 2 and err.count("\n") == 1 and "saw no calibration tokens" in err
    assert partial_path(tmp_path / "q.json").exists()  # the layers done before are kept


def _plan(observers=("minmax", "percentile"), chunk=4) -> Plan:
    spec = ob.QuantSpec("int8")
    config = RunConfig(specs={"weight": spec, "input": spec}, observers=observers, samples=2, seq_len=16)
    return Plan(open_model("tiny-llama"), tuple(_layer_names("tiny-llama")), config, chunk=chunk)


def _interrupt_after(layers: int):
    def progress(done: int, total: int, label: str) -> None:
        if done >= layers:
            raise KeyboardInterrupt

    return progress


def test_an_interrupted_sweep_resumes_to_the_same_file(tmp_path):
    plan = _plan()
    whole = run_sweep(plan, tmp_path / "whole.json").document
    out = tmp_path / "q.json"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, out, progress=_interrupt_after(10))
    lines = partial_path(out).read_text().splitlines()
    units = [json.loads(line) for line in lines if '"unit"' in line]
    assert [u["index"] for u in units] == list(range(8))  # two chunks of 4 written whole, the third lost
    assert json.loads(lines[0])["format"] == "observer-lab-sweep" and not out.exists()
    with open(partial_path(out), "ab") as handle:
        handle.write(b'{"unit": "model.layers.2.self_attn.v_proj", "ind')  # a kill in the middle of a write
    outcome = run_sweep(plan, out, resume=True)
    assert outcome.resumed == 8
    assert comparable(json.loads(out.read_text())) == comparable(whole) == comparable(outcome.document)
    assert not partial_path(out).exists()


def test_resume_refuses_a_partial_file_of_other_settings(tmp_path):
    out = tmp_path / "q.json"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(_plan(), out, progress=_interrupt_after(5))
    argv = ["run", "tiny-llama", "--layers", "all", *TINY, "--out", str(out)]
    code, _, err = _main([*argv, "--resume", "--observers", "minmax"])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "other settings" in err
    code, _, err = _main(argv)
    assert code == 2 and err.count("\n") == 1 and "--resume" in err  # never overwritten silently
    code, _, err = _main([*argv, "--resume", "--chunk", "3"])  # the chunk size does not change results
    assert code == 0, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--layers", "nothing.matches.*", "--chunk", "2"], "matches no layer"),
        (["--layers", "all", "--chunk", "0"], "--chunk must be at least 1"),
        (["--layers", "all", "--report", "r.html"], "--report, --compressed-tensors and --choose"),
        (["--layers", "all", "--compressed-tensors", "ct"], "--report, --compressed-tensors and --choose"),
    ],
)
def test_bad_sweep_input_exits_2_with_one_line(tmp_path, argv, needle):
    code, _, err = _main(["run", "tiny-llama", "--format", "int8", *argv, "--out", str(tmp_path / "q.json")])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err
    assert not partial_path(tmp_path / "q.json").exists()


def test_a_sweep_calibrates_in_one_pass_and_writes_each_block_as_it_finishes(tmp_path, monkeypatch):
    """By default every layer is observed in one calibration pass (the checkpoint read once);
    sequentially, each block's layers are written as soon as the block has seen every batch."""
    calls: list[int] = []
    rounds: list[set[str]] = []
    real_analyse, real_write = sweep.analyse, sweep_file.Writer.write_round

    def counting(model, layers, config, **kwargs):
        calls.append(len(layers))
        return real_analyse(model, layers, config, **kwargs)

    def recording(self, payloads):
        rounds.append({line["unit"] for payload in payloads for line in payload["units"]})
        return real_write(self, payloads)

    monkeypatch.setattr(sweep, "analyse", counting)
    monkeypatch.setattr(sweep_file.Writer, "write_round", recording)
    plan = _plan(chunk=None)
    plan = Plan(plan.model, plan.layers, RunConfig(**{**vars(plan.config), "sequential": True}))
    run_sweep(plan, tmp_path / "q.json")
    assert plan.chunk_size() is None and calls == [len(plan.layers)]
    blocks = [{name for name in plan.layers if name.startswith(f"model.layers.{i}.")} for i in range(4)]
    assert rounds == [{"model.embed_tokens"}, *blocks, {"lm_head"}]
    weights_only = Plan(plan.model, plan.layers, RunConfig(specs={"weight": ob.QuantSpec("int8")}))
    assert weights_only.chunk_size() == 1
    assert Plan(plan.model, plan.layers, plan.config, chunk=3).chunk_size() == 3


def test_the_final_file_is_streamed_byte_for_byte_as_the_whole_document_dumps(tmp_path):
    """The final file is written a unit at a time from the partial file, whose units may come out
    of model order (ranks that split the layers append them so): its bytes are ``lab_json.dumps``
    of the document it holds, that document is the one analysing the same layers in one go builds
    in memory, key order included, and every entry fits the schema."""
    model = open_model("tiny-llama")
    layers = tuple(_layer_names("tiny-llama"))
    plan = Plan(model, layers, RunConfig(specs={"weight": ob.QuantSpec("int8")}, observers=("minmax", "mse_grid")))
    out = tmp_path / "q.json"
    with pytest.raises(KeyboardInterrupt):  # every unit written, the final file not yet
        run_sweep(plan, out, progress=_interrupt_after(len(layers)))
    first, header, *units = partial_path(out).read_bytes().splitlines(keepends=True)
    partial_path(out).write_bytes(first + header + b"".join(reversed(units)))
    outcome = run_sweep(plan, out, resume=True)
    written = out.read_bytes()
    document = json.loads(written)
    assert written == lab_json.dumps(document).encode("utf-8") and outcome.document == document
    analysis = analyse(model, list(layers), plan.config)
    in_memory = lab_json.build_document(analysis, choose(analysis))
    assert lab_json.dumps(comparable(document)) == lab_json.dumps(comparable(in_memory))
    assert lab_json.schema_problems(document) == []
    assert document["version"] == lab_json.FORMAT_VERSION


def test_progress_bar_shows_layers_elapsed_and_eta():
    stream, now = io.StringIO(), iter([100.0, 110.0, 140.0])
    bar = ProgressBar(stream, "layers", clock=lambda: next(now))
    bar(2, 10, "resuming")  # the rate counts from here: resumed layers do not make it look fast
    bar(3, 10, "a")
    bar(10, 10, "done")
    first, second, last = stream.getvalue().split("\r")[1:]
    assert "2/10 layers 0:00:00 ETA -:--:--" in first
    assert "3/10 layers 0:00:10 ETA 0:01:10" in second
    assert "[##############################] 10/10 layers 0:00:40 ETA 0:00:00" in last and last.endswith("\n")


INTERRUPT_AFTER_ROUND = """
import os, signal, sys
from lab.scale import sweep_file
from lab.cli import main

original, rounds = sweep_file.Writer.write_round, []


def write_round(self, payloads):
    original(self, payloads)
    rounds.append(1)
    if len(rounds) == int(os.environ["INTERRUPT_AFTER_ROUND"]):
        os.kill(os.getpid(), signal.SIGINT)  # the real signal, at a known point of the sweep


sweep_file.Writer.write_round = write_round
# A child of a background job inherits SIGINT as ignored: the test's interrupt must reach the CLI
# however the suite was started, as a person's Ctrl-C does.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ctrl_c_on_the_cli_keeps_finished_layers_and_resume_finishes(tmp_path):
    """Ctrl-C arrives right after the second chunk is on disk (a SIGINT the process sends itself
    from the writer), so the test never races the sweep's speed."""
    out = tmp_path / "q.json"
    argv = ["run", "minilm", "--layers", "encoder.layer.[0-2].*", "--format", "int4", "--strategy", "group"]
    argv += ["--group-size", "128", "--observers", "minmax,mse_grid", "--chunk", "1", "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "observers", *argv, "--out", str(out)]
    interrupted = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AFTER_ROUND, *argv, "--out", str(out)],
        cwd=ROOT,
        env={**env, "INTERRUPT_AFTER_ROUND": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = interrupted.stderr
    assert interrupted.returncode == 130, err
    assert err.strip().endswith("run the same command with --resume to go on") and "Traceback" not in err
    kept = partial_path(out).read_text().count("\n")
    assert kept == 4 and not out.exists()  # settings, document header, one line per chunk
    resumed = subprocess.run([*command, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"note: {kept - 2} of 18 layers came from the interrupted sweep" in resumed.stderr
    swept = json.loads(out.read_text())
    assert comparable(swept) == comparable(_run(tmp_path, "whole.json", argv))
    assert swept["provenance"]["asked_by"].startswith("cli") and swept["provenance"]["run"] is None  # who asked
