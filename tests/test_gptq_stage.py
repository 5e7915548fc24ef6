"""GPTQ as a stage of a run (issue 33, first part): ``RunConfig.gptq`` captures each layer's inputs
for their Hessian even when only weights are analysed, puts every weight observer's qparams through
GPTQ, and reports round-to-nearest and GPTQ side by side; the CLI's ``--gptq`` flags and bad input."""

from __future__ import annotations

import io
import json

import pytest
import torch

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.gptq.table import gptq_frame
from sample_models import open_model

SPEC = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
SAMPLES, SEQ_LEN = 4, 32


@pytest.fixture(scope="module")
def model():
    return open_model("tiny-llama")


def _layers(model, count: int = 3) -> list[str]:
    return [info.name for info in model.layers() if info.type == "Linear"][:count]


def _config(**gptq) -> RunConfig:
    return RunConfig(
        specs={"weight": SPEC},
        observers=("minmax", "mse_grid"),
        samples=SAMPLES,
        seq_len=SEQ_LEN,
        gptq=ob.GPTQSpec(**gptq),
    )


def test_a_weights_only_run_reports_every_observer_under_rtn_and_gptq(model):
    layers = _layers(model)
    analysis = analyse(model, layers, _config())
    frame = gptq_frame(analysis)
    assert sorted(set(frame["layer"])) == sorted(layers) and set(frame["observer"]) == {"minmax", "mse_grid"}
    assert frame["error"].isna().all() and not frame["fallback"].any()
    assert (frame["gptq_error"] < frame["rtn_error"]).all()  # error feedback helps on every layer here
    assert frame[["rtn_error", "gptq_error", "rtn_clipped", "gptq_clipped"]].notna().all().all()
    assert set(frame["gptq_rank"]) <= {1, 2} and set(frame["rtn_rank"]) <= {1, 2}
    assert analysis.config.to_dict()["gptq"] == {
        "block_size": 128,
        "dampening": 0.01,
        "actorder": "static",
        "scales": "fixed",
    }


def test_the_errors_are_those_of_the_layer_outputs_on_every_calibration_token(model):
    """The streamed Hessian (batch by batch, no token kept) gives the relative ‖WX − ŴX‖² that the
    captured inputs give directly, for round-to-nearest and GPTQ alike."""
    layer = _layers(model, 1)[0]
    config = _config(actorder="none")
    analysis = analyse(model, [layer], config)
    entry = analysis.entry(layer, "weight")
    inputs = model.capture([layer], samples=SAMPLES, seq_len=SEQ_LEN, batch_size=config.batch_size)[layer].double()
    weight = model.weight(layer).double()
    hessian = 2 * inputs.T @ inputs / inputs.shape[0]
    for row, result in zip(entry.gptq, entry.results, strict=True):
        rtn = ob.fake_quantize(weight.float(), result.qparams, SPEC).double()
        direct = ((inputs @ (weight - rtn).T) ** 2).sum() / ((inputs @ weight.T) ** 2).sum()
        assert row.rtn_error == pytest.approx(float(direct), rel=1e-4)
        done = ob.gptq_quantize(weight.float(), hessian.float(), SPEC, lambda w, r=result: r.qparams, actorder="none")
        direct = ((inputs @ (weight - done.weight.double()).T) ** 2).sum() / ((inputs @ weight.T) ** 2).sum()
        assert row.gptq_error == pytest.approx(float(direct), rel=1e-3)


def test_refit_scales_run_the_observer_per_group(model):
    layers = _layers(model, 2)
    fixed = gptq_frame(analyse(model, layers, _config(scales="fixed", actorder="none")))
    refit = gptq_frame(analyse(model, layers, _config(scales="refit", actorder="none")))
    assert refit["error"].isna().all()
    assert (refit["gptq_clipped"] <= fixed["gptq_clipped"] + 1e-12).all()  # refit ranges follow the updated weights
    assert not refit["gptq_error"].equals(fixed["gptq_error"])


def test_gptq_without_weights_or_on_weights_only_sources_is_one_line(model, tmp_path):
    with pytest.raises(ValueError, match="GPTQ quantizes weights"):
        RunConfig(specs={"input": ob.QuantSpec(dtype="int8")}, gptq=ob.GPTQSpec())
    with pytest.raises(ValueError, match="--gptq: GPTQ does not serve dynamic"):
        RunConfig(specs={"weight": ob.QuantSpec(dtype="int8", dynamic=True)}, gptq=ob.GPTQSpec())
    with pytest.raises(ValueError, match="actorder"):
        ob.GPTQSpec(actorder="sideways")
    for order in ("group", "dynamic"):  # llm-compressor's word for it is refused alike
        with pytest.raises(ValueError, match="block format"):
            RunConfig(specs={"weight": ob.QuantSpec(dtype="nvfp4")}, gptq=ob.GPTQSpec(actorder=order))
    from safetensors.torch import save_file

    weights = tmp_path / "weights.safetensors"
    save_file({"layer.weight": torch.randn(8, 32)}, str(weights))
    with pytest.raises(ValueError, match="holds weights only"):
        analyse(open_model(str(weights)), ["layer"], _config())


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_cli_prints_the_table_and_records_gptq_in_the_json(tmp_path):
    target = tmp_path / "run.json"
    code, out, err = _cli(
        "run",
        "tiny-llama",
        "--layers",
        "model.layers.0.mlp.*",
        "--kinds",
        "weight",
        "--format",
        "int4",
        "--strategy",
        "group",
        "--group-size",
        "16",
        "--observers",
        "minmax,mse_grid",
        "--samples",
        "4",
        "--seq-len",
        "32",
        "--gptq",
        "--gptq-scales",
        "refit",
        "--gptq-actorder",
        "none",
        "--out",
        str(target),
        "--quiet",
    )
    assert code == 0, err
    assert "# GPTQ (refit scales, actorder none, block 128, dampening 0.01)" in out
    lines = [line for line in out.splitlines() if "\tgptq " in line]
    assert len(lines) == 3 * 2 and all("clipped" in line for line in lines)
    config = json.loads(target.read_text())["config"]
    assert config["gptq"] == {"block_size": 128, "dampening": 0.01, "actorder": "none", "scales": "refit"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gptq-scales", "refit"], "need --gptq"),
        (["--gptq", "--gptq-block-size", "0"], "block_size must be a positive integer"),
        (["--gptq", "--kinds", "input"], "GPTQ quantizes weights"),
    ],
)
def test_bad_gptq_flags_are_one_line(tmp_path, flags, message):
    code, _, err = _cli(
        "run", "tiny-llama", "--layers", "model.layers.0.mlp.up_proj", "--format", "int4", "--out",
        str(tmp_path / "x.json"), *flags
    )
    assert code == 2 and message in err and err.count("\n") == 1 and not (tmp_path / "x.json").exists()


def test_choosing_by_a_gptq_figure_ranks_weights_by_it_and_activations_by_the_default(model, tmp_path):
    from lab import results
    from lab.export import lab_json

    layers = _layers(model, 2)
    config = RunConfig(
        specs={"weight": SPEC, "input": ob.QuantSpec(dtype="int8")},
        observers=("minmax", "mse_grid"),
        samples=SAMPLES,
        seq_len=SEQ_LEN,
        gptq=ob.GPTQSpec(),
    )
    analysis = analyse(model, layers, config)
    chosen = results.choose(analysis, "gptq:gptq_error")
    frame = gptq_frame(analysis)
    for layer in layers:
        rows = frame[frame["layer"] == layer]
        assert chosen[(layer, "weight")] == rows.loc[rows["gptq_error"].idxmin(), "observer"]
        assert chosen[(layer, "input")] == results.choose(analysis)[(layer, "input")]
    assert results.higher_is_better("gptq:gptq_clipped") is False
    with pytest.raises(ValueError, match="gptq:gptq_error"):
        results.check_metric("gptq:nothing")
    path = tmp_path / "by_gptq.json"
    lab_json.save_file(analysis, chosen, str(path), "gptq:gptq_error")
    assert lab_json.load_file(str(path)).metric == "gptq:gptq_error"


def test_held_out_errors_come_from_inputs_gptq_never_fitted(model):
    """The held-out Hessian is that of the layer's inputs over the held-out paragraphs (the float
    model, the calibration set's windows); GPTQ fits the calibration tokens, so its error there is
    below its held-out error, while round-to-nearest, which fits nothing, is not flattered alike."""
    from sample_models.effect import held_out_texts

    layer = _layers(model, 1)[0]
    analysis = analyse(model, [layer], _config())
    captured = model.capture([layer], held_out_texts(), SAMPLES, SEQ_LEN, max_bytes=1 << 30, sequential=False)
    expected = ob.hessian_of_rows(captured[layer].float())
    entry = analysis.entry(layer, "weight")
    for row in entry.gptq:
        qparams = entry.result(row.observer).qparams
        rtn = ob.fake_quantize(entry.data.float(), qparams, SPEC)
        by_hand = ob.layer_output_error(entry.data, rtn, expected)
        torch.testing.assert_close(row.rtn_held_out, by_hand, rtol=1e-4, atol=0)
        assert row.gptq_held_out > row.gptq_error
        assert row.gptq_held_out / row.gptq_error > row.rtn_held_out / row.rtn_error
    frame = gptq_frame(analysis)
    assert frame["held_out_rank"].notna().all() and set(frame["held_out_rank"]) <= {1, 2}


def test_layers_reading_one_tensor_all_get_its_input_statistics():
    """q, k and v read one hidden state, which the stream sums once: a pass of its own for an input
    statistic (GPTQ's held-out Hessian, SmoothQuant's channel maxima) hands each its sum."""
    from lab.calibrate.activations import input_statistics
    from lab.calibrate.stream import ChannelMax
    from lab.scale.distributed import SINGLE

    minilm = open_model("minilm")
    layers = [f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value")]
    config = RunConfig(specs={"weight": SPEC}, observers=("minmax",), samples=SAMPLES, seq_len=SEQ_LEN)
    found = input_statistics(minilm, layers, config, SINGLE, ChannelMax)
    captured = minilm.capture(layers[:1], None, SAMPLES, SEQ_LEN, max_bytes=1 << 30, sequential=False)[layers[0]]
    for layer in layers:
        torch.testing.assert_close(found[layer].value, captured.abs().amax(0).float(), rtol=1e-6, atol=0)
