"""AWQ deployed (issue 41): ``run --awq --checkpoint --recipe`` folds the chosen variant's scales into
the norms and linears, packs each balance layer's codes on its folded weight, and transformers
loads the directory and computes the lab's chosen model; the recipe puts llm-compressor's
``AWQModifier`` with the exact mappings before the quantizing modifier; each mapping's observer is
the best by an AWQ figure or the one ``--choose`` names; a stale AWQ file is never deployed."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import observers as ob
from lab.awq import deploy
from lab.awq.deploy import AWQDeploy
from lab.awq.run import run_awq
from lab.awq.search import Variant
from lab.awq.table import awq_frame
from lab.cli import main
from lab.export.recipe import AWQ_MODIFIER, MODIFIER, MODIFIER_GROUP, STAGE
from sample_models import open_model

INT4_G16 = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
BLOCK0 = r"re:model\.layers\.0\..*"
BASE = ("--format", "int4", "--strategy", "group", "--group-size", "16", "--samples", "4", "--seq-len", "32")
AWQ = ("--observers", "minmax,mse_grid", "--awq", "--awq-n-grid", "4")


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_llama():
    return open_model("tiny-llama")


@pytest.fixture(scope="module")
def awq_run(tiny_llama):
    observers = {name: {} for name in ("memoryless_minmax", "mse_grid", "imatrix_mse")}
    layers = [f"model.layers.0.{name}" for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")]
    return run_awq(tiny_llama, INT4_G16, observers, ob.AWQSpec(n_grid=4), layers=layers, samples=4, seq_len=32)


@pytest.fixture(scope="module")
def deployed_run(tmp_path_factory):
    """``run --awq --checkpoint --recipe`` on block 0 of tiny-llama, its files."""
    where = tmp_path_factory.mktemp("awq_deploy")
    target, directory, recipe = where / "x.json", where / "ck", where / "recipe.yaml"
    code, out, err = _cli(
        "run", "tiny-llama", "--layers", BLOCK0, *BASE, *AWQ, "--out", str(target), "--checkpoint", str(directory),
        "--recipe", str(recipe), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    document = json.loads((where / "x.awq.json").read_text())
    return {"out": out, "err": err, "document": document, "checkpoint": directory, "recipe": recipe, "json": target}


# ------------------------------------------------------------------------------------------ choosing


def test_each_mapping_takes_the_best_observer_by_the_awq_figure(awq_run) -> None:
    frame = awq_frame(awq_run)
    for figure in ("awq:mapping_error", "awq:held_out_error", "awq:layer_error", "awq:held_out_layer_error"):
        for variant in (Variant.LLM_COMPRESSOR, Variant.CLIP_SEARCH):
            picks = deploy.choose_observers(awq_run, variant, figure)
            column = figure.removeprefix("awq:")
            for mapping, (observer, value) in picks.items():
                rows = frame[(frame["mapping"] == mapping) & (frame["variant"] == str(variant))].dropna(subset=[column])
                assert value == rows[column].min() and observer == rows.loc[rows[column].idxmin(), "observer"]


def test_a_choose_rule_names_a_mappings_observer_and_an_unknown_one_is_refused(awq_run) -> None:
    rules = [("model.layers.0.mlp.*", "mse_grid")]
    picks = deploy.choose_observers(awq_run, Variant.OBSERVER_IN_SEARCH, "awq:mapping_error", rules)
    mlp = [m for m in picks if "mlp" in m]
    assert mlp and all(picks[m] == ("mse_grid", None) for m in mlp)
    with pytest.raises(ValueError, match="percentile has no observer-in-search result"):
        deploy.choose_observers(awq_run, Variant.OBSERVER_IN_SEARCH, "awq:mapping_error", [("*q_proj", "percentile")])
    with pytest.raises(ValueError, match="awq:gptq_error: this run has no such figure"):
        deploy.choose_observers(awq_run, Variant.LLM_COMPRESSOR, "awq:gptq_error")


# ------------------------------------------------------------------------------------------ qparams


def _same_as_searched(run, deployed, variant: Variant, observer: str) -> int:
    """How many balance layers no later mapping divides got the qparams the search judged."""
    checked, smooths = 0, {r.mapping.smooth for r in run.results}
    for result in run.results:
        for name in result.mapping.balance:
            if name in smooths:
                continue
            searched, ours = result.qparams[(variant, observer)][name], deployed.qparams[name]
            assert torch.equal(searched.scale, ours.scale), (name, variant, observer)
            if searched.global_scale is not None:
                assert torch.equal(searched.global_scale, ours.global_scale), name
            checked += 1
    return checked


@pytest.mark.parametrize("variant", [Variant.LLM_COMPRESSOR, Variant.OBSERVER_IN_SEARCH, Variant.CLIP_SEARCH])
@pytest.mark.parametrize("observer", ["memoryless_minmax", "imatrix_mse"])
def test_a_layer_no_later_mapping_divides_deploys_the_searchs_own_qparams(tiny_llama, awq_run, variant, observer):
    # q/k/v, gate and down are balance layers only: their folded weight is the search's W·s, so the deployed
    # qparams are the ones the search judged, the input importance of x/s included
    deployed = deploy.of_run(tiny_llama, awq_run, variant, {r.mapping.name: observer for r in awq_run.results})
    assert _same_as_searched(awq_run, deployed, variant, observer) == 5  # q, k, v, gate, down


@pytest.mark.parametrize("variant", [Variant.RTN, Variant.LLM_COMPRESSOR, Variant.OBSERVER_IN_SEARCH])
def test_a_folded_weight_the_search_quantized_is_not_observed_again(tiny_llama, awq_run, variant, monkeypatch):
    # a balance layer no later mapping divides folds to the very W·s the search observed (its stored
    # weight's digest is the searched one's): its qparams are read, not found again; observing F
    # anyway (the digests cleared) gives the same, and only the divided layers are observed
    observers = {r.mapping.name: "imatrix_mse" for r in awq_run.results}
    observed: list[int] = []
    real_observe = deploy.observed.observe

    def counting(observer, weight, spec, knobs, apart=1):
        observed.append(weight.shape[0])
        return real_observe(observer, weight, spec, knobs, apart)

    monkeypatch.setattr(deploy.observed, "observe", counting)
    reading = deploy.of_run(tiny_llama, awq_run, variant, observers)
    divided = [n for r in awq_run.results for n in r.mapping.balance if reading.output_scales(n) is not None]
    assert len(observed) == len(divided) == (0 if variant == Variant.RTN else 1)  # up_proj's rows: by down's s
    cleared = copy.copy(awq_run)
    cleared.results = [dataclasses.replace(r, weights={}) for r in awq_run.results]
    observing = deploy.of_run(tiny_llama, cleared, variant, observers)
    assert len(observed) == len(divided) + len(reading.qparams)
    for name, qp in reading.qparams.items():
        assert torch.equal(qp.scale, observing.qparams[name].scale), name
        assert torch.equal(qp.zero_point, observing.qparams[name].zero_point), name


def test_nvfp4_deploys_the_searchs_hessian_qparams_under_one_global_scale(tiny_llama) -> None:
    spec = ob.preset("NVFP4A16")["weight"]
    layers = ["model.layers.0.self_attn.q_proj"]
    run = run_awq(tiny_llama, spec, {"local_hessian": {}}, ob.AWQSpec(n_grid=3), layers=layers, samples=2, seq_len=16)
    for variant in (Variant.LLM_COMPRESSOR, Variant.OBSERVER_IN_SEARCH):
        deployed = deploy.of_run(tiny_llama, run, variant, {r.mapping.name: "local_hessian" for r in run.results})
        assert _same_as_searched(run, deployed, variant, "local_hessian") == 3  # q, k, v
        shared = {float(qp.global_scale) for qp in deployed.qparams.values()}
        assert len(shared) == 1  # q/k/v: one global scale, as vLLM keeps one for the fused linear


def test_a_layer_a_later_mapping_divides_gets_qparams_on_its_folded_weight(tiny_llama, awq_run) -> None:
    observers = {r.mapping.name: "memoryless_minmax" for r in awq_run.results}
    deployed = deploy.of_run(tiny_llama, awq_run, Variant.LLM_COMPRESSOR, observers)
    name = "model.layers.0.mlp.up_proj"
    folded = deployed.fold(f"{name}.weight", tiny_llama.stored(f"{name}.weight"))
    down = next(r for r in awq_run.results if r.mapping.smooth == name)
    gate_up = next(r for r in awq_run.results if name in r.mapping.balance)
    by_hand = (tiny_llama.stored(f"{name}.weight").double() * gate_up.searched.view(1, -1)).float()
    by_hand = (by_hand.double() / down.searched.view(-1, 1)).float()
    assert torch.equal(folded, by_hand)
    expected = ob.run_one("memoryless_minmax", folded, INT4_G16, "weight").qparams
    assert torch.equal(deployed.qparams[name].scale, expected.scale)


def test_the_model_level_weights_fold_once_and_equal_the_deployments_own(tiny_llama, awq_run) -> None:
    # weights_of_run hands its folded weights to model_weights instead of folding them again; the
    # weights must be what the deployment computes from the files, to the bit
    observers = {r.mapping.name: "mse_grid" for r in awq_run.results}
    for variant in (Variant.LLM_COMPRESSOR, Variant.CLIP_SEARCH):
        deployed = deploy.of_run(tiny_llama, awq_run, variant, observers)
        expected = deployed.model_weights(tiny_llama)
        found = deploy.weights_of_run(tiny_llama, awq_run, variant, observers)
        assert sorted(found) == sorted(expected) and "model.layers.0.mlp.up_proj" in found
        assert all(torch.equal(found[name], expected[name]) for name in expected)


def test_a_deployment_round_trips_through_its_record(tiny_llama, awq_run) -> None:
    observers = {r.mapping.name: "imatrix_mse" for r in awq_run.results}
    deployed = deploy.of_run(tiny_llama, awq_run, Variant.CLIP_SEARCH, observers, "awq:held_out_error")
    again = AWQDeploy.from_dict(json.loads(json.dumps(deployed.to_dict())))
    assert (again.variant, again.awq, again.spec, again.chosen_by) == (
        deployed.variant, deployed.awq, deployed.spec, deployed.chosen_by,
    )  # fmt: skip
    for ours, theirs in zip(deployed.mappings, again.mappings, strict=True):
        assert ours.mapping == theirs.mapping and ours.observer == theirs.observer
        assert torch.equal(ours.scales, theirs.scales) and theirs.scales.dtype == torch.float64
    assert all(torch.equal(deployed.qparams[n].scale, again.qparams[n].scale) for n in deployed.qparams)
    with pytest.raises(ValueError, match="AWQ deployment record is malformed"):
        AWQDeploy.from_dict({"variant": "llm-compressor"})


# ------------------------------------------------------------------------------------------ the checkpoint


@pytest.mark.slow
def test_transformers_loads_the_checkpoint_and_computes_the_labs_chosen_model(tiny_llama, deployed_run) -> None:
    deployed = AWQDeploy.from_dict(deployed_run["document"]["deployed"])
    assert deployed.variant == Variant.LLM_COMPRESSOR and deployed.chosen_by == "awq:mapping_error"
    rows = deployed_run["document"]["rows"]
    for m in deployed.mappings:  # the best by the llm-compressor variant's mapping error
        mine = [r for r in rows if r["mapping"] == m.mapping.name and r["variant"] == "llm-compressor"]
        assert m.observer == min(mine, key=lambda r: r["mapping_error"])["observer"]
    dequantized = AutoModelForCausalLM.from_pretrained(
        deployed_run["checkpoint"], quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    state = dequantized.state_dict()
    smooth = [f"{m.mapping.smooth}.weight" for m in deployed.mappings]
    assert any(key.endswith("layernorm.weight") for key in smooth)
    for key in smooth:  # the norms (and up_proj) carry the scales
        stored = tiny_llama.stored(key)
        expected = deployed.fold(key, stored)
        if key.removesuffix(".weight") not in deployed.qparams:
            assert torch.equal(state[key], expected) and not torch.equal(expected, stored), key
    for name, qparams in deployed.qparams.items():  # each balance layer's codes on its folded weight
        folded = deployed.fold(f"{name}.weight", tiny_llama.stored(f"{name}.weight"))
        assert torch.equal(state[f"{name}.weight"], ob.fake_quantize(folded, qparams, deployed.spec)), name
    # the loaded model computes the lab's chosen model: the balance layers as the deployment runs
    # them in the model's coordinates, o_proj as the run chose it
    model = tiny_llama.module()
    expected_model = AutoModelForCausalLM.from_config(model.config)
    expected_model.load_state_dict(model.state_dict())
    entries = {e["layer"]: e for e in json.loads(deployed_run["json"].read_text())["entries"]}
    o_proj = "model.layers.0.self_attn.o_proj"
    with torch.no_grad():
        for name, weight in deployed.model_weights(tiny_llama).items():
            expected_model.get_submodule(name).weight.copy_(weight)
        o_qparams = ob.QParams.from_dict(entries[o_proj]["qparams"])
        layer = expected_model.get_submodule(o_proj)
        layer.weight.copy_(ob.fake_quantize(layer.weight, o_qparams, INT4_G16))
        ids = torch.tensor([list(tiny_llama.calibration_set(None, 1, 64).windows[0])])
        ours, theirs, float_ = (m(input_ids=ids).logits for m in (expected_model, dequantized, model))
    effect = float((ours - float_).abs().max())
    assert effect > 0 and float((ours - theirs).abs().max()) <= 1e-4 * effect
    notes = (deployed_run["checkpoint"] / "observer_lab_checkpoint.txt").read_text()
    assert "AWQ llm-compressor (n_grid 4, duo scaling on): 3 mapping(s) folded" in notes


@pytest.mark.slow
def test_the_recipe_runs_awq_with_the_exact_mappings_before_quantizing(deployed_run) -> None:
    recipe = yaml.safe_load(deployed_run["recipe"].read_text())
    modifiers = recipe[STAGE][MODIFIER_GROUP]
    assert list(modifiers) == [AWQ_MODIFIER, MODIFIER]
    deployed = AWQDeploy.from_dict(deployed_run["document"]["deployed"])
    awq = modifiers[AWQ_MODIFIER]
    assert awq["n_grid"] == 4 and awq["duo_scaling"] is True
    assert awq["mappings"] == [
        {"smooth_layer": m.mapping.smooth, "balance_layers": list(m.mapping.balance)} for m in deployed.mappings
    ]
    groups = modifiers[MODIFIER]["config_groups"].values()
    observer_of = {target: group["weights"]["observer"] for group in groups for target in group["targets"]}
    lc_name = {"minmax": "static_minmax", "mse_grid": "memoryless_mse"}
    for name in deployed.qparams:
        assert observer_of[name] == lc_name[deployed.observer_of(name)], name


def test_another_variant_deploys_its_own_scales_and_the_recipe_says_so(tmp_path) -> None:
    target, recipe = tmp_path / "x.json", tmp_path / "r.yaml"
    flags = ("--awq-variant", "observer-in-search", "--choose-by", "awq:held_out_error", "--awq-clip-min", "0.9")
    code, out, err = _cli(
        "run", "tiny-llama", "--layers", r"re:model\.layers\.0\.mlp\..*", *BASE, *AWQ, *flags, "--out", str(target),
        "--recipe", str(recipe), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    deployed = AWQDeploy.from_dict(json.loads((tmp_path / "x.awq.json").read_text())["deployed"])
    assert deployed.variant == Variant.OBSERVER_IN_SEARCH and deployed.chosen_by == "awq:held_out_error"
    assert "deploy\tAWQ observer-in-search" in out
    assert "its oneshot of this recipe gives the llm-compressor variant's scales" in recipe.read_text()


def test_rtn_deploys_the_analysis_and_a_stale_awq_file_is_never_deployed(tmp_path) -> None:
    from lab.awq.command import deployed
    from lab.export import lab_json

    target = tmp_path / "x.json"
    layers = ("--layers", r"re:model\.layers\.0\.mlp\.(gate|up)_proj")
    code, _, err = _cli("run", "tiny-llama", *layers, *BASE, *AWQ, "--out", str(target), "--quiet")
    assert code == 0, err
    lab_file, found = deployed(lab_json.load_file(target), target)
    assert found is not None and {e.observer for e in lab_file.entries} == {m.observer for m in found.mappings}
    code, _, err = _cli("run", "tiny-llama", *layers, *BASE, "--observers", "minmax", "--out", str(target), "--quiet")
    assert code == 0, err and (tmp_path / "x.awq.json").exists()
    assert deployed(lab_json.load_file(target), target)[1] is None
    code, _, err = _cli("run", "tiny-llama", *layers, *BASE, *AWQ, "--awq-variant", "rtn", "--out", str(target))
    assert code == 0, err
    assert json.loads((tmp_path / "x.awq.json").read_text())["deployed"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--awq-variant", "clip-search"], "--awq-variant need --awq"),
        (
            ["--choose-by", "awq:mapping_error"],
            "--choose-by awq:mapping_error ranks observers under AWQ: it needs --awq",
        ),
        (["--awq", "--awq-variant", "best"], "invalid choice: 'best'"),
        (["--awq", "--choose-by", "awq:loss"], "unknown metric 'awq:loss'"),
        (["--awq", "--choose-by", "awq:gptq_error"], "awq:gptq_error ranks observers under AWQ then GPTQ"),
        (
            ["--awq", "--choose-by", "awq:gptq_held_out_error"],
            "awq:gptq_held_out_error ranks observers under AWQ then GPTQ",
        ),
    ],
)
def test_bad_deployment_input_is_one_line_and_writes_nothing(tmp_path, flags, message) -> None:
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", BLOCK0, *BASE, *flags, "--out", str(tmp_path / "x.json"), "--quiet"
    )
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_awq_then_gptq_runs_each_balance_layers_gptq_on_its_folded_weight(tiny_llama, tmp_path) -> None:
    # as llm-compressor composes AWQModifier then GPTQModifier: GPTQ sees the smoothed model, whose
    # balance layers' inputs are x/s, so its Hessian is diag(1/s)·H·diag(1/s)
    from lab.gptq import hessians
    from lab.gptq.layer import gptq_weight

    target, directory, recipe = tmp_path / "x.json", tmp_path / "ck", tmp_path / "r.yaml"
    layers = r"re:model\.layers\.0\.(self_attn\.(q|k|v)_proj|mlp\..*)"
    code, out, err = _cli(
        "run", "tiny-llama", "--layers", layers, *BASE, *AWQ, "--gptq", "--choose-by", "awq:gptq_error", "--out",
        str(target), "--checkpoint", str(directory), "--recipe", str(recipe), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    cells = next(line for line in out.splitlines() if "\tllm-compressor " in line).split("\t")
    assert all(re.search(r" gptq \S+ #\d \[\S+ #\d\]", c) for c in cells[2:]), cells  # held-out in brackets
    document = json.loads((tmp_path / "x.awq.json").read_text())
    deployed = AWQDeploy.from_dict(document["deployed"])
    assert deployed.chosen_by == "awq:gptq_error"
    for m in deployed.mappings:  # each mapping's observer: the least error once GPTQ follows AWQ
        mine = [r for r in document["rows"] if r["mapping"] == m.mapping.name and r["variant"] == "llm-compressor"]
        assert m.observer == min(mine, key=lambda r: r["gptq_error"])["observer"]
    gptq = ob.GPTQSpec.from_dict(json.loads(target.read_text())["config"]["gptq"])
    kept = hessians.read(hessians.directory_for(target))
    dequantized = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).state_dict()
    changed = 0
    for name, qparams in deployed.qparams.items():
        folded = deployed.fold(f"{name}.weight", tiny_llama.stored(f"{name}.weight"))
        inverse = 1.0 / deployed.input_scales(name).double()
        smoothed = (kept(name).double() * inverse.unsqueeze(0) * inverse.unsqueeze(1)).float()
        done = gptq_weight(folded, smoothed, deployed.spec, gptq, deployed.observer_of(name), qparams, {})
        assert torch.equal(dequantized[f"{name}.weight"], done.weight), name
        changed += not torch.equal(done.weight, ob.fake_quantize(folded, qparams, deployed.spec))
    assert changed == len(deployed.qparams)  # GPTQ moved codes in every balance layer
    modifiers = list(yaml.safe_load(recipe.read_text())[STAGE][MODIFIER_GROUP])
    assert modifiers == [AWQ_MODIFIER, "GPTQModifier"]


@pytest.mark.slow
def test_an_nvfp4_awq_checkpoint_loads_in_vllm_as_the_lab_computed_it(tiny_llama, tmp_path) -> None:
    # vLLM fuses q/k/v and gate/up and keeps one NVFP4 global scale for each (the max): the deployed
    # qparams on the folded weights share it, so no shard is read against another's global scale
    import vllm_loader

    target, directory = tmp_path / "x.json", tmp_path / "ck"
    layers = r"re:model\.layers\.0\.(self_attn\.(q|k|v)_proj|mlp\..*)"
    flags = ("--preset", "NVFP4A16", "--kinds", "weight", "--observers", "memoryless_minmax", "--awq")
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", layers, *flags, "--awq-n-grid", "3", "--samples", "2", "--seq-len", "16",
        "--out", str(target), "--checkpoint", str(directory), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    deployed = AWQDeploy.from_dict(json.loads((tmp_path / "x.awq.json").read_text())["deployed"])
    served, alone = vllm_loader.served(directory), vllm_loader.own(directory)
    assert set(served) == set(deployed.qparams)
    for name, qparams in deployed.qparams.items():
        folded = deployed.fold(f"{name}.weight", tiny_llama.stored(f"{name}.weight"))
        expected = ob.fake_quantize(folded.float(), qparams, deployed.spec)
        assert torch.equal(served[name].weight, expected), name
        assert torch.equal(served[name].weight, alone[name].weight), f"{name} is rescaled where it is served"
    qkv = [n for n in deployed.qparams if "self_attn" in n]
    assert len({float(deployed.qparams[n].global_scale) for n in qkv}) == 1


@pytest.mark.slow
def test_export_deploys_the_saved_run_with_its_awq_as_run_did(deployed_run, tmp_path) -> None:
    from safetensors.torch import load_file

    again = tmp_path / "again"
    code, _, err = _cli("export", str(deployed_run["json"]), "--model", "tiny-llama", "--checkpoint", str(again))
    assert code == 0, err
    ours, theirs = (
        load_file(str(again / "model.safetensors")),
        load_file(str(deployed_run["checkpoint"] / "model.safetensors")),
    )
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_awq_then_gptq_deploys_only_mappings_whose_balance_layers_were_all_analysed(tmp_path) -> None:
    # the checkpoint's GPTQ takes each balance layer's Hessian from the analysis
    q_proj = "model.layers.0.self_attn.q_proj"
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", q_proj, *BASE, *AWQ, "--gptq", "--out", str(tmp_path / "x.json"),
        "--checkpoint", str(tmp_path / "ck"), "--quiet",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1
    assert "add model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj to --layers" in err
    assert list(tmp_path.iterdir()) == []
