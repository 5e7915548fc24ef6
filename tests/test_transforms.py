"""Ranges under transforms (``observers.transforms``, ``RunConfig.transform``, ``--transform``):
a Hadamard rotation or SmoothQuant leaves the float layer output unchanged, moves the outliers,
and the run observes the transformed tensors."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.results import layer_output_rows
from observers.transforms import hadamard_block, rotate, smoothing_scales, sylvester_hadamard
from sample_models import open_model

LAYER = "model.layers.0.mlp.down_proj"
INT8 = ob.QuantSpec(dtype="int8")


@pytest.mark.parametrize("size, block", [(64, 64), (96, 32), (7, 1), (1536, 512)])
def test_the_rotation_is_orthogonal_block_diagonal_and_keeps_the_layer_output(size, block):
    assert hadamard_block(size) == block
    torch.manual_seed(0)
    x, w = torch.randn(20, size), torch.randn(12, size)
    rotation = rotate(torch.eye(size), seed=3)
    assert torch.allclose(rotation @ rotation.T, torch.eye(size), atol=1e-5)
    assert torch.allclose(rotate(x, 3) @ rotate(w, 3).T, x @ w.T, atol=1e-3)
    assert not torch.allclose(rotate(x, 3), rotate(x, 4))  # the seed draws the signs


def test_sylvester_matrices_are_hadamard():
    h = (sylvester_hadamard(8) * 8**0.5).round()
    assert torch.allclose(sylvester_hadamard(8) * 8**0.5, h)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, 8 * torch.eye(8))
    with pytest.raises(ValueError, match="power-of-two"):
        sylvester_hadamard(12)


def test_smoothquant_scales_follow_the_formula_and_keep_the_output():
    x = torch.tensor([[1.0, -8.0], [2.0, 0.5]])
    w = torch.tensor([[0.5, 1.0], [-2.0, 0.25]])
    scales = smoothing_scales(x, w, alpha=0.5)
    assert torch.allclose(scales, torch.tensor([(2.0**0.5) / (2.0**0.5), (8.0**0.5) / (1.0**0.5)]))
    new_w, new_x = ob.transform_layer(ob.TransformSpec("smoothquant"), w, x)
    assert torch.allclose(new_x @ new_w.T, x @ w.T)
    assert float(new_x.abs().max()) < 8.0  # the outlier channel moved into the weight


def test_a_rotation_spreads_an_outlier_channel_so_min_max_int8_loses_less():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 5] *= 60.0  # one outlier channel, as LLM activations have
    plain = ob.run_one("minmax", x, INT8, "activation").metrics["sqnr_db"]
    rotated = ob.run_one("minmax", rotate(x, 0), INT8, "activation").metrics["sqnr_db"]
    assert rotated > plain + 10


@pytest.mark.parametrize("kind", ["hadamard", "smoothquant"])
def test_a_run_through_a_transform_observes_what_the_transformed_layer_sees(kind):
    model = open_model("tiny-llama")
    specs = {"weight": INT8, "input": INT8}
    calibration = {"samples": 4, "seq_len": 16}
    plain = analyse(model, [LAYER], RunConfig(specs=specs, observers=("minmax",), **calibration))
    transform = ob.TransformSpec(kind, seed=1, alpha=0.7)
    config = RunConfig(specs=specs, observers=("minmax",), transform=transform, **calibration)
    seen = analyse(model, [LAYER], config)
    w, x = plain.entry(LAYER, "weight").data, plain.entry(LAYER, "input").data
    new_w, new_x = seen.entry(LAYER, "weight").data, seen.entry(LAYER, "input").data
    assert not torch.allclose(new_w, w.float())
    assert torch.allclose(F.linear(new_x, new_w), F.linear(x.float(), w.float()), atol=1e-4)  # float output kept
    assert seen.config.to_dict()["transform"] == transform.to_dict()
    both = layer_output_rows(model, seen, ["minmax"])
    assert (both["sqnr_db"] > 10).all()  # measured against the true float output, not a mismatched one


def test_key_value_states_rotate_per_head_and_smoothquant_leaves_them_with_a_note():
    model = open_model("tiny-llama")
    block = model.attention_blocks()[0]
    base = {"specs": {"kv": ob.QuantSpec(dtype="fp8_e4m3")}, "observers": ("minmax",), "samples": 2, "seq_len": 16}
    plain = analyse(model, [], RunConfig(**base), attention=[block])
    rotated = analyse(model, [], RunConfig(**base, transform=ob.TransformSpec("hadamard")), attention=[block])
    k, new_k = plain.entry(block, "k").data, rotated.entry(block, "k").data
    assert torch.allclose(new_k, rotate(k, 0))
    smoothed = analyse(model, [], RunConfig(**base, transform=ob.TransformSpec("smoothquant")), attention=[block])
    assert torch.equal(smoothed.entry(block, "k").data, k)
    assert any("SmoothQuant does not apply to key/value states" in w for w in smoothed.warnings)


def test_bad_transform_settings_name_the_problem():
    with pytest.raises(ValueError, match="allowed: hadamard, smoothquant"):
        ob.TransformSpec("rotate")
    with pytest.raises(ValueError, match="alpha must be a number in"):
        ob.TransformSpec("smoothquant", alpha=1.5)
    with pytest.raises(ValueError, match="SmoothQuant needs the layer's weight and its captured inputs"):
        ob.transform_layer(ob.TransformSpec("smoothquant"), torch.ones(2, 2), None)
    assert ob.TransformSpec.from_dict(ob.TransformSpec("hadamard", seed=2).to_dict()).seed == 2


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_cli_runs_through_a_transform_and_refuses_bad_input(tmp_path):
    out = tmp_path / "q.json"
    base = ["run", "tiny-llama", "--layers", LAYER, "--format", "int8", "--observers", "minmax", "--quiet"]
    base += ["--kinds", "weight,input", "--samples", "2", "--seq-len", "16"]
    code, _, err = _cli(*base, "--transform", "hadamard", "--transform-seed", "5", "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["config"]["transform"] == {"kind": "hadamard", "seed": 5, "alpha": 0.5}
    code, _, err = _cli(*base, "--transform", "smoothquant", "--alpha", "2", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and "alpha must be a number in [0, 1]" in err
    code, _, err = _cli(
        *base, "--transform", "hadamard", "--compressed-tensors", str(tmp_path / "ct"), "--out", str(out)
    )
    assert code == 2 and "compressed-tensors" in err and err.count("\n") == 1


def test_the_app_runs_through_a_rotation_and_the_ranges_page_shows_both():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from lab import ui

    app = str(Path(__file__).resolve().parents[1] / "app.py")
    at = AppTest.from_file(app, default_timeout=300).run()
    at.switch_page("pages/model.py").run()
    at.multiselect(key="w:layers").set_value(["encoder.layer.0.attention.self.query"])
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    at.switch_page("pages/run.py").run()
    at.multiselect(key="w:observers").set_value(["minmax", "percentile"])
    at.selectbox(key="w:transform").set_value("hadamard").run()
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    ws = at.session_state[ui.WORKSPACE]
    assert ws.analysis.config.transform is None and ws.transformed.config.transform.kind == "hadamard"
    at.switch_page("pages/ranges.py").run()
    assert not at.exception and not at.error
    assert any("Through a Hadamard rotation" in h.value for h in at.subheader)
    assert len(at.get("plotly_chart")) >= 2
