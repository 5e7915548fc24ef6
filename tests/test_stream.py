"""The calibration stream (``lab.calibrate.stream``, ``lab.calibrate.activations``): every
calibration batch goes through the observers inside the capture hooks, so ranges are exact over
every token while only a bounded sample of tokens is kept; moving averages see the batches as they
come; the capture hands over every real token, in order, whole-model or block by block."""

from __future__ import annotations

import pytest
import torch

import observers as ob
from lab.analyse import run_config
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import lab_json
from lab.results import choose
from sample_models import open_model

CALIBRATION = {"samples": 24, "seq_len": 32}
LAYERS = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


def _batches(model, names, sequential=False, outputs=False, name="capture", **options):
    """Every batch the capture hands its stream: ``[{key: rows}]`` in call order."""
    seen = []
    getattr(model, name)(
        names,
        stream=lambda keys, rows: seen.append(dict(rows)),
        sequential=sequential,
        **CALIBRATION | options,
        **({"outputs": outputs} if name == "capture" else {}),
    )
    return seen


def test_the_stream_gets_every_real_token_in_order(llama):
    whole = llama.capture(LAYERS, outputs=True, **CALIBRATION, max_bytes=1 << 30)
    for sequential in (False, True):
        batches = _batches(llama, LAYERS, sequential=sequential, outputs=True)
        for layer in LAYERS:
            for side, expected in (("input", whole[layer]), ("output", whole.outputs[layer])):
                rows = [batch[(layer, side)] for batch in batches if (layer, side) in batch]
                assert len(rows) == 3  # 24 samples, batches of 8
                assert torch.equal(torch.cat(rows), expected)


def test_layers_fed_one_tensor_get_one_rows_object(llama):
    q, k = LAYERS[1:]
    for batch in _batches(llama, LAYERS):
        assert batch[(q, "input")] is batch[(k, "input")]


def test_key_value_states_stream_every_token(llama):
    block = llama.attention_blocks()[0]
    whole = llama.capture_kv([block], **CALIBRATION, max_bytes=1 << 30)
    batches = _batches(llama, [block], name="capture_kv")
    for which in "kv":
        assert torch.equal(torch.cat([b[(block, which)] for b in batches], dim=2), whole[block][which])


def test_ranges_are_exact_over_every_token_while_the_sample_is_bounded(llama, monkeypatch):
    """With a sample budget far below the calibration set, min-max and histogram observers still see
    every token: their qparams equal those computed on the whole unsampled capture, batch by batch."""
    monkeypatch.setattr(run_config, "SAMPLE_BYTES", 64 << 10)
    spec = ob.QuantSpec("int8")
    names = ("minmax", "memoryless_minmax", "moving_average_minmax", "percentile", "histogram")
    config = RunConfig(specs={"input": spec}, observers=names, **CALIBRATION)
    analysis = analyse(llama, LAYERS[:1], config)
    entry = analysis.entry(LAYERS[0], "input")
    per_batch = [b[(LAYERS[0], "input")] for b in _batches(llama, LAYERS[:1])]
    whole = torch.cat(per_batch)
    assert entry.shape == tuple(whole.shape) and entry.num_tokens == whole.shape[0]
    assert entry.metrics_tokens == entry.data.shape[0] < whole.shape[0] // 4
    assert entry.metrics_note == f"metrics on {entry.metrics_tokens:,} of {whole.shape[0]:,} tokens"
    for name in names:
        streamed = entry.result(name)
        expected = ob.run_one(name, per_batch, spec, "activation")
        assert torch.equal(streamed.qparams.scale, expected.qparams.scale), name
        assert streamed.num_observed_tokens == whole.shape[0]
    minmax = entry.result("minmax").qparams.scale
    assert torch.equal(minmax, ob.run_one("minmax", whole, spec, "activation").qparams.scale)  # exact, whole
    last = ob.run_one("minmax", per_batch[-1], spec, "activation").qparams.scale
    assert torch.equal(entry.result("memoryless_minmax").qparams.scale, last)  # the last batch, as llm-compressor
    assert not torch.equal(minmax, last)


def test_the_lab_file_records_the_whole_shape_and_the_metrics_sample(llama, monkeypatch):
    monkeypatch.setattr(run_config, "SAMPLE_BYTES", 64 << 10)
    config = RunConfig(specs={"input": ob.QuantSpec("int8")}, observers=("minmax",), **CALIBRATION)
    analysis = analyse(llama, LAYERS[:1], config)
    (record,) = lab_json.build_document(analysis, choose(analysis))["entries"]
    entry = analysis.entries[0]
    assert record["tensor_shape"] == [entry.num_tokens, entry.data.shape[1]]
    assert record["metrics_tokens"] == entry.metrics_tokens
    assert 0 < record["metrics_tokens"] < entry.num_tokens


def test_sequential_and_whole_model_streams_give_the_same_results(llama):
    config = RunConfig(specs={"input": ob.QuantSpec("int8")}, observers=("minmax", "mse_grid"), **CALIBRATION)
    whole = analyse(llama, LAYERS, config)
    one_block_at_a_time = analyse(llama, LAYERS, RunConfig(**{**vars(config), "sequential": True}))
    for a, b in zip(whole.entries, one_block_at_a_time.entries, strict=True):
        for x, y in zip(a.results, b.results, strict=True):
            assert torch.equal(x.qparams.scale, y.qparams.scale)


def test_moe_experts_stream_the_tokens_routed_to_them():
    moe = open_model("tiny-moe")
    experts = [name for name in (i.name for i in moe.layers()) if ".experts." in name][:3]
    spec = ob.QuantSpec("int8")
    config = RunConfig(specs={"input": spec}, observers=("minmax",), **CALIBRATION)
    analysis = analyse(moe, experts, config)
    whole = moe.capture(experts, **CALIBRATION, max_bytes=1 << 30)
    for name in experts:
        entry = analysis.entry(name, "input")
        assert entry.num_tokens == whole.token_counts[name] == whole[name].shape[0]
        if entry.num_tokens:
            expected = ob.run_one("minmax", whole[name], spec, "activation").qparams.scale
            assert torch.equal(entry.result("minmax").qparams.scale, expected)
        else:
            assert entry.result("minmax").error == "saw no calibration tokens"


def test_an_analysis_holds_no_whole_weight_and_reads_it_again_when_asked(llama):
    config = RunConfig(specs={"weight": ob.QuantSpec("int8")}, observers=("minmax",))
    entry = analyse(llama, LAYERS[:1], config).entries[0]
    assert not isinstance(entry.source, torch.Tensor) and callable(entry.source)
    assert torch.equal(entry.data, llama.weight(LAYERS[0])) and entry.shape == tuple(llama.weight(LAYERS[0]).shape)
    rotated = RunConfig(**{**vars(config), "transform": ob.TransformSpec(kind="hadamard")})
    seen = analyse(llama, LAYERS[:1], rotated).entries[0]
    assert torch.equal(seen.data, ob.transform_layer(rotated.transform, llama.weight(LAYERS[0]), None)[0])


def test_propagation_calibrates_a_block_behind_the_quantized_blocks_before_it(llama):
    """With ``propagate`` block 1 sees block 0's outputs with block 0's chosen tensors fake-quantized
    (llm-compressor's propagate_error): the same inputs as a whole-model forward with those tensors
    fake-quantized by hooks; block 0 itself is calibrated as without propagation."""
    import threading

    from lab.results import choose
    from sample_models.effect import TensorQuant, quantizing_hooks

    spec = ob.QuantSpec("int4", strategy="channel")
    first, second = LAYERS[0], LAYERS[1]
    config = RunConfig(specs={"weight": spec, "input": spec}, observers=("minmax",), **CALIBRATION)
    floating = analyse(llama, [first, second], config)
    propagated = analyse(llama, [first, second], RunConfig(**{**vars(config), "propagate": True}))
    assert propagated.config.capture_options()["sequential"] is True
    for tensor in ("weight", "input"):
        scales = [a.entry(first, tensor).result("minmax").qparams.scale for a in (propagated, floating)]
        assert torch.equal(*scales)
    chosen = choose(propagated)
    quantization = {
        (first, t): TensorQuant(spec, propagated.entry(first, t).result(chosen[(first, t)]).qparams)
        for t in ("weight", "input")
    }
    with quantizing_hooks(llama.module(), quantization, llama.config.num_attention_heads, threading.get_ident()):
        behind = llama.capture([second], sequential=False, max_bytes=1 << 30, **CALIBRATION)[second]
    expected = ob.run_one("minmax", behind, spec, "activation").qparams.scale
    seen = propagated.entry(second, "input").result("minmax").qparams.scale
    torch.testing.assert_close(seen, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(seen, floating.entry(second, "input").result("minmax").qparams.scale)
    assert propagated.config.to_dict()["propagate"] and propagated.config.calibration_key() != config.calibration_key()


def test_propagation_refuses_the_whole_model_capture():
    with pytest.raises(ValueError, match="block by block"):
        RunConfig(specs={"input": ob.QuantSpec("int8")}, propagate=True, sequential=False)


def test_the_cli_propagates_on_request_and_refuses_it_with_the_whole_model(tmp_path):
    import io
    import json

    from lab.cli import main

    argv = ["run", "tiny-llama", "--layers", ",".join(LAYERS[:2]), "--format", "int8", "--kinds", "weight,input"]
    argv += ["--observers", "minmax", "--samples", "8", "--seq-len", "16", "--quiet"]
    out, err = io.StringIO(), io.StringIO()
    assert main([*argv, "--propagate", "--out", str(tmp_path / "q.json")], out=out, err=err) == 0, err.getvalue()
    assert json.loads((tmp_path / "q.json").read_text())["config"]["propagate"] is True
    err = io.StringIO()
    assert main([*argv, "--propagate", "--whole-model", "--out", str(tmp_path / "w.json")], out=out, err=err) == 2
    assert err.getvalue().count("\n") == 1 and "block by block" in err.getvalue()
    assert not (tmp_path / "w.json").exists()


def test_layers_fed_one_tensor_are_observed_once_statistics_included(llama):
    """q and k read one hidden state: k's input results are q's very results, and the importance
    k's weight observer takes is the one gathered over q's (the same) inputs, over every token."""
    q, k = LAYERS[1:]
    specs = {"weight": ob.QuantSpec("int4", strategy="channel"), "input": ob.QuantSpec("int8")}
    config = RunConfig(specs=specs, observers=("minmax", "imatrix_mse"), **CALIBRATION)
    analysis = analyse(llama, [q, k], config)
    assert analysis.entry(k, "input").results[0] is analysis.entry(q, "input").results[0]
    importance = [analysis.entry(name, "weight").result("imatrix_mse").knobs["importance"] for name in (q, k)]
    whole = torch.cat([b[(q, "input")] for b in _batches(llama, [q])])
    torch.testing.assert_close(importance[0], importance[1], rtol=0, atol=0)
    torch.testing.assert_close(importance[1], ob.column_importance(whole), rtol=1e-5, atol=0)
