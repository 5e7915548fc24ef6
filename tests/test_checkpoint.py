"""The compressed checkpoint (``lab.export.checkpoint``): written from an Observer Lab file, packed by
compressed-tensors' own compressors, loaded back by transformers.

Round trips: a dequantized load (compressed-tensors' ``dequantize``) gives the lab's fake-quantized
weights bit for bit, the layers not chosen are the model's own, and the packed model's forward
equals the dequantized one's (with the lab's input fake-quantization, which ``dequantize`` drops).
compressed-tensors decompresses FP4 formats through bfloat16, so NVFP4 is checked as it is served,
on a bfloat16 load."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import safetensors.torch as safetensors_torch
import torch
from transformers import AutoModel
from transformers.utils.quantization_config import CompressedTensorsConfig

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import checkpoint, lab_json, model_dir, packing
from lab.provenance import made_by
from sample_models import open_model

ATTENTION_OUT = "encoder.layer.0.attention.output.dense"  # no server fuses it with another layer
FFN = "encoder.layer.0.intermediate.dense"
UNCHOSEN = "encoder.layer.1.output.dense"
IDS = torch.tensor([[101, 2023, 2003, 1037, 3231, 1997, 1996, 10938, 102]])


@pytest.fixture(scope="module")
def minilm():
    return open_model("minilm")


def _lab_file(model, spec: ob.QuantSpec, choices: dict, input_spec: ob.QuantSpec | None = None):
    specs = {"weight": spec} | ({} if input_spec is None else {"input": input_spec})
    observers = tuple(sorted(set(choices.values())))
    config = RunConfig(specs=specs, observers=observers, samples=4, seq_len=32)
    analysis = analyse(model, [ATTENTION_OUT, FFN], config)
    chosen = {(layer, "weight"): observer for layer, observer in choices.items()}
    if input_spec is not None:
        chosen |= {(layer, "input"): "minmax" for layer in choices}
    return lab_json.parse_document(lab_json.build_document(analysis, chosen))


def _entry(lab_file, layer: str, tensor: str = "weight"):
    return next(e for e in lab_file.entries if (e.layer, e.tensor) == (layer, tensor))


def _round_trip(model, lab_file, directory, dtype=torch.float32):
    written = checkpoint.write(lab_file, model, directory)
    dequantize = CompressedTensorsConfig(dequantize=True)
    dequantized = AutoModel.from_pretrained(directory, quantization_config=dequantize, dtype=dtype)
    packed = AutoModel.from_pretrained(directory, dtype=dtype)
    for layer in (ATTENTION_OUT, FFN):
        entry = _entry(lab_file, layer)
        fake = ob.fake_quantize(model.weight(layer).float(), entry.qparams, entry.spec).to(dtype)
        assert torch.equal(dequantized.get_submodule(layer).weight.detach(), fake), layer
    original = model.module().get_submodule(UNCHOSEN).weight.to(dtype)
    assert torch.equal(dequantized.get_submodule(UNCHOSEN).weight.detach(), original)
    # compressed-tensors' dequantize option drops activation quantization: the lab's own input
    # fake-quantization put back on the dequantized model must give the packed model's outputs.
    for entry in (e for e in lab_file.entries if e.tensor == "input"):
        quantize = lambda module, args, entry=entry: (ob.fake_quantize(args[0], entry.qparams, entry.spec),)
        dequantized.get_submodule(entry.layer).register_forward_pre_hook(quantize)
    with torch.no_grad():
        a = dequantized(input_ids=IDS).last_hidden_state
        b = packed(input_ids=IDS).last_hidden_state
    assert torch.equal(a, b)
    return written


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "format_name"),
    [
        (ob.QuantSpec("int4", strategy="group", group_size=32), "pack-quantized"),
        (ob.QuantSpec("int8", strategy="channel"), "pack-quantized"),
        (ob.QuantSpec("fp8_e4m3", strategy="channel"), "naive-quantized"),
    ],
    ids=["int4-group", "int8-channel", "fp8-channel"],
)
def test_round_trip_is_bit_exact(minilm, tmp_path, spec, format_name):
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "minmax"})
    written = _round_trip(minilm, lab_file, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quantization_status"] == "compressed" and config["format"] == format_name
    (group,) = config["config_groups"].values()
    assert sorted(group["targets"]) == sorted([ATTENTION_OUT, FFN])
    assert UNCHOSEN in config["ignore"] and ATTENTION_OUT not in config["ignore"]
    assert written.packed_layers == [ATTENTION_OUT, FFN]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "format_name"),
    [
        ("nvfp4", "nvfp4-pack-quantized"),
        ("mxfp4", "mxfp4-pack-quantized"),
        ("mxfp6_e2m3", "mxfp6-pack-quantized"),
        ("mxfp8_e4m3", "mxfp8-quantized"),
    ],
)
def test_block_formats_round_trip_in_bfloat16(minilm, tmp_path, dtype, format_name):
    lab_file = _lab_file(minilm, ob.QuantSpec(dtype), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    _round_trip(minilm, lab_file, tmp_path / "out", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == format_name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "format_name"),
    [
        (ob.QuantSpec("int8", strategy="channel"), "int-quantized"),
        (ob.QuantSpec("fp8_e4m3", strategy="channel"), "float-quantized"),
    ],
    ids=["w8a8-int", "w8a8-fp8"],
)
def test_weights_and_static_inputs_round_trip(minilm, tmp_path, spec, format_name):
    input_spec = ob.QuantSpec(spec.dtype)
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "minmax"}, input_spec=input_spec)
    _round_trip(minilm, lab_file, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == format_name


@pytest.mark.slow
def test_mixed_choice_gets_a_group_per_observer_with_input_scales(minilm, tmp_path):
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "mse_grid"}, input_spec=ob.QuantSpec("int8"))
    run = {"id": "20261127-070905-a1b2c3", "who": "alice@example.com", "when": "2026-11-27T07:09:05+00:00"}
    lab_file = replace(lab_file, provenance=made_by("bob@example.com", run))  # who asked (issue 40)
    _round_trip(minilm, lab_file, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["observer"]: g for g in config["config_groups"].values()}
    assert set(groups) == {"static_minmax", "memoryless_mse"}
    assert groups["static_minmax"]["targets"] == [ATTENTION_OUT] and groups["memoryless_mse"]["targets"] == [FFN]
    assert groups["static_minmax"]["input_activations"]["num_bits"] == 8
    loaded = AutoModel.from_pretrained(tmp_path / "out")
    for layer in (ATTENTION_OUT, FFN):
        expected = _entry(lab_file, layer, "input").qparams.scale.float().reshape(-1)
        assert torch.equal(loaded.get_submodule(layer).input_scale.detach().float().reshape(-1), expected)
    notes = (tmp_path / "out" / checkpoint.NOTES_FILE).read_text()
    assert f"{FFN} weight: mse_grid" in notes
    assert f"\nasked for by bob@example.com at {lab_file.provenance['asked_at']}\n" in notes
    assert "\nfrom run 20261127-070905-a1b2c3, asked for by alice@example.com at 2026-11-27T07:09:05+00:00\n" in notes
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_a_format_compressed_tensors_cannot_pack_stays_dense_with_a_note(minilm, tmp_path):
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "minmax"})
    odd = ob.QuantSpec("int4", strategy="group", group_size=32, scale_rule="qmax")
    entries = [e if e.layer != FFN else _with(e, spec=odd) for e in lab_file.entries]
    written = checkpoint.write(_replace(lab_file, entries), minilm, tmp_path / "out")
    assert written.packed_layers == [ATTENTION_OUT]
    assert any(note.startswith(f"{FFN} weight: scale_rule") and "stays dense" in note for note in written.notes)
    loaded = AutoModel.from_pretrained(tmp_path / "out", quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(loaded.get_submodule(FFN).weight, minilm.module().get_submodule(FFN).weight)


def test_asymmetric_integer_weights_stay_dense_as_compressed_tensors_cannot_load_them_packed(minilm, tmp_path):
    spec = ob.QuantSpec("int4", strategy="group", group_size=32)
    asymmetric = ob.QuantSpec("int4", strategy="group", group_size=32, symmetric=False)
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "minmax"})
    mixed = _lab_file(minilm, asymmetric, {ATTENTION_OUT: "minmax", FFN: "minmax"})
    entries = [e if e.layer != FFN else _entry(mixed, FFN) for e in lab_file.entries]
    written = checkpoint.write(_replace(lab_file, entries), minilm, tmp_path / "out")
    assert written.packed_layers == [ATTENTION_OUT]
    assert any(note.startswith(f"{FFN} weight: stays dense") for note in written.notes)
    loaded = AutoModel.from_pretrained(tmp_path / "out", quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(loaded.get_submodule(FFN).weight, minilm.module().get_submodule(FFN).weight)


def _with(entry, **changes):
    return replace(entry, **changes)


def _replace(lab_file, entries):
    return replace(lab_file, entries=entries)


def _scaled(entry, value: float):
    scale = entry.qparams.scale.clone()
    scale.view(-1)[0] = value
    return _with(entry, qparams=replace(entry.qparams, scale=scale))


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_a_bad_scale_is_refused_naming_the_tensor_and_nothing_is_written(minilm, tmp_path, value):
    lab_file = _lab_file(minilm, ob.QuantSpec("int8", strategy="channel"), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    entries = [_scaled(e, value) if e.layer == FFN else e for e in lab_file.entries]
    with pytest.raises(checkpoint.CheckpointError, match=f"{FFN} weight"):
        checkpoint.write(_replace(lab_file, entries), minilm, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_non_empty_directory_is_refused_unless_overwrite(minilm, tmp_path):
    lab_file = _lab_file(minilm, ob.QuantSpec("int8", strategy="channel"), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="not empty; pass --overwrite"):
        checkpoint.write(lab_file, minilm, out)
    assert (out / "keep.txt").read_text() == "mine"
    checkpoint.write(lab_file, minilm, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_choices_for_another_model_are_refused_naming_both(minilm, tmp_path):
    lab_file = _lab_file(minilm, ob.QuantSpec("int8", strategy="channel"), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    other = open_model("tiny-llama")
    with pytest.raises(checkpoint.CheckpointError, match="made for the model 'minilm', not for 'tiny-llama'"):
        checkpoint.write(lab_file, other, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_qparams_that_do_not_fit_the_model_are_refused(minilm, tmp_path):
    lab_file = _lab_file(minilm, ob.QuantSpec("int8", strategy="channel"), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    entry = _entry(lab_file, FFN)
    short = _with(entry, qparams=replace(entry.qparams, scale=entry.qparams.scale[:7]))
    entries = [e if e.layer != FFN else short for e in lab_file.entries]
    with pytest.raises(checkpoint.CheckpointError, match=f"{FFN} weight: scale has shape"):
        checkpoint.write(_replace(lab_file, entries), minilm, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_model_built_in_memory_with_kv_scales_loads_as_a_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    llama = open_model("tiny-llama")
    blocks = llama.attention_blocks()
    layers = [name for name in (info.name for info in llama.layers()) if name.endswith("mlp.down_proj")]
    specs = {"weight": ob.QuantSpec("int8", strategy="channel"), "kv": ob.QuantSpec("fp8_e4m3")}
    analysis = analyse(
        llama, layers, RunConfig(specs=specs, observers=("minmax",), samples=4, seq_len=32), attention=blocks
    )
    chosen = {key: "minmax" for key in analysis.keys()}
    lab_file = lab_json.parse_document(lab_json.build_document(analysis, chosen))
    checkpoint.write(lab_file, llama, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["type"] == "float" and config["kv_cache_scheme"]["num_bits"] == 8
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for block in blocks:
        for which in "kv":
            expected = _entry(lab_file, block, which).qparams.scale.float().reshape(-1)
            got = loaded.get_submodule(block).get_parameter(f"{which}_scale").detach().float().reshape(-1)
            assert torch.equal(got, expected), (block, which)
    layer = layers[0]
    dequantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    entry = _entry(lab_file, layer)
    fake = ob.fake_quantize(llama.weight(layer).float(), entry.qparams, entry.spec)
    assert torch.equal(dequantized.get_submodule(layer).weight.detach(), fake)
    with torch.no_grad():
        out = loaded.generate(torch.tensor([[1, 5, 9, 13]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_weights_are_written_in_files_of_bounded_size_with_an_index(minilm, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "FILE_BYTES", 8 << 20)
    lab_file = _lab_file(minilm, ob.QuantSpec("int8", strategy="channel"), {ATTENTION_OUT: "minmax", FFN: "minmax"})
    _round_trip(minilm, lab_file, tmp_path / "out")
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 3 and not (tmp_path / "out" / "model.safetensors").exists()
    index = json.loads((tmp_path / "out" / model_dir.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    word_embeddings = 30522 * 384 * 4  # a tensor over the bound gets a file of its own
    assert max(f.stat().st_size for f in files) < word_embeddings + (1 << 20)
    assert sorted(f.stat().st_size for f in files)[-2] < (8 << 20) + (1 << 20)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        (ob.QuantSpec("int4", strategy="group", group_size=32), torch.float32),
        (ob.QuantSpec("int8", strategy="tensor"), torch.float32),
        (ob.QuantSpec("nvfp4"), torch.bfloat16),
        (ob.QuantSpec("mxfp4"), torch.bfloat16),
    ],
    ids=["int4-group", "int8-tensor", "nvfp4", "mxfp4"],
)
def test_a_weight_packed_a_slice_of_rows_at_a_time_is_the_same(minilm, tmp_path, monkeypatch, spec, dtype):
    lab_file = _lab_file(minilm, spec, {ATTENTION_OUT: "minmax", FFN: "minmax"})
    checkpoint.write(lab_file, minilm, tmp_path / "whole")
    monkeypatch.setattr(packing, "CHUNK_ELEMENTS", 7 * 384)  # 7 rows of the attention output, 18 of the FFN's 1536
    _round_trip(minilm, lab_file, tmp_path / "sliced", dtype=dtype)
    whole = safetensors_torch.load_file(str(tmp_path / "whole" / "model.safetensors"))
    sliced = safetensors_torch.load_file(str(tmp_path / "sliced" / "model.safetensors"))
    assert whole.keys() == sliced.keys()
    for key in whole:
        assert torch.equal(whole[key].view(torch.uint8), sliced[key].view(torch.uint8)), key
