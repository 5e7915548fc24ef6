"""Budgeted allocation (issue 34): schemes and budgets as written, the allocation from scores (fused
layers sharing a scheme, the budget kept, the frontier and where prediction and measurement part),
the held-out text split in two (scores on one part, the frontier measured on the other and in
sample), and ``python -m observers allocate`` end to end on MiniLM: scores run on the scoring part
only, the measured figures are the measuring part's, the mixed checkpoint loads in transformers
with the chosen fake-quantized weights, its bytes are the costs the budget counted, the recipe
gives every layer its scheme and observer, and each bad input (a held-out text too short to split
included) is one line with nothing written."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml
from safetensors import safe_open

import observers as ob
from lab.allocate import frontier as fr
from lab.allocate.held_out import HeldOut
from lab.allocate.schemes import NONE, Budget, parse_budget, parse_budgets, parse_scheme, parse_schemes
from lab.allocate.score import Scores
from lab.cli import main
from lab.effect.evaluate import Evaluator, from_lab_file
from lab.export import lab_json
from lab.export.recipe import lc_observer
from lab.runtime.fusion import fused_groups
from lab.scheme.cost import LayerSizes
from lab.scheme.stored import ct_args
from sample_models.effect import EffectRunner, held_out_texts, sentences, split_held_out

# ---------------------------------------------------------------- schemes and budgets


def test_schemes_are_presets_none_or_weight_specs():
    schemes = parse_schemes("nvfp4, W4A16,FP8,none,int4:group:64,fp8_e4m3:block:128x128")
    assert [s.name for s in schemes] == ["NVFP4", "W4A16", "FP8", NONE, "int4:group:64", "fp8_e4m3:block:128x128"]
    assert schemes[0].input is not None and schemes[0].input.dynamic
    assert schemes[1].input is None and schemes[1].weight.group_size == 128
    assert schemes[3].dense and schemes[3].specs() == {}
    assert schemes[4].weight == ob.QuantSpec("int4", strategy="group", group_size=64)
    assert schemes[5].weight.block_size == (128, 128)
    weights_only = parse_scheme("FP8", weights_only=True)
    assert weights_only.input is None and weights_only.weight == ob.preset("FP8")["weight"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("NVFP5", "unknown scheme 'NVFP5'"),
        ("int4:diagonal", "strategy='diagonal' is not valid"),
        ("int4:group:x", "group size (128) or a block"),
        ("none", "nothing to quantize"),
        ("FP8,fp8", "names FP8 twice"),
    ],
)
def test_a_bad_scheme_list_is_one_error_naming_it(text, words):
    with pytest.raises(ValueError, match=None) as caught:
        parse_schemes(text)
    assert words in str(caught.value)


def test_budgets_are_bits_or_sizes_never_both():
    assert parse_budget("4.8").bits_per_weight == 4.8
    assert parse_budget("4.8bits").bits_per_weight == 4.8
    assert parse_budget("3.2GB").checkpoint_bytes == 3_200_000_000
    chosen, every = parse_budgets("5", "6,4.5")
    assert chosen.text == "5" and [b.bits_per_weight for b in every] == [4.5, 5.0, 6.0]
    assert parse_budgets(None, "4.5,6")[0].text == "6"  # the largest budget is the one exported
    with pytest.raises(ValueError, match="mix bits per weight and sizes"):
        parse_budgets("4.5", "1GB")
    with pytest.raises(ValueError, match="neither bits per weight"):
        parse_budget("four")
    with pytest.raises(ValueError, match="give a --budget"):
        parse_budgets(None, None)


def test_a_size_budget_is_the_whole_checkpoint():
    budget = Budget("1MB", checkpoint_bytes=1_000_000)
    assert budget.layer_bytes(weights=10**6, rest_bytes=400_000) == 600_000
    assert Budget("4", bits_per_weight=4.0).layer_bytes(weights=1000, rest_bytes=123) == 500


# ---------------------------------------------------------------- the allocation from scores

DECODER = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + ["model.layers.0.mlp.down_proj"]


def _sizes(layers, shape=(256, 256)) -> LayerSizes:
    return LayerSizes(dict.fromkeys(layers, shape), dict.fromkeys(layers, "Linear"), dict.fromkeys(layers, 2), 1000)


def _scores(table: dict[str, dict[str, float]]) -> Scores:
    """Scores with one observer per (layer, scheme), from ``{layer: {scheme: score}}``."""
    rows = [
        {"layer": layer, "scheme": scheme, "observer": "minmax", "input_observer": None, "score": value}
        for layer, found in table.items()
        for scheme, value in found.items()
    ]
    return Scores(pd.DataFrame(rows), "kl", {}, len(rows), len(rows), 0.0)


def test_fused_layers_share_a_scheme_and_the_budget_is_kept():
    schemes = parse_schemes("W4A16,FP8,none")
    # q alone would take FP8, k and v are robust; the fused qkv group takes one scheme for all three
    table = {layer: {"W4A16": 0.01, "FP8": 0.001} for layer in DECODER}
    table[DECODER[0]] = {"W4A16": 1.0, "FP8": 0.001}
    sizes = _sizes(DECODER)
    options = fr.layer_options(_scores(table), sizes, schemes)
    groups = fused_groups(DECODER)
    assert [len(members) for _, members in groups] == [3, 1, 1]
    for bits in (4.5, 6.0, 9.0):
        point = fr.allocate(options, groups, sizes, Budget(str(bits), bits_per_weight=bits))
        chosen = point.schemes()
        assert len({chosen[layer] for layer in DECODER[:3]}) == 1
        assert point.bits_per_weight <= bits
        assert point.layer_bytes == sum(options[c.layer][c.scheme].bytes for c in point.choices)
    # at 7 bits q's damage buys FP8 for the whole qkv group (6.5 bits), with no room for o or down
    seven = fr.allocate(options, groups, sizes, Budget("7", bits_per_weight=7.0)).schemes()
    assert seven[DECODER[0]] == "FP8" and seven[DECODER[3]] == seven[DECODER[4]] == "W4A16"


def test_a_budget_below_the_cheapest_names_the_least_feasible_and_above_all_takes_the_best():
    schemes = parse_schemes("W4A16,FP8,none")
    layers = ["a", "b"]
    sizes = _sizes(layers)
    options = fr.layer_options(_scores({layer: {"W4A16": 0.1, "FP8": 0.01} for layer in layers}), sizes, schemes)
    groups = fused_groups(layers)
    least = sizes.bits_per_weight(sum(options[layer]["W4A16"].bytes for layer in layers))
    with pytest.raises(ValueError, match=f"least feasible is {least:.4g} bits per weight"):
        fr.allocate(options, groups, sizes, Budget("3", bits_per_weight=3.0))
    with pytest.raises(ValueError, match="least feasible"):
        fr.check_budgets(sizes, schemes, [Budget("3", bits_per_weight=3.0)])
    top = fr.allocate(options, groups, sizes, Budget("64", bits_per_weight=64.0))
    assert top.unconstrained and set(top.schemes().values()) == {NONE} and top.predicted == 0.0


def test_a_size_budget_solves_as_the_bits_it_leaves_the_chosen_layers():
    schemes = parse_schemes("NVFP4A16,W4A16,FP8,none")
    assert schemes[0].weight.dtype == "nvfp4" and schemes[0].input is None  # a weights-only preset
    layers = [f"l{i}" for i in range(6)]
    sizes = _sizes(layers)
    table = {layer: {"NVFP4A16": 0.02 * i, "W4A16": 0.03 * i, "FP8": 0.001} for i, layer in enumerate(layers, 1)}
    options = fr.layer_options(_scores(table), sizes, schemes)
    groups = fused_groups(layers)
    by_bits = fr.allocate(options, groups, sizes, Budget("6", bits_per_weight=6.0))
    size = sizes.rest_bytes + 6 * sizes.weights // 8
    by_size = fr.allocate(options, groups, sizes, Budget(f"{size}B", checkpoint_bytes=size))
    assert by_size.schemes() == by_bits.schemes() and by_size.checkpoint_bytes <= size
    assert by_bits.checkpoint_bytes == sizes.rest_bytes + by_bits.layer_bytes


def test_a_scheme_missing_from_a_layer_is_no_option_there_and_no_uniform_point():
    schemes = parse_schemes("W4A16,FP8")
    sizes = _sizes(["a", "b"])
    options = fr.layer_options(_scores({"a": {"W4A16": 0.1, "FP8": 0.01}, "b": {"FP8": 0.02}}), sizes, schemes)
    assert set(options["b"]) == {"FP8"}
    assert fr.uniform(options, sizes, "W4A16") is None
    assert fr.uniform(options, sizes, "FP8").predicted == pytest.approx(0.03)
    with pytest.raises(ValueError, match="does not apply to b"):
        fr.fixed(options, sizes, "rule", lambda layer: "W4A16")


def _point(name, predicted, measured, in_sample=None):
    return fr.Point(name, "budget", (), 0, 4.0, 0, predicted, measured_score=measured, in_sample_score=in_sample)


def test_where_prediction_and_measurement_part_is_said_with_the_scoring_parts_figure():
    points = [
        _point("a", 0.01, 0.011, 0.01),
        _point("b", 0.02, 0.05, 0.045),  # parts on both texts: the damages compound
        _point("c", 0.03, 0.012, 0.029),  # adds on the scoring part: the other text differs
        _point("d", 0.04, 0.1, 0.042),
    ]
    notes = fr.parting(points, "cosine")
    assert not any(n.startswith("a:") for n in notes)
    assert any(
        n.startswith("b: measured 1 − cosine 0.05 on the measuring part against 0.02 predicted from the scoring part")
        and "compound rather than add (2.25× on the scoring part too)" in n
        for n in notes
    ), notes
    assert any(
        n.startswith("c:") and "0.97× the prediction, so the measuring part's text is hurt less" in n for n in notes
    )
    assert any(
        n.startswith("d:") and "1.05× the prediction, so the measuring part's text is hurt more" in n for n in notes
    )
    assert "b and c: predicted in one order, measured on the measuring part in the other" in notes
    unknown = fr.parting([_point("e", 0.01, 0.03)], "kl")
    assert len(unknown) == 1 and unknown[0].endswith("the layers' damages compound rather than add")
    assert fr.rank_correlation([_point(str(i), i, i * i) for i in range(1, 5)]) == pytest.approx(1.0)
    assert fr.rank_correlation([_point("a", 1, 1), _point("b", 2, 2)]) is None


# ---------------------------------------------------------------- the held-out text in two parts


def test_the_held_out_paragraphs_split_into_two_disjoint_deterministic_parts():
    texts = held_out_texts()
    scoring, measuring = split_held_out(texts)
    assert scoring and measuring and len(scoring) + len(measuring) == len(texts)
    assert sorted(scoring + measuring) == sorted(texts)
    assert not set(scoring) & set(measuring)
    assert not set(sentences(scoring)) & set(sentences(measuring))  # no sentence is in both parts
    assert (scoring, measuring) == (texts[0::2], texts[1::2]) == split_held_out(list(texts))
    assert split_held_out(["one", "  ", "two", "three"]) == (["one", "three"], ["two"])  # blank ones dropped first
    for short in (["a single paragraph"], ["a single paragraph", "\n  "], []):
        with pytest.raises(ValueError, match=r"has [01] paragraph\(s\).* needs at least 2") as caught:
            split_held_out(short)
        assert "\n" not in str(caught.value)


class _Part:
    """An evaluator of one part: ``perplexity`` of every choice set, and the float model's."""

    def __init__(self, perplexity: float, float_perplexity: float) -> None:
        self.perplexity, self.float_perplexity = perplexity, float_perplexity

    def evaluate(self, chosen):
        return SimpleNamespace(metrics={"perplexity": self.perplexity})

    def float_metrics(self):
        return {"perplexity": self.float_perplexity}


def test_a_point_is_measured_on_the_measuring_part_and_in_sample_on_the_scoring_part():
    held_out = HeldOut(_Part(9.9, 9.0), _Part(12.0, 10.0), "given paragraphs", (1, 1))
    scores = Scores(pd.DataFrame(), "perplexity", {}, 0, 0, 0.0)
    point = fr.measure(_point("a", 0.1, None), held_out, scores)
    assert point.measured == {"perplexity": 12.0} and point.in_sample == {"perplexity": 9.9}
    # each part's damage is against its own float model: 12 / 10 - 1, not the scoring part's 12 / 9 - 1
    assert point.measured_score == pytest.approx(0.2) and point.in_sample_score == pytest.approx(0.1)


# ---------------------------------------------------------------- the command, end to end

LAYERS = "encoder.layer.5.*"
ARGS = ["--schemes", "NVFP4,W4A16,FP8,none", "--observers", "minmax,mse_grid", "--samples", "4"]
FAST = ["--held-out-samples", "16", "--quiet"]


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def allocated(tmp_path_factory):
    """The command run once; ``runs``: each model run of held-out text as ``(kind, texts)``, the
    texts its ``EffectRunner`` was given (``stacked``: scores, ``EffectRunner.run_stacked``;
    ``evaluate``: an end-to-end measurement, ``Evaluator.evaluate``)."""
    where = tmp_path_factory.mktemp("allocate")
    given: dict[int, tuple[str, ...]] = {}
    runs: list[tuple[str, tuple[str, ...]]] = []
    init, stacked, evaluate = EffectRunner.__init__, EffectRunner.run_stacked, Evaluator.evaluate

    def spied_init(self, model, texts=None, **options):
        given[id(self)] = tuple(held_out_texts() if texts is None else texts)
        init(self, model, texts, **options)

    def spied_stacked(self, *args, **options):
        runs.append(("stacked", given[id(self)]))
        return stacked(self, *args, **options)

    def spied_evaluate(self, *args, **options):
        runs.append(("evaluate", given[id(self.runner)]))
        return evaluate(self, *args, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EffectRunner, "__init__", spied_init)
        patch.setattr(EffectRunner, "run_stacked", spied_stacked)
        patch.setattr(Evaluator, "evaluate", spied_evaluate)
        code, out, err = _cli(
            "allocate", "minilm", "--layers", LAYERS, *ARGS, "--budget", "5", "--budgets", "4.5,6,40",
            "--out", str(where / "a.json"), "--checkpoint", str(where / "ckpt"), "--recipe", str(where / "r.yaml"),
            "--report", str(where / "r.html"), *FAST,
        )  # fmt: skip
    assert code == 0, err
    return where, out, err, runs


@pytest.fixture(scope="module")
def minilm():
    from sample_models import open_model

    return open_model("minilm")


def _allocation(where: Path) -> dict:
    return json.loads((where / "a.json").read_text())["config"]["allocation"]


def test_the_command_prints_the_frontier_and_writes_every_file(allocated):
    where, out, err, _ = allocated
    assert all((where / name).exists() for name in ("a.json", "ckpt", "r.yaml", "r.html"))
    lines = {line.split("\t")[0]: line for line in out.splitlines() if "\t" in line}
    for budget in ("4.5", "5", "6", "40"):
        bits = float(lines[f"budget {budget}"].split("\t")[1].split()[0])
        assert bits <= float(budget)
    assert {"all NVFP4", "all W4A16", "all FP8", "all none"} <= set(lines)
    points = [line for name, line in lines.items() if name.startswith(("budget ", "all "))]
    assert len(points) == 8 and all("\tin-sample 1 − cosine=" in p and "\tmeasured 1 − cosine=" in p for p in points)
    assert "predicted (scoring part) against measured (measuring part): Spearman" in out
    assert "note: held-out text scored on 9 of the 18 built-in held-out paragraphs (the 1st, 3rd, …;" in err
    assert "budget 40 is above what every layer's best option takes" in err
    assert "note: NVFP4 takes 4.5" in err and "note: FP8 takes 8" in err and "note: none takes 32 bits" in err
    described = _allocation(where)
    assert described["budget"] == "5" and described["bits_per_weight"] <= 5
    assert len(described["layers"]) == 6 and len(described["frontier"]["allocations"]) == 4
    assert described["measured"]["cosine"] < 1.0
    assert described["frontier"]["parts"] == {"predicted": "scoring", "in_sample": "scoring", "measured": "measuring"}
    held = described["run"]["held_out"]
    assert held["scoring"]["texts"] == held["measuring"]["texts"] == "9 paragraph(s)"
    assert held["scoring"]["digest"] != held["measuring"]["digest"]
    report = (where / "r.html").read_text()
    assert report.count("<script") >= 1 and "Frontier" in report and "budget 5" in report
    assert "Predicted (scoring part) against measured (measuring part): Spearman" in report
    assert "in-sample 1 − cosine" in report


def test_scores_run_on_the_scoring_part_only_and_every_point_is_measured_on_both(allocated):
    *_, runs = allocated
    scoring, measuring = (tuple(part) for part in split_held_out(held_out_texts()))
    scored = [texts for kind, texts in runs if kind == "stacked"]
    assert scored and set(scored) == {scoring}
    measured = [texts for kind, texts in runs if kind == "evaluate"]
    assert measured.count(measuring) == measured.count(scoring) == 4 + 4  # 4 budgets and 4 uniform schemes
    assert set(measured) == {scoring, measuring}


def test_the_measured_figures_are_the_measuring_parts_and_the_in_sample_ones_the_scoring_parts(allocated, minilm):
    where, *_ = allocated
    described = _allocation(where)
    chosen = from_lab_file(lab_json.load_file(where / "a.json"), minilm)
    scoring, measuring = split_held_out(held_out_texts())
    for texts, recorded in ((measuring, described["measured"]), (scoring, described["in_sample"])):
        metrics = Evaluator(minilm, texts, samples=16).evaluate(chosen).metrics
        assert metrics["cosine"] == pytest.approx(recorded["cosine"], abs=1e-6)
        assert metrics["spearman"] == pytest.approx(recorded["spearman"], abs=1e-6)
    assert abs(described["measured"]["cosine"] - described["in_sample"]["cosine"]) > 1e-5  # two texts, two figures
    budget = next(p for p in described["frontier"]["allocations"] if p["budget"] == "5")
    assert budget["measured_score"] == pytest.approx(1 - described["measured"]["cosine"])
    assert budget["in_sample_score"] == pytest.approx(1 - described["in_sample"]["cosine"])


def test_every_entry_has_its_layers_scheme_and_the_layers_left_dense_are_not_exported(allocated):
    where, *_ = allocated
    described = _allocation(where)
    lab_file = lab_json.load_file(where / "a.json")
    schemes = {s.name: s for s in parse_schemes("NVFP4,W4A16,FP8,none")}
    for entry in lab_file.entries:
        chosen = described["layers"][entry.layer]
        assert entry.spec == getattr(schemes[chosen["scheme"]], entry.tensor)
        assert entry.observer == (chosen["observer"] if entry.tensor == "weight" else chosen["input_observer"])
    dense = [layer for layer, found in described["layers"].items() if found["scheme"] == NONE]
    assert not {e.layer for e in lab_file.entries} & set(dense)


def test_the_mixed_checkpoint_loads_in_transformers_with_the_chosen_weights(allocated, minilm):
    """transformers loads it packed, each config group in its own format, and runs it; each layer
    decompressed by compressed-tensors is the lab's fake-quantized weight. (transformers'
    ``dequantize=True`` option cannot load it: it applies one compressor to every layer of a
    mixed-precision checkpoint.) FP4 comes out in bfloat16, so NVFP4 layers are checked on a
    bfloat16 load, the others on a float32 one."""
    from compressed_tensors.compressors import decompress_module
    from transformers import AutoModel

    where, *_ = allocated
    described = _allocation(where)
    config = json.loads((where / "ckpt" / "config.json").read_text())["quantization_config"]
    used = {found["scheme"] for found in described["layers"].values()} - {NONE}
    assert len(used) > 1 and config["format"] == "mixed-precision"
    assert {group["format"] for group in config["config_groups"].values()} >= {"nvfp4-pack-quantized"}
    lab_file = lab_json.load_file(where / "a.json")
    for dtype in (torch.bfloat16, torch.float32):
        loaded = AutoModel.from_pretrained(where / "ckpt", dtype=dtype)
        for entry in (e for e in lab_file.entries if e.tensor == "weight"):
            if (entry.spec.dtype == "nvfp4") != (dtype == torch.bfloat16):
                continue
            module = loaded.get_submodule(entry.layer)
            decompress_module(module)
            fake = ob.fake_quantize(minilm.weight(entry.layer).float(), entry.qparams, entry.spec).to(dtype)
            assert torch.equal(module.weight.detach(), fake), entry.layer
        for layer, found in described["layers"].items():
            if found["scheme"] == NONE:
                assert torch.equal(loaded.get_submodule(layer).weight.detach(), minilm.weight(layer).to(dtype))
    with torch.no_grad():  # the packed model runs (as FP4 is served: in bfloat16)
        packed = AutoModel.from_pretrained(where / "ckpt", dtype=torch.bfloat16)
        assert packed(input_ids=torch.tensor([[101, 2023, 102]])).last_hidden_state.isfinite().all()


def test_the_checkpoint_stores_what_the_budget_counted(allocated, minilm):
    where, *_ = allocated
    described = _allocation(where)
    layers = list(described["layers"])
    sizes = LayerSizes.of(minilm, layers)
    schemes = {s.name: s for s in parse_schemes("NVFP4,W4A16,FP8,none")}
    stored: dict[str, int] = {}
    total = 0
    for file in (where / "ckpt").glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                size = tensor.numel() * tensor.element_size()
                total += size
                layer = key.rsplit(".", 1)[0]
                if layer in described["layers"] and not key.endswith(".bias"):
                    stored[layer] = stored.get(layer, 0) + size
    for layer, found in described["layers"].items():
        scheme = schemes[found["scheme"]]
        assert stored[layer] == sizes.layer_bytes(layer, scheme.weight, scheme.input), layer
    assert total == described["checkpoint_bytes"]
    assert described["bits_per_weight"] == pytest.approx(8 * sum(stored.values()) / sizes.weights)


def test_the_recipe_gives_every_layer_its_scheme_and_observer(allocated):
    where, *_ = allocated
    described = _allocation(where)
    lab_file = lab_json.load_file(where / "a.json")
    groups = yaml.safe_load((where / "r.yaml").read_text())["quant_stage"]["quant_modifiers"]["QuantizationModifier"][
        "config_groups"
    ]
    group_of = {target: group for group in groups.values() for target in group["targets"]}
    quantized = {layer for layer, found in described["layers"].items() if found["scheme"] != NONE}
    assert set(group_of) == quantized
    pairs = {(g["weights"]["observer"], json.dumps(g["weights"], sort_keys=True)) for g in groups.values()}
    assert len(pairs) == len(groups)  # one group per scheme × observer
    for entry in lab_file.entries:
        arg_name = "weights" if entry.tensor == "weight" else "input_activations"
        written = group_of[entry.layer][arg_name]
        expected, _ = ct_args(entry.spec, entry.tensor)
        fields = ("num_bits", "type", "strategy", "group_size", "dynamic")
        assert {k: written.get(k) for k in fields} == {k: expected.get(k) for k in fields}, entry.layer
        if entry.tensor == "weight" or not entry.spec.dynamic:
            assert written["observer"] == lc_observer(entry.observer, entry.knobs, entry.tensor)[0]


def test_export_writes_the_same_recipe_from_the_allocation_file_later(allocated):
    where, *_ = allocated
    code, out, err = _cli("export", str(where / "a.json"), "--model", "minilm", "--recipe", str(where / "again.yaml"))
    assert code == 0, err
    again, first = ((where / name).read_text().splitlines() for name in ("again.yaml", "r.yaml"))
    asked = [line for line in first if line.startswith("# note: asked for by cli")]
    assert len(asked) == 1 and json.loads((where / "a.json").read_text())["provenance"]["asked_by"].startswith("cli")
    # the same recipe, but for who asked when (the export was asked for later)
    assert [line for line in again if "asked for by" not in line] == [line for line in first if line not in asked]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--schemes", "W4A16,FP8", "--budget", "2"], "budget 2 is below the cheapest allocation"),
        (["--schemes", "W4A16,NVFP5", "--budget", "5"], "unknown scheme 'NVFP5'"),
        (["--schemes", "int4:group:1000,none", "--budget", "5"], "scheme int4:group:1000 applies to no chosen layer"),
        (["--schemes", "W4A16,FP8", "--budget", "5", "--budgets", "1GB"], "mix bits per weight and sizes"),
        (["--schemes", "W4A16,FP8", "--budget", "5", "--kinds", "output"], "--kinds 'output'"),
    ],
    ids=["below-cheapest", "unknown-scheme", "applies-to-none", "two-units", "bad-kinds"],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, flags, words):
    out = tmp_path / "a.json"
    code, _, err = _cli(
        "allocate", "minilm", "--layers", "encoder.layer.5.output.dense", *flags, "--observers", "minmax",
        "--samples", "2", "--out", str(out), "--checkpoint", str(tmp_path / "ckpt"), *FAST,
    )  # fmt: skip
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert list(tmp_path.iterdir()) == []


def _short_held_out(tmp_path: Path, text: str) -> tuple[int, str, Path]:
    held = tmp_path / "held.txt"
    held.write_text(text, encoding="utf-8")
    written = tmp_path / "out"
    written.mkdir()
    code, _, err = _cli(
        "allocate", "minilm", "--layers", "encoder.layer.5.output.dense", "--schemes", "W4A16,FP8", "--budget", "5",
        "--observers", "minmax", "--samples", "2", "--held-out", str(held), "--out", str(written / "a.json"), "--quiet",
    )  # fmt: skip
    return code, err, written


def test_a_held_out_text_of_one_paragraph_is_one_line_before_the_model_opens(tmp_path, monkeypatch):
    monkeypatch.setattr("sample_models.open_model", lambda *a, **k: pytest.fail("the model was opened"))
    code, err, written = _short_held_out(tmp_path, "One paragraph. Three sentences in it.\nAnd a third line.\n")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert f"--held-out {tmp_path / 'held.txt'}: the held-out text has 1 paragraph(s)" in lines[0]
    assert list(written.iterdir()) == []


def test_a_held_out_part_too_short_to_compare_is_one_line_naming_the_part(tmp_path):
    code, err, written = _short_held_out(tmp_path, "A first short paragraph.\n\nA second one.\n")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "has 1 sentence(s); comparing embeddings needs 3 (the scoring part: 1 of the held-out text's 2" in lines[0]
    assert list(written.iterdir()) == []
