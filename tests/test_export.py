"""Observer Lab JSON export/import and the compressed-tensors export (checked with the real package)."""

import copy
import hashlib
import json
import math
from dataclasses import dataclass, replace

import jsonschema
import pytest
import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
from helpers import streamed_capture
from safetensors import safe_open

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.model_facts import ModelFacts, describe_source
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import compressed_tensors, lab_apply, lab_json
from lab.results import choose
from lab.scheme import stored
from observers.suite import SuiteResult

OBSERVERS = ("minmax", "memoryless_minmax", "moving_average_minmax")


@dataclass(frozen=True)
class Info:
    name: str
    type: str
    shape: tuple[int, ...]
    params: int = 0


class FakeModel:
    """The part of a sample_models model the pipeline and apply_choices use, with fixed data;
    ``zero.proj`` has an all-zero weight, so its weight SQNR is +inf."""

    name = "fake"
    source = "fake-model"

    def __init__(self, shapes: dict[str, tuple[int, int]] | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        shapes = shapes or {"blk.q_proj": (16, 64), "blk.k_proj": (8, 64), "zero.proj": (8, 64)}
        self.weights = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
        if "zero.proj" in self.weights:
            self.weights["zero.proj"].zero_()
        self.inputs = [torch.randn(20, 64, generator=g) * (i + 1) for i in range(2)]

    def layers(self, pattern=None):
        return [Info(n, "Linear", tuple(w.shape)) for n, w in self.weights.items()]

    def weight(self, name):
        return self.weights[name].clone()

    def capture(self, names, texts=None, samples=32, seq_len=128, outputs=False, stream=None, done=None, **_):
        x = torch.cat(self.inputs)
        produced = {n: x @ self.weights[n].T for n in names} if outputs else None
        return streamed_capture(dict.fromkeys(names, x), produced, stream, len(self.inputs), done)


def _analysis(specs=None, observers=OBSERVERS, model=None) -> tuple[FakeModel, Analysis]:
    model = model or FakeModel()
    specs = specs or {
        "weight": ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=32),
        "input": ob.QuantSpec(dtype="int8"),
    }
    return model, analyse(model, list(model.weights), RunConfig(specs=specs, observers=observers))


@pytest.fixture(scope="module")
def run():
    model, analysis = _analysis()
    choices = choose(analysis)
    document = lab_json.build_document(analysis, choices)
    return model, analysis, choices, document, lab_json.dumps(document)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_round_trip_restores_choices_and_bit_identical_qparams(run):
    model, analysis, choices, _, text = run
    loaded = lab_json.load(text)
    assert loaded.choices == choices
    restored = lab_apply.apply_choices(loaded, ModelFacts.of(model))
    assert restored["choices"] == choices
    for key, observer in choices.items():
        original = analysis.entry(*key).result(observer).qparams
        back = restored["qparams"][key]
        for name in ("scale", "zero_point", "min_val", "max_val"):
            a, b = getattr(original, name), getattr(back, name)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b)), (key, name)
        assert restored["specs"][key] == analysis.entry(*key).spec


def test_user_override_is_exported_with_best_other_as_runner_up(run):
    _, analysis, choices, _, _ = run
    key = ("blk.q_proj", "weight")
    override = {**choices, key: "moving_average_minmax"}
    document = lab_json.build_document(analysis, override)
    record = next(e for e in document["entries"] if (e["layer"], e["tensor"]) == key)
    assert record["chosen"]["observer"] == "moving_average_minmax"
    entry = analysis.entry(*key)
    best_other = max(
        (r for r in entry.results if r.name != "moving_average_minmax"), key=lambda r: r.metrics["sqnr_db"]
    )
    assert record["runner_up"]["observer"] == best_other.name
    assert record["runner_up"]["metrics"]["sqnr_db"] == best_other.metrics["sqnr_db"]


def test_infinite_sqnr_is_written_as_string_and_read_back(run):
    _, analysis, _, document, text = run
    record = next(e for e in document["entries"] if e["layer"] == "zero.proj" and e["tensor"] == "weight")
    assert record["chosen"]["metrics"]["sqnr_db"] == "inf"
    assert "Infinity" not in text and "NaN" not in text
    loaded = lab_json.load(text)
    entry = next(e for e in loaded.entries if e.layer == "zero.proj" and e.tensor == "weight")
    assert entry.metrics["sqnr_db"] == math.inf


def test_file_records_source_version_and_specs(run, tmp_path):
    model, analysis, choices, _, _ = run
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not really weights")
    model_on_disk = FakeModel()
    model_on_disk.source = str(tmp_path)
    source = describe_source(model_on_disk)
    assert source["kind"] == "directory"
    assert source["files"] == [
        {"name": "model.safetensors", "sha256": hashlib.sha256(b"not really weights").hexdigest()}
    ]
    path = tmp_path / "q.json"
    on_disk = replace(analysis, facts=ModelFacts(source))
    document = lab_json.save_file(on_disk, choices, path)
    assert document["format"] == "observer-lab-qparams" and document["version"] == 2
    assert document["library"]["version"] == ob.__version__
    assert document["entries"][0]["spec"] == analysis.entries[0].spec.to_dict()
    assert lab_json.load_file(path).source == source


def test_produced_file_validates_against_the_schema(run):
    document = json.loads(run[4])
    jsonschema.Draft202012Validator.check_schema(lab_json.schema())
    jsonschema.validate(document, lab_json.schema(), cls=jsonschema.Draft202012Validator)


def _broken(document, edit):
    broken = copy.deepcopy(document)
    edit(broken)
    return json.dumps(broken)


def _error_of(text: str) -> str:
    with pytest.raises(ValueError) as info:
        lab_json.load(text)
    return str(info.value)


@pytest.mark.parametrize("version", [1, 2])
def test_missing_fields_are_all_listed(run, version):
    document = json.loads(run[4])

    def edit(d):
        d["version"] = version
        del d["metric"]
        del d["entries"][0]["spec"]
        del d["entries"][1]["qparams"]["scale"]["bytes_b64"]
        del d["entries"][1]["qparams"]["scale"]["data"]

    message = _error_of(_broken(document, edit))
    assert "'metric' is a required property" in message
    assert "'spec' is a required property" in message
    assert "entries/1/qparams/scale: " in message  # neither bytes nor values


@pytest.mark.parametrize("version", [3, 0, "2"])
def test_a_version_this_lab_does_not_read_is_refused_in_one_line(run, version):
    """A newer lab's file may mean other things by the same fields: refused whole, its other
    problems unlisted, in one line that names the versions this lab reads."""
    document = json.loads(run[4])

    def edit(d):
        d["version"] = version
        del d["metric"]

    message = _error_of(_broken(document, edit))
    assert "\n" not in message and f"has version {version!r}" in message and "reads versions 1 and 2" in message


def _with_values(value):
    """Every tensor of a document with its values (``data``) beside its bytes, however big: what
    version 1 wrote."""
    if isinstance(value, list):
        return [_with_values(v) for v in value]
    if not isinstance(value, dict):
        return value
    if {"shape", "dtype", "bytes_b64"} <= set(value):
        return {**value, "data": ob.qparams.tensor_from_dict(value).flatten().tolist()}
    return {k: _with_values(v) for k, v in value.items()}


def test_a_version_1_file_still_loads_and_restores_bit_exact():
    """Version 1 differs from 2 only in writing every tensor's values: a weight of 600 rows in groups
    of 8 has 4,800 scales, more than version 2 writes as a list."""
    model = FakeModel({"wide.proj": (600, 64), "blk.k_proj": (8, 64)})
    specs = {"weight": ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=8)}
    model, analysis = _analysis(specs, model=model)
    choices = choose(analysis)
    written = lab_json.build_document(analysis, choices)
    scale = written["entries"][0]["qparams"]["scale"]
    assert written["version"] == 2 and scale["shape"] == [600, 8] and "data" not in scale
    old = _with_values(written) | {"version": 1}
    assert len(old["entries"][0]["qparams"]["scale"]["data"]) == 4800
    del old["entries"][0]["qparams"]["scale"]["bytes_b64"]  # values alone: version 1's schema allowed it
    assert lab_json.schema_problems(old) == []
    loaded = lab_json.load(json.dumps(old))
    assert loaded.version == 1 and loaded.choices == choices
    for key, observer in choices.items():
        original = analysis.entry(*key).result(observer).qparams
        for name in ("scale", "zero_point", "min_val", "max_val"):
            assert torch.equal(_bits(getattr(original, name)), _bits(getattr(loaded.qparams[key], name))), key
    restored = lab_apply.restore(json.dumps(old), analysis)
    assert restored.choices == choices and restored.notes == []


def test_bad_tensor_data_spec_and_observer_are_all_listed(run):
    document = json.loads(run[4])

    def edit(d):
        d["entries"][0]["qparams"]["scale"]["data"] = d["entries"][0]["qparams"]["scale"]["data"][:-1]
        d["entries"][1]["spec"]["strategy"] = "group"
        d["entries"][1]["spec"]["group_size"] = None
        d["entries"][2]["chosen"]["observer"] = "no_such_observer"

    message = _error_of(_broken(document, edit))
    assert "entries/0" in message and "bad qparams" in message
    assert "entries/1" in message and "group_size is required" in message
    assert "'no_such_observer' is not in this library" in message


@pytest.mark.parametrize("text", ["not json", "[]", '{"format": "something-else", "version": 1}'])
def test_non_lab_files_are_rejected(text):
    assert _error_of(text)


def test_wrong_model_lists_unknown_layer_and_every_shape_mismatch(run):
    loaded = lab_json.load(run[4])
    other = FakeModel({"blk.q_proj": (16, 96), "blk.k_proj": (8, 64)})
    with pytest.raises(ValueError) as info:
        lab_apply.apply_choices(loaded, ModelFacts.of(other))
    message = str(info.value)
    assert "the model has no layer 'zero.proj'" in message
    assert "blk.q_proj weight: file has weight shape [16, 64], model has [16, 96]" in message
    assert "blk.q_proj weight: scale has shape [16, 2], the layer needs [16, 3]" in message
    assert "blk.k_proj" not in message


def test_expected_qparam_shape_matches_observers():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=32)
    w = torch.randn(10, 70)
    observer = ob.create("minmax", spec)
    observer.observe(w)
    assert stored.expected_qparam_shape(spec, "weight", (10, 70)) == tuple(observer.qparams().scale.shape) == (10, 3)
    assert stored.expected_qparam_shape(spec, "input", (10, 70)) == (3,)
    assert stored.expected_qparam_shape(spec, "output", (10, 70)) == (1,)
    assert stored.expected_qparam_shape(ob.QuantSpec(strategy="token"), "input", (10, 70)) is None


def test_export_rejects_choices_outside_the_analysis(run):
    _, analysis, choices, _, _ = run
    bad = {**choices, ("nope", "weight"): "minmax", ("blk.q_proj", "weight"): "entropy_not_run"}
    with pytest.raises(ValueError) as info:
        lab_json.build_document(analysis, bad)
    assert "nope weight: not in the analysis" in str(info.value)
    assert "'entropy_not_run' was not run" in str(info.value)


# ---------------------------------------------------------------- compressed-tensors


def _read_safetensors(path):
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def test_compressed_tensors_config_parses_and_tensors_match_ct_layout(run, tmp_path):
    model, analysis, choices, _, _ = run
    result = compressed_tensors.save_file(analysis, choices, tmp_path)
    wrapped = json.loads((tmp_path / "quantization_config.json").read_text())
    config = QuantizationConfig.model_validate(wrapped["quantization_config"])
    scheme = config.config_groups["group_0"]
    assert scheme.targets == ["Linear"] and config.ignore == []
    assert scheme.weights.num_bits == 4 and scheme.weights.symmetric is False and scheme.weights.group_size == 32
    tensors = _read_safetensors(tmp_path / "qparams.safetensors")
    for layer in model.weights:
        linear = torch.nn.Linear(64, model.weights[layer].shape[0], bias=False)
        initialize_qparams(linear, "weight", scheme.weights, linear.weight.shape, torch.float32)
        initialize_qparams(linear, "input", scheme.input_activations, linear.weight.shape[-1:], torch.float32)
        # compressed-tensors drops symmetric zero points at save time: the input (int8 sym) has none.
        expected = {
            f"{layer}.{n}": p for n, p in linear.named_parameters() if n != "weight" and n != "input_zero_point"
        }
        ours = {k: v for k, v in tensors.items() if k.startswith(layer + ".")}
        assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in expected.items()}
        qp = analysis.entry(layer, "weight").result(choices[(layer, "weight")]).qparams
        w = model.weights[layer]
        spec = analysis.entry(layer, "weight").spec
        theirs = ct_fake_quantize(w, ours[f"{layer}.weight_scale"], ours[f"{layer}.weight_zero_point"], scheme.weights)
        torch.testing.assert_close(theirs, ob.fake_quantize(w, qp, spec), rtol=0, atol=1e-7)
    assert result.tensor_summary()[f"{layer}.weight_zero_point"]["dtype"] == "int8"
    assert (tmp_path / "observer_lab_notes.txt").read_text().splitlines() == result.notes


def test_compressed_tensors_targets_layer_names_without_model_listing(run):
    _, analysis, choices, _, _ = run
    unlisted = replace(analysis, facts=ModelFacts(analysis.source))
    built = compressed_tensors.build(unlisted, choices)
    assert built.quantization_config["config_groups"]["group_0"]["targets"] == [
        "blk.q_proj",
        "blk.k_proj",
        "zero.proj",
    ]


def test_linear_target_ignores_the_model_layers_not_analysed(run):
    _, analysis, choices, _, _ = run
    types = {
        "blk.q_proj": "Linear",
        "blk.k_proj": "Linear",
        "zero.proj": "Linear",
        "lm_head": "Linear",
        "emb": "Embedding",
    }
    config = compressed_tensors.build(replace(analysis, facts=ModelFacts({}, types)), choices).quantization_config
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert config["ignore"] == ["lm_head"]


def test_observer_differing_from_group_is_noted(run):
    _, analysis, choices, _, _ = run
    override = {**choices, ("blk.k_proj", "weight"): "moving_average_minmax"}
    built = compressed_tensors.build(analysis, override)
    weights = built.quantization_config["config_groups"]["group_0"]["weights"]
    assert weights["observer"] == "static_minmax"
    assert any("blk.k_proj weight: chose 'moving_average_minmax'" in n for n in built.notes)
    # the saved qparams are those of the choice, not of the group's observer
    chosen = analysis.entry("blk.k_proj", "weight").result("moving_average_minmax").qparams
    assert torch.equal(built.tensors["blk.k_proj.weight_scale"], chosen.scale)


@pytest.mark.parametrize(
    ("spec", "tensor", "reason"),
    [
        (ob.QuantSpec(dtype="fp8_e5m2"), "weight", "no fp8_e5m2 element type"),
        (ob.QuantSpec(dtype="fp6_e3m2"), "weight", "no fp6_e3m2 element type"),
        (ob.QuantSpec(dtype="bfp16"), "weight", "no bfp16 element type"),
        (ob.QuantSpec(dtype="mxint8"), "weight", "no mxint8 element type"),
        (ob.QuantSpec(dtype="fp16"), "weight", "placeholder"),
        (ob.QuantSpec(strategy="channel", ch_axis=1), "weight", "output channels (ch_axis 0) only"),
        (ob.QuantSpec(strategy="channel"), "input", "output channels (ch_axis 0) only"),
        (ob.QuantSpec(reduce_range=True), "weight", "reduce_range"),
        (ob.QuantSpec(scale_rule="qmax"), "weight", "scale_rule 'qmax'"),
        (ob.QuantSpec(dtype="mxfp4", group_size=64), "weight", "group size 64"),
    ],
)
def test_settings_without_ct_equivalent_give_reasons(spec, tensor, reason):
    args, reasons = stored.ct_args(spec, tensor)
    assert args is None
    assert any(reason in r for r in reasons), reasons


def test_unsupported_layer_is_noted_and_left_out(tmp_path):
    model, analysis = _analysis({"weight": ob.QuantSpec(dtype="fp8_e5m2"), "input": ob.QuantSpec(dtype="fp8_e4m3")})
    built = compressed_tensors.build(analysis, choose(analysis))
    scheme = built.quantization_config["config_groups"]["group_0"]
    assert scheme["weights"] is None and scheme["input_activations"]["type"] == "float"
    assert not any(name.endswith("weight_scale") for name in built.tensors)
    assert any("no fp8_e5m2 element type; not exported" in n for n in built.notes)
    QuantizationConfig.model_validate(built.quantization_config)


def test_uint8_asymmetric_maps_to_ct_int8_with_shifted_zero_point():
    model, analysis = _analysis({"weight": ob.QuantSpec(dtype="uint8", symmetric=False, strategy="channel")})
    choices = choose(analysis)
    built = compressed_tensors.build(analysis, choices)
    config = QuantizationConfig.model_validate(built.quantization_config)
    args = config.config_groups["group_0"].weights
    layer = "blk.q_proj"
    qp = analysis.entry(layer, "weight").result(choices[(layer, "weight")]).qparams
    zp = built.tensors[f"{layer}.weight_zero_point"]
    assert zp.dtype == torch.int8
    assert torch.equal(zp.to(torch.int32), qp.zero_point - 128)
    w = model.weights[layer]
    theirs = ct_fake_quantize(w, built.tensors[f"{layer}.weight_scale"], zp, args)
    torch.testing.assert_close(theirs, ob.fake_quantize(w, qp, analysis.entry(layer, "weight").spec), rtol=0, atol=1e-7)


def _hand_analysis(spec: ob.QuantSpec, qp: ob.QParams, data: torch.Tensor, tensor: str = "weight") -> Analysis:
    """An analysis holding one hand-made result, to check the writer's conventions for block formats
    independently of the observers that compute their scales."""
    result = SuiteResult("minmax", qp, {"sqnr_db": 20.0}, 0.0, {"ignore_nonfinite": False})
    entry = TensorAnalysis("blk.q_proj", tensor, spec, data, [result])
    return Analysis(ModelFacts({"name": "hand"}), RunConfig(specs={tensor: spec}, observers=("minmax",)), [entry])


def test_mx_scales_are_e8m0_codes_as_compressed_tensors_encodes_them():
    codes = torch.randint(110, 135, (16, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    scale = torch.exp2(codes.float() - 127)
    qp = ob.QParams(scale, torch.zeros_like(scale, dtype=torch.int32), -scale, scale, extras={"scale_exponent": codes})
    analysis = _hand_analysis(ob.QuantSpec(dtype="mxfp4"), qp, torch.randn(16, 64))
    built = compressed_tensors.build(analysis, {("blk.q_proj", "weight"): "minmax"})
    config = QuantizationConfig.model_validate(built.quantization_config)
    args = config.config_groups["group_0"].weights
    assert (args.num_bits, args.group_size, args.scale_dtype) == (4, 32, torch.uint8)
    written = built.tensors["blk.q_proj.weight_scale"]
    assert written.dtype == torch.uint8 and torch.equal(written, compress_mx_scale(scale, torch.uint8))
    assert set(built.tensors) == {"blk.q_proj.weight_scale"}


def test_nvfp4_writes_fp8_block_scales_and_global_scale(tmp_path):
    g = torch.Generator().manual_seed(2)
    scale = (torch.rand(16, 4, generator=g) * 400 + 1).to(torch.float8_e4m3fn).float()
    global_scale = torch.tensor([1234.5])
    qp = ob.QParams(scale, torch.zeros_like(scale, dtype=torch.int32), -scale, scale, global_scale)
    analysis = _hand_analysis(ob.QuantSpec(dtype="nvfp4"), qp, torch.randn(16, 64))
    result = compressed_tensors.save_file(analysis, {("blk.q_proj", "weight"): "minmax"}, tmp_path)
    config = QuantizationConfig.model_validate(result.quantization_config)
    assert config.config_groups["group_0"].weights.strategy == "tensor_group"
    tensors = _read_safetensors(tmp_path / "qparams.safetensors")
    assert tensors["blk.q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(tensors["blk.q_proj.weight_scale"].float(), scale)
    assert tensors["blk.q_proj.weight_global_scale"].dtype == torch.float32
    assert torch.equal(tensors["blk.q_proj.weight_global_scale"], global_scale)


def test_nvfp4_dynamic_input_keeps_only_its_global_scale():
    scale = torch.ones(4)
    qp = ob.QParams(scale, torch.zeros(4, dtype=torch.int32), -scale, scale, torch.tensor([3.0]), kind="activation")
    analysis = _hand_analysis(ob.QuantSpec(dtype="nvfp4", dynamic=True), qp, torch.randn(8, 64), tensor="input")
    built = compressed_tensors.build(analysis, {("blk.q_proj", "input"): "minmax"})
    config = QuantizationConfig.model_validate(built.quantization_config)
    assert config.config_groups["group_0"].input_activations.dynamic == "local"
    assert set(built.tensors) == {"blk.q_proj.input_global_scale"}


@pytest.mark.parametrize("dtype", ["mxfp4", "mxfp8_e4m3", "nvfp4"])
def test_block_formats_from_real_observers_fake_quantize_like_compressed_tensors(dtype):
    model, analysis = _analysis({"weight": ob.QuantSpec(dtype=dtype)})
    choices = choose(analysis)
    built = compressed_tensors.build(analysis, choices)
    args = QuantizationConfig.model_validate(built.quantization_config).config_groups["group_0"].weights
    layer = "blk.q_proj"
    scale = built.tensors[f"{layer}.weight_scale"]
    # compressed-tensors' decompressors turn stored scales back into floats before fake-quantizing
    float_scale = torch.exp2(scale.float() - 127) if scale.dtype == torch.uint8 else scale.float()
    global_scale = built.tensors.get(f"{layer}.weight_global_scale")
    w = model.weights[layer]
    theirs = ct_fake_quantize(w, float_scale, torch.zeros_like(float_scale), args, global_scale=global_scale)
    qp = analysis.entry(layer, "weight").result(choices[(layer, "weight")]).qparams
    torch.testing.assert_close(theirs, ob.fake_quantize(w, qp, analysis.entry(layer, "weight").spec), rtol=0, atol=1e-6)


def test_exports_state_the_nvfp4_global_scale_convention():
    model, analysis = _analysis(specs={"weight": ob.QuantSpec(dtype="nvfp4")}, observers=("minmax",))
    choices = choose(analysis)
    document = lab_json.build_document(analysis, choices)
    assert "global_scale = 448 * 6 / amax" in document["global_scale_convention"]
    built = compressed_tensors.build(analysis, choices)
    assert any("weight_scale_2" in note for note in built.notes)
    _, plain = _analysis(observers=("minmax",))
    assert "global_scale_convention" not in lab_json.build_document(plain, choose(plain))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_exports_refuse_a_non_finite_or_non_positive_scale(bad):
    _, analysis = _analysis(observers=("minmax",))
    entry = analysis.entry("blk.q_proj", "weight")
    broken = copy.deepcopy(entry.result("minmax"))
    broken.qparams.scale.view(-1)[3] = bad
    entry.results[entry.results.index(entry.result("minmax"))] = broken
    choices = choose(analysis)
    for export in (lab_json.build_document, compressed_tensors.build):
        with pytest.raises(ValueError, match="blk.q_proj weight: observer 'minmax' gave 1 non-finite or non-positive"):
            export(analysis, choices)


def test_compressed_tensors_records_knobs_not_the_calibration_tensors_the_lab_filled_in():
    _, analysis = _analysis(observers=("imatrix_mse",))
    entry = analysis.entry("blk.q_proj", "weight")
    assert entry.result("imatrix_mse").knobs["importance"] is not None  # filled from the captured inputs
    built = compressed_tensors.build(analysis, choose(analysis))
    weights = built.quantization_config["config_groups"]["group_0"]["weights"]
    assert weights["observer"] == "imatrix_mse" and "importance" not in weights["observer_kwargs"]


def test_tensor_data_that_is_not_numbers_is_one_clear_problem(run):
    document = json.loads(run[4])

    def edit(d):
        d["entries"][0]["qparams"]["scale"]["data"][0] = "x"
        d["entries"][1]["qparams"]["scale"]["bytes_b64"] = "not base64!"

    message = _error_of(_broken(document, edit))
    assert "entries/0" in message and "must be a flat list of float32 values" in message
    assert "entries/1" in message and "bytes_b64 is not base64" in message


def test_a_big_tensor_is_written_as_bytes_only_and_reads_back_bit_exact():
    big = torch.randn(ob.qparams.DATA_LIMIT + 1)
    record = ob.qparams.tensor_to_dict(big)
    assert "data" not in record and set(record) == {"shape", "dtype", "bytes_b64"}
    assert torch.equal(ob.qparams.tensor_from_dict(record), big)
    small = ob.qparams.tensor_to_dict(big[:8])
    assert small["data"] == big[:8].tolist()
    small["data"][3] += 1.0
    with pytest.raises(ValueError, match="data and bytes_b64 disagree"):
        ob.qparams.tensor_from_dict(small)
