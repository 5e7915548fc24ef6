"""Export refuses activation qparams for tensors that saw no calibration tokens (issue 8)."""

import io
import json
import zipfile

import pytest
import torch

import observers as ob
from lab import results
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.model_facts import ModelFacts
from lab.analyse.run_config import RunConfig
from lab.export import compressed_tensors, lab_json
from lab.results import choose


def _analysis() -> Analysis:
    spec = ob.QuantSpec("int8")
    config = RunConfig(specs={"weight": spec, "input": spec}, observers=("minmax",))
    w = torch.randn(8, 16)
    seen = torch.randn(5, 16)
    never_routed = torch.empty(0, 16)
    entries = [
        TensorAnalysis("experts.0", "weight", spec, w, ob.run_suite(w, spec, ["minmax"])),
        TensorAnalysis("experts.0", "input", spec, seen, ob.run_suite(seen, spec, ["minmax"], kind="activation")),
        TensorAnalysis(
            "experts.1", "input", spec, never_routed, ob.run_suite(never_routed, spec, ["minmax"], kind="activation")
        ),
    ]
    return Analysis(ModelFacts({"kind": "builtin", "name": "test"}), config, entries)


def test_zero_token_tensor_has_no_qparams_and_is_listed():
    analysis = _analysis()
    assert [(e.layer, e.tensor) for e in results.uncalibrated(analysis)] == [("experts.1", "input")]
    assert analysis.entry("experts.1", "input").results[0].error is not None
    assert ("experts.1", "input") not in choose(analysis)


def test_json_export_refuses_then_records_with_opt_in():
    analysis = _analysis()
    choices = choose(analysis)
    with pytest.raises(ValueError, match=r"no calibration tokens:\n  - experts.1 input"):
        lab_json.save(analysis, choices)
    document = json.loads(lab_json.save(analysis, choices, allow_uncalibrated=True))
    assert document["uncalibrated"] == [{"layer": "experts.1", "tensor": "input", "num_observed_tokens": 0}]
    assert lab_json.schema_problems(document) == []
    assert {(e["layer"], e["tensor"]) for e in document["entries"]} == {("experts.0", "weight"), ("experts.0", "input")}


def test_compressed_tensors_export_refuses_then_notes(tmp_path):
    analysis = _analysis()
    choices = choose(analysis)
    with pytest.raises(ValueError, match="allow_uncalibrated"):
        compressed_tensors.save_file(analysis, choices, tmp_path)
    result = compressed_tensors.save_file(analysis, choices, tmp_path, allow_uncalibrated=True)
    assert any("experts.1 input: saw no calibration tokens" in note for note in result.notes)
    assert "experts.1.input_scale" not in result.tensors
    assert "experts.0.input_scale" in result.tensors


def test_zip_export_refuses_unless_opted_in():
    analysis = _analysis()
    choices = choose(analysis)
    with pytest.raises(ValueError, match="no calibration tokens"):
        compressed_tensors.save(analysis, choices)
    with zipfile.ZipFile(io.BytesIO(compressed_tensors.save(analysis, choices, allow_uncalibrated=True))) as archive:
        notes = archive.read("observer_lab_notes.txt").decode()
    assert "experts.1 input" in notes


UNROUTED = r"re:model\.layers\.0\.mlp\.experts\.3\..*"
"""tiny-moe's expert 3 of block 0: the router sends it none of the default calibration tokens."""
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
UNROUTED_LAYERS = [f"model.layers.0.mlp.experts.3.{p}" for p in PROJECTIONS]
LAYER_0_EXPERTS = [f"model.layers.0.mlp.experts.{i}.{p}" for i in range(4) for p in PROJECTIONS]
NO_TOKENS = "no tokens observed at its input (an expert the router never chose?)"
UNWEIGHTED = "; its weight observers that take input statistics ran unweighted"


def test_weights_only_run_gives_an_unrouted_expert_no_input_statistic():
    """Each layer is finished once, the routed expert with the importance of its inputs, the unrouted
    one with none (imatrix_mse runs unweighted) and a warning saying why."""
    from lab.analyse.pipeline import analyse
    from sample_models import open_model

    routed, unrouted = "model.layers.0.mlp.experts.0.up_proj", "model.layers.0.mlp.experts.3.up_proj"
    weight = ob.preset("W4A16")["weight"]
    config = RunConfig(specs={"weight": weight}, observers=("imatrix_mse",), samples=4, seq_len=32)
    with pytest.warns(UserWarning, match="imatrix_mse got no importance"):
        analysis = analyse(open_model("tiny-moe"), [routed, unrouted], config)
    assert analysis.keys() == [(routed, "weight"), (unrouted, "weight")]
    assert isinstance(analysis.entry(routed, "weight").results[0].knobs["importance"], torch.Tensor)
    assert analysis.entry(unrouted, "weight").results[0].knobs["importance"] is None
    assert all(e.results[0].qparams is not None for e in analysis.entries)
    assert [w for w in analysis.warnings if "no tokens observed" in w] == [f"{unrouted}: {NO_TOKENS}{UNWEIGHTED}"]


def _run_cli(*flags: str, out: str, layers: str = UNROUTED) -> tuple[int, str]:
    """``python -m observers run tiny-moe --layers LAYERS FLAGS --out OUT`` in process: exit code, stderr."""
    from lab.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    code = main(["run", "tiny-moe", "--layers", layers, *flags, "--out", out, "--quiet"], stdout, stderr)
    return code, stderr.getvalue()


@pytest.mark.parametrize(
    "flags",
    [
        ("--preset", "W4A16"),
        ("--preset", "NVFP4A16"),
        ("--preset", "FP8", "--allow-uncalibrated"),
        ("--format", "int4", "--strategy", "group", "--group-size", "32"),
    ],
    ids=["W4A16", "NVFP4A16", "FP8", "int4-group32"],
)
def test_run_on_an_expert_no_token_reaches_writes_its_weights_and_says_so(tmp_path, flags):
    """The statistic-weighted weight observers of an unrouted expert get no input statistic and run
    unweighted; the run writes every weight and says, a line per layer, that no token came."""
    target = tmp_path / "expert.json"
    with pytest.warns(UserWarning, match="running unweighted"):
        code, err = _run_cli(*flags, out=str(target))
    assert code == 0, err
    assert "Traceback" not in err
    written = lab_json.load_file(target)
    weights = {e.layer: e.qparams.scale for e in written.entries if e.tensor == "weight"}
    # FP8's static input scales are one per fused MoE kernel: every expert of the layer comes with expert 3
    assert sorted(weights) == sorted(LAYER_0_EXPERTS if "FP8" in flags else UNROUTED_LAYERS)
    for scale in weights.values():
        assert scale.numel() > 0 and bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    for layer in UNROUTED_LAYERS:
        assert f"warning: {layer}: {NO_TOKENS}{UNWEIGHTED}\n" in err
    if "FP8" in flags:  # the inputs of experts 2 and 3 saw nothing: recorded as uncalibrated, without qparams
        uncalibrated = json.loads(target.read_text())["uncalibrated"]
        assert {u["layer"] for u in uncalibrated} == {e for e in LAYER_0_EXPERTS if ".experts.2." in e} | set(
            UNROUTED_LAYERS
        )


def test_fp8_run_on_an_unrouted_expert_refuses_its_inputs_in_one_line(tmp_path):
    """FP8's inputs are static: qparams for an expert that saw no token would be made up, so the run
    refuses them in one line naming the flag that records them as uncalibrated."""
    with pytest.warns(UserWarning, match="running unweighted"):
        code, err = _run_cli("--preset", "FP8", out=str(tmp_path / "expert.json"))
    assert code == 2
    assert "Traceback" not in err
    refusal = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(refusal) == 1 and "saw no calibration tokens" in refusal[0] and "--allow-uncalibrated" in refusal[0]
    assert not (tmp_path / "expert.json").exists()


def test_a_sweep_files_the_no_token_warning_under_its_expert(tmp_path):
    """A sweep (``--chunk``) keeps a unit's warnings with the unit: the unrouted expert's line
    reaches its output as a run's does."""
    experts = r"re:model\.layers\.0\.mlp\.experts\..*"
    argv = ["--preset", "W4A16", "--observers", "memoryless_minmax,imatrix_mse", "--samples", "4", "--seq-len", "32"]
    with pytest.warns(UserWarning, match="running unweighted"):
        code, err = _run_cli(*argv, "--chunk", "3", layers=experts, out=str(tmp_path / "sweep.json"))
    assert code == 0, err
    flagged = [line for line in err.splitlines() if NO_TOKENS in line]
    unrouted = [f"model.layers.0.mlp.experts.{e}.{p}" for e in (2, 3) for p in ("gate_proj", "up_proj", "down_proj")]
    assert flagged == [f"warning: {layer}: {NO_TOKENS}{UNWEIGHTED}" for layer in unrouted]
