"""The llm-compressor recipe export: every per-layer observer choice kept as its own config group
of exact layer names, observers llm-compressor lacks mapped to their nearest with a comment, the
YAML read back by ``yaml.safe_load`` and each group validated by compressed-tensors (llm-compressor
itself parses the recipe in bench/bench_recipe.py, in the bench environment)."""

from __future__ import annotations

import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.model_facts import ModelFacts
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import compressed_tensors, recipe
from lab.results import choose
from sample_models import open_model

QUERY = "encoder.layer.0.attention.self.query"
KEY = "encoder.layer.0.attention.self.key"
FFN = "encoder.layer.0.intermediate.dense"
OBSERVERS = ("minmax", "memoryless_minmax", "mse_grid", "percentile")


@pytest.fixture(scope="module")
def minilm():
    return open_model("minilm")


@pytest.fixture(scope="module")
def weights(minilm) -> Analysis:
    """MiniLM weights, int8 per output channel, four observers (percentile has no llm-compressor twin)."""
    config = RunConfig(specs={"weight": ob.QuantSpec("int8", strategy="channel")}, observers=OBSERVERS)
    return analyse(minilm, [QUERY, KEY, FFN], config)


def _modifier(built: recipe.Recipe) -> dict:
    return yaml.safe_load(built.text)["quant_stage"]["quant_modifiers"]["QuantizationModifier"]


def _by_target(built: recipe.Recipe) -> dict[tuple[str, ...], dict]:
    return {tuple(group["targets"]): group for group in built.config_groups.values()}


def test_two_observers_give_two_groups_of_exact_layer_names(weights):
    choices = {(QUERY, "weight"): "mse_grid", (KEY, "weight"): "mse_grid", (FFN, "weight"): "minmax"}
    built = recipe.build(weights, choices)
    groups = _by_target(built)
    assert set(groups) == {(QUERY, KEY), (FFN,)}
    assert groups[(QUERY, KEY)]["weights"]["observer"] == "memoryless_mse"
    assert groups[(FFN,)]["weights"]["observer"] == "static_minmax"
    for group in groups.values():
        assert group["weights"]["observer_kwargs"] == {}
        assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "channel")
        assert group["input_activations"] is None and group["output_activations"] is None
    modifier = _modifier(built)
    assert modifier["ignore"] == [] and modifier["kv_cache_scheme"] is None
    assert modifier["config_groups"] == built.config_groups


def test_every_choice_is_kept_where_compressed_tensors_keeps_one(weights):
    choices = {(QUERY, "weight"): "mse_grid", (KEY, "weight"): "minmax", (FFN, "weight"): "mse_grid"}
    groups = _by_target(recipe.build(weights, choices))
    assert {targets: g["weights"]["observer"] for targets, g in groups.items()} == {
        (QUERY, FFN): "memoryless_mse",
        (KEY,): "static_minmax",
    }
    config = compressed_tensors.build(weights, choices).quantization_config
    assert [g["weights"]["observer"] for g in config["config_groups"].values()] == ["memoryless_mse"]


def test_yaml_parses_and_every_group_validates_as_a_compressed_tensors_scheme(weights):
    choices = {(QUERY, "weight"): "percentile", (KEY, "weight"): "mse_grid", (FFN, "weight"): "minmax"}
    built = recipe.build(weights, choices)
    assert built.to_yaml() == built.text and built.to_bytes() == built.text.encode()
    for name, group in _modifier(built)["config_groups"].items():
        scheme = QuantizationScheme(**group)
        assert scheme.targets == built.config_groups[name]["targets"]
        assert scheme.weights.observer == group["weights"]["observer"]


def test_observer_llm_compressor_lacks_becomes_its_nearest_with_a_comment(weights):
    choices = {(QUERY, "weight"): "mse_grid", (FFN, "weight"): "percentile"}
    built = recipe.build(weights, choices)
    group = _by_target(built)[(FFN,)]
    assert group["weights"]["observer"] == "memoryless_minmax" and group["weights"]["observer_kwargs"] == {}
    lines = built.text.splitlines()
    comment = "# weights: lab observer 'percentile' -> llm-compressor 'memoryless_minmax' (nearest)"
    at = [line.strip() for line in lines].index(comment)
    name = next(n for n, g in built.config_groups.items() if g["targets"] == [FFN])
    assert lines[at + 1].strip() == f"{name}:"
    assert any(f"{FFN} weight: lab observer 'percentile'" in note for note in built.notes)
    assert any(f"note: {FFN} weight: lab observer 'percentile'" in line for line in lines)


def test_same_llm_compressor_setting_shares_a_group_and_names_the_mapped_layers(weights):
    choices = {(QUERY, "weight"): "percentile", (KEY, "weight"): "memoryless_minmax", (FFN, "weight"): "minmax"}
    built = recipe.build(weights, choices)
    groups = _by_target(built)
    assert groups[(QUERY, KEY)]["weights"]["observer"] == "memoryless_minmax"
    assert (
        f"# weights: lab observer 'percentile' -> llm-compressor 'memoryless_minmax' (nearest) for {QUERY}"
        in built.text
    )


def test_changed_knobs_become_observer_kwargs_and_split_groups(minilm):
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    config = RunConfig(specs={"weight": spec}, observers=("mse_grid",), knobs={"mse_grid": {"norm": 2.0}})
    tuned = analyse(minilm, [QUERY], config)
    plain = analyse(minilm, [FFN], RunConfig(specs={"weight": spec}, observers=("mse_grid",)))
    both = Analysis(plain.facts, plain.config, tuned.entries + plain.entries)
    groups = _by_target(recipe.build(both, choose(both)))
    assert groups[(QUERY,)]["weights"]["observer_kwargs"] == {"norm": 2.0}
    assert groups[(FFN,)]["weights"]["observer_kwargs"] == {}
    assert groups[(QUERY,)]["weights"]["group_size"] == 32


def test_every_lab_observer_maps_to_an_llm_compressor_one():
    lc_names = set(compressed_tensors.CT_OBSERVER_NAMES.values())
    for name in ob.available():
        for tensor in ("weight", "input", "k"):
            lc, _, why = recipe.lc_observer(name, {}, tensor)
            assert lc in lc_names, (name, lc)
            assert (why is None) == (name in compressed_tensors.CT_OBSERVER_NAMES)
    assert not set(recipe.NEAREST_LC_OBSERVERS) & set(compressed_tensors.CT_OBSERVER_NAMES)


def test_key_value_states_give_a_kv_cache_scheme():
    llama = open_model("tiny-llama")
    blocks = llama.attention_blocks()[:2]
    config = RunConfig(
        specs={"kv": ob.QuantSpec("fp8_e4m3", strategy="channel")},
        observers=("minmax", "mse_grid", "percentile"),
        samples=4,
        seq_len=32,
    )
    analysis = analyse(llama, [], config, attention=blocks)
    choices = {key: "percentile" for key in choose(analysis)}
    choices[(blocks[0], "k")] = "mse_grid"
    built = recipe.build(analysis, choices)
    kv = _modifier(built)["kv_cache_scheme"]
    assert kv == built.kv_cache_scheme and built.config_groups == {}
    assert (kv["strategy"], kv["type"], kv["num_bits"], kv["observer"]) == ("attn_head", "float", 8, "static_minmax")
    QuantizationArgs(**kv)
    assert "# kv_cache_scheme: lab observer 'percentile' -> llm-compressor 'static_minmax' (nearest)" in built.text
    differs = f"{blocks[0]} k: chose 'mse_grid' but kv_cache_scheme records 'percentile'"
    assert any(note.startswith(differs) for note in built.notes)


# ------------------------------------------------------------- hand-made analyses: what is left out


def _hand(entries: list[tuple[str, str, ob.QuantSpec, torch.Tensor]], shapes=None) -> Analysis:
    """An analysis of hand-made entries (each its own spec), min-max results computed on the data."""
    made = []
    for layer, tensor, spec, data in entries:
        kind = "weight" if tensor == "weight" else "activation"
        made.append(TensorAnalysis(layer, tensor, spec, data, ob.run_suite(data, spec, ["minmax"], kind=kind)))
    facts = ModelFacts({"kind": "builtin", "name": "hand"}, layer_shapes=shapes or {})
    return Analysis(facts, RunConfig(specs={"weight": ob.QuantSpec()}, observers=("minmax",)), made)


def _all_minmax(analysis: Analysis) -> dict[tuple[str, str], str]:
    return {(e.layer, e.tensor): "minmax" for e in analysis.entries if e.results[0].qparams is not None}


def test_a_spec_compressed_tensors_cannot_express_is_noted_not_written():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    narrow = ob.QuantSpec(reduce_range=True)
    analysis = _hand([("a.proj", "weight", ob.QuantSpec(), w), ("b.proj", "weight", narrow, w)])
    built = recipe.build(analysis, _all_minmax(analysis))
    assert [g["targets"] for g in _modifier(built)["config_groups"].values()] == [["a.proj"]]
    assert any(n.startswith("b.proj weight: reduce_range") and n.endswith("not exported") for n in built.notes)
    with pytest.raises(ValueError, match="no chosen setting has an llm-compressor equivalent"):
        recipe.build(analysis, {("b.proj", "weight"): "minmax"})


def test_groups_that_do_not_divide_the_columns_are_left_out():
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    w = torch.randn(8, 80, generator=torch.Generator().manual_seed(1))
    analysis = _hand([("a.proj", "weight", spec, w), ("b.proj", "weight", spec, w[:, :64])], {"a.proj": (8, 80)})
    built = recipe.build(analysis, _all_minmax(analysis))
    assert [g["targets"] for g in built.config_groups.values()] == [["b.proj"]]
    assert any("a.proj weight: 80 columns are not a multiple of group size 32" in n for n in built.notes)


def test_activations_dynamic_inputs_record_no_observer_and_uncalibrated_ones_are_refused_then_noted():
    g = torch.Generator().manual_seed(2)
    token = ob.QuantSpec("int8", strategy="token", dynamic=True)
    analysis = _hand(
        [
            ("a.proj", "weight", ob.QuantSpec(), torch.randn(8, 16, generator=g)),
            ("a.proj", "input", token, torch.randn(5, 16, generator=g)),
            ("b.proj", "input", ob.QuantSpec(), torch.empty(0, 16)),
        ]
    )
    choices = _all_minmax(analysis)
    with pytest.raises(ValueError, match="allow_uncalibrated"):
        recipe.build(analysis, choices)
    built = recipe.build(analysis, choices, allow_uncalibrated=True)
    group = built.config_groups["group_0"]
    assert group["targets"] == ["a.proj"] and group["input_activations"]["dynamic"] is True
    assert "observer" not in group["input_activations"]
    QuantizationScheme(**group)
    assert any(n.startswith("b.proj input: saw no calibration tokens") for n in built.notes)


def test_file_form_holds_the_text(weights, tmp_path):
    choices = {(QUERY, "weight"): "mse_grid"}
    built = recipe.save_file(weights, choices, tmp_path / "out" / "mine.yaml")
    assert (tmp_path / "out" / "mine.yaml").read_text() == built.text
    assert built.write(tmp_path) == str(tmp_path / recipe.RECIPE_FILE)
    assert recipe.save(weights, choices) == built.to_bytes()
