"""The CLI's road from a choice to deployment: ``run --choose GLOB=OBSERVER``, ``--checkpoint``
and ``--recipe`` on ``run``, and ``export CHOICES --model MODEL`` for a saved file; bad input is
one line, exit 2, and nothing written."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from lab.cli import main

ATTENTION_OUT = "encoder.layer.0.attention.output.dense"  # no server fuses it with another layer
FFN = "encoder.layer.0.intermediate.dense"
RUN = ["run", "minilm", "--layers", f"{ATTENTION_OUT},{FFN}", "--kinds", "weight", "--format", "int4"]
RUN += ["--strategy", "group", "--group-size", "32", "--observers", "minmax,mse_grid", "--quiet"]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """One run that overrides both layers' choices and writes the JSON, a checkpoint and a recipe."""
    folder = tmp_path_factory.mktemp("deploy")
    argv = [*RUN, "--choose", "*attention.output*=minmax", "--choose", "*intermediate*=mse_grid"]
    argv += ["--out", str(folder / "c.json")]
    argv += ["--checkpoint", str(folder / "ckpt"), "--recipe", str(folder / "recipe.yaml")]
    code, out, err = _cli(argv)
    assert code == 0, err
    return folder, out


def test_choose_overrides_the_best_observer_per_layer(chosen):
    folder, out = chosen
    entries = {e["layer"]: e["chosen"]["observer"] for e in json.loads((folder / "c.json").read_text())["entries"]}
    assert entries == {ATTENTION_OUT: "minmax", FFN: "mse_grid"}
    assert f"{ATTENTION_OUT}\tweight\tminmax" in out and f"{FFN}\tweight\tmse_grid" in out
    assert "ckpt" in out.splitlines()[-1] and "recipe.yaml" in out.splitlines()[-1]


def test_run_writes_a_checkpoint_and_a_recipe_with_a_group_per_observer(chosen):
    folder, _ = chosen
    config = json.loads((folder / "ckpt" / "config.json").read_text())["quantization_config"]
    by_observer = {g["weights"]["observer"]: g["targets"] for g in config["config_groups"].values()}
    assert by_observer == {"static_minmax": [ATTENTION_OUT], "memoryless_mse": [FFN]}
    stage = yaml.safe_load((folder / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    groups = stage["QuantizationModifier"]["config_groups"].values()
    assert {g["weights"]["observer"]: g["targets"] for g in groups} == by_observer


def test_export_of_the_saved_file_writes_the_same_checkpoint_config(chosen, tmp_path):
    folder, _ = chosen
    code, out, err = _cli(["export", str(folder / "c.json"), "--model", "minilm", "--checkpoint", str(tmp_path / "x")])
    assert code == 0, err
    assert json.loads((tmp_path / "x" / "config.json").read_text()) == json.loads(
        (folder / "ckpt" / "config.json").read_text()
    )
    assert out.strip() == f"wrote {tmp_path / 'x'}"


def _refused(argv: list[str], *phrases: str) -> str:
    code, _, err = _cli(argv)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for phrase in phrases:
        assert phrase in err, err
    return err


def test_export_refuses_a_non_empty_directory_without_overwrite(chosen, tmp_path):
    folder, _ = chosen
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mine.txt").write_text("keep")
    argv = ["export", str(folder / "c.json"), "--model", "minilm", "--checkpoint", str(tmp_path / "x")]
    _refused(argv, "not empty", "--overwrite")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["mine.txt"]
    code, _, err = _cli([*argv, "--overwrite"])
    assert code == 0, err and (tmp_path / "x" / "config.json").is_file()


def test_export_refuses_a_file_made_for_another_model_naming_both(chosen, tmp_path):
    folder, _ = chosen
    argv = ["export", str(folder / "c.json"), "--model", "tiny-llama", "--recipe", str(tmp_path / "r.yaml")]
    _refused(argv, "'minilm'", "'tiny-llama'")
    assert not (tmp_path / "r.yaml").exists()


def test_export_needs_a_checkpoint_or_a_recipe(chosen):
    folder, _ = chosen
    _refused(["export", str(folder / "c.json"), "--model", "minilm"], "--checkpoint", "--recipe")


@pytest.mark.parametrize(
    ("rule", "phrase"),
    [
        ("*attention.output*=percentile", "percentile was not run"),
        ("nothing.here=minmax", "no analysed layer matches 'nothing.here'"),
        ("*attention.output*", "expected GLOB=OBSERVER"),
    ],
)
def test_a_bad_choose_rule_is_one_line_and_writes_nothing(tmp_path, rule, phrase):
    _refused([*RUN, "--choose", rule, "--out", str(tmp_path / "c.json")], phrase)
    assert list(tmp_path.iterdir()) == []
