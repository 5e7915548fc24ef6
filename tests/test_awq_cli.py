"""``python -m observers run ... --awq`` (issue 41): the AWQ table printed and written beside the run's
JSON, and every bad input one line with nothing written."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from helpers import save_checkpoint, tiny_llama
from safetensors import safe_open

import observers as ob
import sample_models
from lab.awq.mappings import NOT_A_DECODER
from lab.awq.search import Variant
from lab.cli import main

BASE = ("--format", "int4", "--strategy", "group", "--group-size", "16", "--samples", "4", "--seq-len", "32")


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_cli_prints_the_four_ways_and_writes_them_beside_the_json(tmp_path) -> None:
    target = tmp_path / "run.json"
    flags = ("--observers", "minmax,mse_grid", "--awq", "--awq-n-grid", "4", "--awq-clip-min", "0.8")
    code, out, err = _cli(
        "run", "tiny-llama", "--layers", r"re:model\.layers\.0\..*", *BASE, *flags, "--out", str(target), "--quiet"
    )
    assert code == 0, err
    assert "# AWQ (n_grid 4, duo scaling on, clip ratios 0.8..1.0 by 0.05" in out
    rows = [line.split("\t") for line in out.splitlines() if line.startswith("model.layers.0.") and "\trtn " in line]
    assert len(rows) == 3 * 2  # three mappings (q/k/v, gate/up, up -> down) x two observers
    for cells in rows:
        assert [c.split(" ")[0] for c in cells[2:]] == ["rtn", "llm-compressor", "observer-in-search", "clip-search"]
        assert all(re.search(r" layer \S+ \[\S+\] clip \S+%$", c) for c in cells[2:]), cells  # held-out in brackets
    assert sum(line.startswith("best\t") for line in out.splitlines()) == 3
    written = json.loads((tmp_path / "run.awq.json").read_text())
    assert written["awq"] == {"n_grid": 4, "duo_scaling": "on", "clip_min": 0.8, "clip_step": 0.05}
    assert written["observers"] == ["minmax", "mse_grid"] and len(written["mappings"]) == 3
    assert len(written["rows"]) == 3 * 2 * 4
    assert all(r["mapping_error"] >= 0 and r["held_out_error"] >= 0 and r["rank"] >= 1 for r in written["rows"])
    assert target.exists() and f"{tmp_path / 'run.awq.json'}" in out.splitlines()[-1]


def test_the_model_level_effect_is_the_deployed_variants_unless_every_one_is_asked_for(tmp_path) -> None:
    layers = r"re:model\.layers\.0\.mlp\..*"
    flags = ("--observers", "minmax,mse_grid", "--awq", "--awq-n-grid", "3")
    measured = {}
    for extra in (("--awq-variant", "clip-search"), ("--awq-model-level", "all")):
        target = tmp_path / f"{extra[1]}.json"
        code, out, err = _cli("run", "tiny-llama", "--layers", layers, *BASE, *flags, *extra, "--out", str(target))
        assert code == 0, err
        document = json.loads(target.with_name(f"{extra[1]}.awq.json").read_text())
        measured[extra[1]] = {(r["observer"], r["variant"]): r["kl"] for r in document["model"]}
        best = [line.split("\t")[1] for line in out.splitlines() if line.startswith("best model-level\t")]
        assert best == sorted({variant for _, variant in measured[extra[1]]}, key=[str(v) for v in Variant].index)
    assert set(measured["clip-search"]) == {("minmax", "clip-search"), ("mse_grid", "clip-search")}
    assert len(measured["all"]) == 2 * 4
    # the one variant measured alone has the figures it has among all four (up to the last bits a
    # wider stacked pass sums in another order)
    assert all(measured["all"][key] == pytest.approx(kl, rel=1e-4) for key, kl in measured["clip-search"].items())


def test_a_checkpoint_run_layer_by_layer_searches_deploys_and_never_loads_the_model_whole(tmp_path, monkeypatch):
    # --sequential: the analysis and AWQ both walk the blocks one loaded at a time, and so do the
    # model-level effect and the checkpoint's writer
    directory = save_checkpoint(tiny_llama(layers=2), tmp_path / "llama")
    opened = []
    open_model = sample_models.open_model
    monkeypatch.setattr(sample_models, "open_model", lambda *a, **k: opened.append(open_model(*a, **k)) or opened[-1])
    target, written = tmp_path / "run.json", tmp_path / "ck"
    flags = ("--observers", "minmax,mse_grid", "--awq", "--awq-n-grid", "3", "--sequential", "--max-memory", "64MB")
    code, out, err = _cli(
        "run", str(directory), "--layers", r"re:model\.layers\.1\..*", *BASE, *flags, "--out", str(target),
        "--checkpoint", str(written), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert not opened[0]._require_runtime().module.ready  # nothing loaded the whole model
    document = json.loads((tmp_path / "run.awq.json").read_text())
    assert len(document["mappings"]) == 3 and document["deployed"]["variant"] == "llm-compressor"
    # the deployed variant's model-level effect (what the issue asks for), per observer
    assert [(r["observer"], r["variant"]) for r in document["model"]] == [
        ("minmax", "llm-compressor"),
        ("mse_grid", "llm-compressor"),
    ]
    assert (written / "config.json").exists()
    assert "(the other layers float; the deployed variant's, --awq-model-level all for every one)" in out
    assert sum(line.startswith("deploy\tmodel.layers.1.") for line in out.splitlines()) == 3


@pytest.mark.parametrize(("observers", "captured"), [("minmax,imatrix_mse", 2), ("minmax", 0)])
def test_awq_rides_the_analysis_calibration_pass(tmp_path, monkeypatch, observers, captured) -> None:
    # one calibration pass: the analysis's (imatrix_mse takes its inputs' statistics from it), with
    # AWQ riding it; without such an observer the pass is made for AWQ alone, capturing no layer
    from sample_models.model import Model

    passes = []
    capture = Model.capture

    def counted(self, names, *args, **kwargs):
        passes.append((len(names), kwargs.get("tap") is not None))
        return capture(self, names, *args, **kwargs)

    monkeypatch.setattr(Model, "capture", counted)
    layers = r"re:model\.layers\.0\.mlp\.(gate|up)_proj"
    flags = ("--observers", observers, "--awq", "--awq-n-grid", "3")
    code, out, err = _cli("run", "tiny-llama", "--layers", layers, *BASE, *flags, "--out", str(tmp_path / "x.json"))
    assert code == 0, err
    assert passes == [(captured, True)]
    written = json.loads((tmp_path / "x.awq.json").read_text())
    assert written["tokens"] > 0 and len(written["mappings"]) == 1


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("tiny-llama", ["--awq-n-grid", "5"], "--awq-n-grid need --awq"),
        ("tiny-llama", ["--awq-model-level", "all"], "--awq-model-level need --awq"),
        ("tiny-llama", ["--awq", "--awq-model-level", "some"], "invalid choice: 'some'"),
        ("tiny-llama", ["--awq", "--awq-n-grid", "2"], "n_grid must be an integer in [3, 1000], got 2"),
        ("tiny-llama", ["--awq", "--awq-clip-step", "0.9"], "clip_step must be a number in [0.01, 0.5]"),
        ("tiny-llama", ["--awq", "--awq-duo-scaling", "maybe"], "invalid choice: 'maybe'"),
        ("tiny-llama", ["--awq", "--kinds", "input"], "--awq smooths weights"),
        ("tiny-llama", ["--awq", "--transform", "hadamard"], "AWQ searches its scales on the model as it is"),
        ("tiny-llama", ["--awq", "--whole-model"], "AWQ walks the blocks one at a time"),
        ("tiny-llama", ["--awq", "--propagate"], "leave out the quantized propagation"),
        ("tiny-llama", ["--awq", "--group-size", "32"], "down_proj has 688 input columns"),
        ("minilm", ["--awq"], NOT_A_DECODER.format(model="minilm")),
    ],
)
def test_bad_awq_input_is_one_line_and_writes_nothing(tmp_path, model, flags, message) -> None:
    layers = r"re:model\.layers\.0\.mlp\..*" if model == "tiny-llama" else "encoder.layer.0.intermediate.dense"
    target = tmp_path / "x.json"
    code, _, err = _cli("run", model, "--layers", layers, *BASE, *flags, "--out", str(target), "--quiet")
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_with_awq_is_refused(tmp_path) -> None:
    code, _, err = _cli("run", "tiny-llama", "--layers", "all", *BASE, "--awq", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "not a sweep" in err


def test_tiny_moe_runs_the_four_ways_on_its_experts_and_deploys_them_folded_and_packed(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from lab.awq.command import deployed as awq_deployed
    from lab.export import lab_json
    from sample_models import open_model
    from sample_models.layers import expert_of, expert_weight

    target, directory = tmp_path / "moe.json", tmp_path / "ck"
    layers = r"re:model\.layers\.0\.(self_attn\.q_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
    flags = ("--observers", "minmax", "--awq", "--awq-n-grid", "3", "--samples", "2", "--awq-model-level", "all")
    code, out, err = _cli(
        "run", "tiny-moe", "--layers", layers, *BASE, *flags, "--out", str(target), "--checkpoint", str(directory),
        "--quiet",
    )  # fmt: skip
    assert code == 0, err
    rows = [line.split("\t") for line in out.splitlines() if line.startswith("model.layers.0.") and "\trtn " in line]
    assert len(rows) == 4  # q/k/v, the experts' gate/up, up -> down of the routed experts 0 and 1
    assert "gate_proj, up_proj of 4 experts" in rows[1][0]
    assert (
        "# model-level, held-out text, every balance layer quantized by the variant (the other layers float)\n" in out
    )
    assert sum(line.startswith("best model-level\t") for line in out.splitlines()) == 4  # experts included, all four
    assert "deploy\tAWQ llm-compressor" in out
    # The experts are packed one projection per expert, as transformers saves Mixtral
    # (block_sparse_moe.experts.<e>.w1/w3/w2), and load into the fused weights as the lab's
    # quantized folded weights; the router (not chosen) is folded and dense.
    lab_file, deployed = awq_deployed(lab_json.load_file(target), target)
    entries = {e.layer: e for e in lab_file.entries if e.tensor == "weight"}
    model = open_model("tiny-moe")
    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    keys = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    folded = {key.rpartition(".")[2]: deployed.fold(key, model.stored(key)).float() for key in keys}
    fused = {key.rpartition(".")[2]: loaded[key].float() for key in keys}
    experts = [name for name in entries if expert_of(name) is not None]
    assert len(experts) == 12
    for name in experts:
        _, _, expert, projection = expert_of(name)
        entry = entries[name]
        expected = ob.fake_quantize(expert_weight(folded, expert, projection), entry.qparams, entry.spec)
        assert torch.equal(expert_weight(fused, expert, projection), expected), name
    assert not torch.equal(folded["gate_up_proj"], fused["gate_up_proj"])  # quantized, not the dense weight
    weights = {key for part in directory.glob("*.safetensors") for key in safe_open(part, "pt").keys()}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight_packed" in weights
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in weights)
    assert "stays dense" not in err


def test_a_moe_stored_one_projection_per_expert_deploys_its_experts_into_their_stored_tensors(tmp_path) -> None:
    """tiny-moe as transformers saves a hub Mixtral (``block_sparse_moe.experts.<e>.w1``/``w3``/``w2``, the
    router ``block_sparse_moe.gate``): ``run --awq`` on its experts, chosen by the names it lists (where
    they are stored), searches them, folds the scales into the stored per-expert tensors, the router and
    the norm, and packs every expert; transformers loads each fused expert weight equal to the lab's
    quantized folded weight, and the router and the norm as folded."""
    from transformers import AutoModelForCausalLM

    from lab.awq.command import deployed as awq_deployed
    from lab.export import lab_json
    from sample_models import open_model
    from sample_models.builtin import build_tiny_moe

    source = save_checkpoint(build_tiny_moe(), tmp_path / "moe")
    target, directory = tmp_path / "moe.json", tmp_path / "ck"
    layers = r"re:model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]"
    flags = ("--observers", "minmax", "--awq", "--awq-n-grid", "3", "--samples", "2")
    code, out, err = _cli(
        "run", str(source), "--layers", layers, *BASE, *flags, "--out", str(target), "--checkpoint", str(directory),
        "--quiet",
    )  # fmt: skip
    assert code == 0, err
    assert "deploy\tmodel.layers.0.post_attention_layernorm → gate_proj, up_proj of 4 experts" in out
    lab_file, deployed = awq_deployed(lab_json.load_file(target), target)
    assert deployed.stored_keys["model.layers.0.mlp.gate.weight"] == "model.layers.0.block_sparse_moe.gate.weight"
    model = open_model(str(source))
    loaded = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    experts = {e.layer: e for e in lab_file.entries if e.tensor == "weight"}
    assert len(experts) == 24 and all(".block_sparse_moe.experts." in name for name in experts)
    for name, entry in experts.items():
        _, _, block, _, _, expert, projection = name.split(".")
        folded = deployed.fold(f"{name}.weight", model.stored(f"{name}.weight")).float()
        fused = loaded[f"model.layers.{block}.mlp.experts.{'down_proj' if projection == 'w2' else 'gate_up_proj'}"]
        half = fused.shape[1] // 2
        got = {"w1": fused[int(expert), :half], "w3": fused[int(expert), half:], "w2": fused[int(expert)]}[projection]
        assert torch.equal(got.float(), ob.fake_quantize(folded, entry.qparams, entry.spec)), name
    for module, stored in [
        ("model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight"),
        ("model.layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ]:
        folded = deployed.fold(stored, model.stored(stored))
        assert torch.equal(loaded[module], folded) and not torch.equal(folded, model.stored(stored)), module
    weights = {key for part in directory.glob("*.safetensors") for key in safe_open(part, "pt").keys()}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in weights


def test_awq_then_gptq_counts_experts_chosen_by_their_stored_names_as_chosen(tmp_path) -> None:
    """Every expert of block 0 of a hub-layout MoE chosen by the names the model lists (where they are
    stored): AWQ then GPTQ does not ask for them again by their modules' names; what stops the run is
    the analysis's own line, that a stored-only name has no activations to capture for GPTQ."""
    from sample_models.builtin import build_tiny_moe

    source = save_checkpoint(build_tiny_moe(), tmp_path / "moe")
    layers = r"re:model\.layers\.0\.block_sparse_moe\.experts\.\d+\.w[123]"
    flags = ("--observers", "minmax", "--awq", "--awq-n-grid", "3", "--gptq", "--samples", "2")
    code, _, err = _cli(
        "run", str(source), "--layers", layers, *BASE, *flags, "--out", str(tmp_path / "x.json"), "--checkpoint",
        str(tmp_path / "ck"), "--quiet",
    )  # fmt: skip
    assert code == 2 and "to --layers" not in err, err
    assert "is not a module of the loaded MixtralForCausalLM" in err and err.count("\n") == 1


def test_a_deployment_that_cannot_be_made_is_said_and_never_exported(tmp_path, monkeypatch) -> None:
    from lab.awq import deploy
    from lab.awq.command import deployed
    from lab.export import lab_json

    def refuse(*args, **kwargs):
        raise ValueError("the folded weight has no qparams")

    monkeypatch.setattr(deploy, "of_run", refuse)
    target = tmp_path / "x.json"
    layers = r"re:model\.layers\.0\.mlp\.(gate|up)_proj"
    flags = ("--observers", "minmax", "--awq", "--awq-n-grid", "3")
    code, out, err = _cli("run", "tiny-llama", "--layers", layers, *BASE, *flags, "--out", str(target), "--quiet")
    assert code == 0, err
    assert "deploy\tnot deployable: the folded weight has no qparams" in out
    with pytest.raises(ValueError, match="the folded weight has no qparams"):
        deployed(lab_json.load_file(target), target)
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", layers, *BASE, *flags, "--out", str(target), "--recipe",
        str(tmp_path / "r.yaml"), "--quiet",
    )  # fmt: skip
    assert code == 2 and "the folded weight has no qparams" in err and not (tmp_path / "r.yaml").exists()


def test_the_search_is_kept_when_the_run_fails_after_the_pass_and_is_never_deployed(tmp_path, monkeypatch) -> None:
    # AWQ rides the analysis's calibration pass; once its last mapping is searched its document is
    # written, so a run that fails afterwards (here: writing x.json) keeps it, tied to no x.json
    import lab.export.lab_json

    def fail(*args, **kwargs):
        raise ValueError("the analysis stopped")

    monkeypatch.setattr(lab.export.lab_json, "save_file", fail)
    target = tmp_path / "x.json"
    layers = r"re:model\.layers\.0\.mlp\.(gate|up)_proj"
    flags = ("--observers", "minmax", "--awq", "--awq-n-grid", "3")
    code, _, err = _cli("run", "tiny-llama", "--layers", layers, *BASE, *flags, "--out", str(target), "--quiet")
    assert code == 2 and "the analysis stopped" in err and not target.exists()
    kept = json.loads((tmp_path / "x.awq.json").read_text())
    assert len(kept["rows"]) == 4 and kept["deployed"] is not None and kept["lab_file"] is None
