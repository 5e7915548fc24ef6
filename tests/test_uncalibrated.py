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
