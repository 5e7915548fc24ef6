"""The headless CLI: in-process through ``lab.cli.main`` (fast), plus real ``python -m observers`` runs."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.export import lab_json
from lab.results import choose
from sample_models import open_model

ROOT = Path(__file__).resolve().parents[1]
LAYERS = "encoder.layer.0.attention.self.query,*.0.output.dense"
RUN_ARGS = [
    "run",
    "minilm",
    "--layers",
    LAYERS,
    "--format",
    "int4",
    "--strategy",
    "group",
    "--group-size",
    "32",
    "--asymmetric",
    "--observers",
    "minmax,memoryless_minmax,moving_average_minmax",
    "--kinds",
    "weight,input",
    "--samples",
    "4",
    "--seq-len",
    "32",
]


def _main(argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    argv = [*RUN_ARGS, "--out", str(folder / "q.json"), "--report", str(folder / "r.html")]
    argv += ["--compressed-tensors", str(folder / "ct")]
    code, out, err = _main(argv)
    return folder, code, out, err


def test_run_writes_valid_file_report_and_ct_export(cli_run):
    folder, code, out, err = cli_run
    assert code == 0, err
    document = json.loads((folder / "q.json").read_text())
    jsonschema.validate(document, lab_json.schema(), cls=jsonschema.Draft202012Validator)
    assert {(e["layer"], e["tensor"]) for e in document["entries"]} == {
        (layer, tensor)
        for layer in ("encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense")
        for tensor in ("weight", "input")
    }
    assert document["source"]["kind"] == "builtin" and document["source"]["id"] == "minilm"
    assert re.fullmatch(r"[0-9a-f]{64}", document["source"]["files"][0]["sha256"])
    assert "wrote" in out and "sqnr_db=" in out
    assert "[##############################] 12/12" in err
    wrapped = json.loads((folder / "ct" / "quantization_config.json").read_text())
    QuantizationConfig.model_validate(wrapped["quantization_config"])


def test_report_is_self_contained(cli_run):
    html = (cli_run[0] / "r.html").read_text()
    scripts = re.findall(r"<script[^>]*>", html)
    assert not any(re.search(r"src\s*=\s*[\"']?(https?:)?//", tag) for tag in scripts)
    assert html.count("Plotly.newPlot(") == 2 + 4  # heatmap, bars, one range plot per tensor
    assert len(re.findall(r"plotly\.js v\d", html)) == 1  # the bundle's banner: embedded exactly once
    assert "encoder.layer.0.output.dense" in html and "runner-up" in html


def test_cli_qparams_equal_python_api_bit_for_bit(cli_run):
    loaded = lab_json.load_file(cli_run[0] / "q.json")
    model = open_model("minilm")
    spec = ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=32)
    config = RunConfig(
        specs={"weight": spec, "input": spec},
        observers=("minmax", "memoryless_minmax", "moving_average_minmax"),
        samples=4,
        seq_len=32,
    )
    layers = ["encoder.layer.0.attention.self.query", "encoder.layer.0.output.dense"]
    analysis = analyse(model, layers, config)
    choices = choose(analysis)
    assert loaded.choices == choices
    for entry in loaded.entries:
        ours = analysis.entry(entry.layer, entry.tensor).result(entry.observer).qparams
        for name in ("scale", "zero_point", "min_val", "max_val"):
            a, b = getattr(ours, name), getattr(entry.qparams, name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32)), (entry.layer, name)


def test_list_shows_observers_formats_and_presets():
    code, out, _ = _main(["list"])
    assert code == 0
    for name in (*ob.available(), *ob.FORMATS, *ob.PRESET_NAMES):
        assert name in out
    assert "averaging_constant=0.01" in out
    assert all(f"{alias:<28} another name of {name}" in out for alias, name in ob.aliases().items())
    mxfp4 = next(line for line in out.splitlines() if line.split()[:1] == ["mxfp4"])
    assert mxfp4.split()[1:5] == ["MX", "E2M1", "block", "32"] and mxfp4.endswith("max 6")


def test_layers_lists_filtered_layers():
    code, out, _ = _main(["layers", "minilm", "--filter", "encoder.layer.0.attention.self.*"])
    assert code == 0
    names = [line.split("\t")[0] for line in out.splitlines()]
    assert names == [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]
    assert "Linear\t384x384" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "no-such-model", "--layers", "x", "--format", "int8", "--out", "x.json"], "no-such-model"),
        (["run", "minilm", "--layers", "nothing.matches.*", "--format", "int8", "--out", "x.json"], "matches no layer"),
        (["run", "minilm", "--layers", "x", "--format", "int8", "--observers", "bogus", "--out", "x.json"], "bogus"),
        (["run", "minilm", "--layers", "x", "--format", "int9", "--out", "x.json"], "int9"),
        (["run", "minilm", "--layers", "x", "--preset", "W9A9", "--out", "x.json"], "W9A9"),
        (["run", "minilm", "--layers", "x", "--out", "x.json"], "--format"),
        (["run", "minilm", "--layers", "x", "--format", "int8", "--kinds", "bias", "--out", "x.json"], "bias"),
        (["run", "minilm", "--layers", "x", "--format", "int8", "--choose-by", "speed", "--out", "x.json"], "speed"),
        (["layers", "minilm", "--filter", "zzz*"], "matches no layer"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(argv, needle):
    code, out, err = _main(argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert needle in err and "Traceback" not in err


def test_python_m_observers_runs_end_to_end(tmp_path):
    out = tmp_path / "q.json"
    argv = ["run", "minilm", "--layers", "encoder.layer.0.attention.self.key", "--preset", "W4A16"]
    argv += ["--observers", "minmax,memoryless_minmax", "--samples", "4", "--seq-len", "32", "--out", str(out)]
    done = subprocess.run([sys.executable, "-m", "observers", *argv], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = lab_json.load_file(out)
    assert [(e.layer, e.tensor) for e in loaded.entries] == [("encoder.layer.0.attention.self.key", "weight")]
    assert loaded.entries[0].spec == ob.preset("W4A16")["weight"]


def test_python_m_bad_input_has_no_traceback():
    argv = ["run", "minilm", "--layers", "x", "--format", "int9", "--out", "x.json"]
    done = subprocess.run([sys.executable, "-m", "observers", *argv], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "unknown dtype 'int9'" in done.stderr


def _entries_without_timings(path) -> list:
    document = json.loads(Path(path).read_text())
    for entry in document["entries"]:
        for record in (entry["chosen"], entry["runner_up"]):
            if record is not None:
                record.pop("seconds")
    return document["entries"]


def test_sequential_capture_gives_the_whole_model_file(tmp_path):
    """Issue 14: layer-by-layer calibration is chosen with --sequential (or forced off with
    --whole-model) and the qparams are the same."""
    argv = ["run", "tiny-llama", "--layers", "re:model.layers.1.*proj", "--format", "int8", "--kinds", "weight,input"]
    argv += ["--observers", "minmax,percentile", "--samples", "4", "--seq-len", "16", "--quiet"]
    assert _main([*argv, "--whole-model", "--out", str(tmp_path / "whole.json")])[0] == 0
    code, _, err = _main([*argv, "--sequential", "--max-memory", "200MB", "--out", str(tmp_path / "seq.json")])
    assert code == 0, err
    assert _entries_without_timings(tmp_path / "seq.json") == _entries_without_timings(tmp_path / "whole.json")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--max-memory", "lots"], "memory size 'lots'"), (["--sequential", "--max-memory", "1MB"], "is smaller than")],
)
def test_bad_memory_budget_is_one_line(tmp_path, extra, needle):
    argv = ["run", "tiny-llama", "--layers", "*q_proj", "--format", "int8", "--kinds", "weight,input", "--quiet"]
    code, _, err = _main([*argv, *extra, "--samples", "2", "--seq-len", "8", "--out", str(tmp_path / "x.json")])
    assert code == 2 and err.count("\n") == 1 and needle in err


def test_observers_take_llm_compressors_names_as_aliases():
    from lab.cli_args import build_parser, settings_from_args

    args = build_parser().parse_args(
        ["run", "minilm", "--layers", "x", "--format", "int4", "--observers", "memoryless_mse,static_minmax,mse_grid"]
        + ["--out", "o.json"]
    )
    assert settings_from_args(args).observers == ("mse_grid", "minmax")


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "tiny-llama", "--layers", "*down_proj", "--out", "{missing}/x.json"],
        ["run", "tiny-llama", "--layers", "*down_proj", "--out", "{tmp}/x.json", "--report", "{missing}/r.html"],
        ["allocate", "tiny-llama", "--out", "{missing}/a.json"],
        ["evaluate", "tiny-llama", "--choices", "{tmp}/x.json", "--out", "{missing}/e.json"],
        ["export", "{tmp}/x.json", "--model", "tiny-llama", "--recipe", "{missing}/recipe.yaml"],
    ],
)
def test_a_file_in_a_missing_folder_is_refused_before_anything_runs(argv, tmp_path, monkeypatch):
    """A run of minutes used to fail at its end, its results lost, when ``--out`` named a folder
    that did not exist; now the flag is refused before any model is opened."""
    import sample_models

    monkeypatch.setattr(sample_models, "open_model", lambda *a, **k: pytest.fail("a model was opened"))
    missing = tmp_path / "no" / "such"
    err = io.StringIO()
    argv = [part.format(missing=missing, tmp=tmp_path) for part in argv]
    assert main(argv, io.StringIO(), err) == 2
    message = err.getvalue()
    assert message.count("\n") == 1 and f"the folder {missing} does not exist" in message, message
