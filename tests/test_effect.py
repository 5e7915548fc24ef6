"""Model-level effect (issue 17): end-to-end evaluation of choice sets on held-out text, per-layer
sensitivity with cached block boundaries, choosing by a model-level metric, the CLI commands and
their bad-input errors. Small models and few held-out windows keep it fast."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.cli import main
from lab.effect.evaluate import (
    ChoiceSet,
    Evaluator,
    check_applies,
    float_set,
    from_analysis,
    from_lab_file,
)
from lab.effect.metrics import encoder_metrics, spearman
from lab.effect.sensitivity import Sensitivity, compare, sensitivity
from lab.export import lab_json
from lab.results import check_metric, choose
from sample_models import builtin_texts, open_model
from sample_models.effect import EffectRunner, TensorQuant, held_out_texts, sentences

INT4_G = ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=64)
LLAMA_LAYERS = [f"model.layers.{i}.mlp.{p}" for i in (0, 2) for p in ("up_proj", "down_proj")]


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


@pytest.fixture(scope="module")
def llama_eval(llama):
    return Evaluator(llama, samples=4, seq_len=64)


@pytest.fixture(scope="module")
def llama_analysis(llama):
    config = RunConfig(specs={"weight": INT4_G}, observers=("minmax", "mse_grid"))
    return analyse(llama, LLAMA_LAYERS, config)


@pytest.fixture(scope="module")
def minilm():
    return open_model("minilm")


def _weight_quant(model, layer: str, observer: str = "minmax", spec: ob.QuantSpec = INT4_G) -> TensorQuant:
    obs = ob.create(observer, spec, kind="weight")
    obs.observe(model.weight(layer))
    return TensorQuant(spec, obs.qparams())


# ---------------------------------------------------------------- held-out text


def test_held_out_text_shares_no_sentence_with_the_calibration_text():
    held = {s for s in sentences(held_out_texts()) if len(s.split()) >= 3}  # not list numbers like "2."
    calibration = set(sentences(builtin_texts()))
    assert len(held) > 60
    assert not held & calibration
    joined = " ".join(builtin_texts())
    assert not [s for s in held if len(s) > 30 and s in joined]


# ---------------------------------------------------------------- evaluation


def test_all_float_choice_set_gives_kl_0_top1_1_and_the_float_perplexity(llama, llama_eval):
    result = llama_eval.evaluate(float_set())
    assert result.metrics["kl"] == 0.0 and result.metrics["top1_agreement"] == 1.0
    assert result.metrics["perplexity"] == result.metrics["float_perplexity"]
    # the float perplexity is the model's own: its logits from a plain forward pass
    module, nll, count = llama.module(), 0.0, 0
    with torch.no_grad():
        for batch in llama_eval.runner.batches:
            logits = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
            log_p = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])
            nll -= float(log_p.sum())
            count += log_p.numel()
    assert result.metrics["float_perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert all(math.isinf(v) for v in result.block_sqnr_db)


def test_all_float_encoder_gives_cosine_1(minilm):
    evaluator = Evaluator(minilm, samples=12)
    metrics = evaluator.evaluate(float_set()).metrics
    assert metrics["cosine"] == pytest.approx(1.0, abs=1e-6) and metrics["spearman"] == pytest.approx(1.0)
    quantized = evaluator.evaluate(
        ChoiceSet(
            "q",
            {
                ("encoder.layer.3.output.dense", "weight"): _weight_quant(
                    minilm,
                    "encoder.layer.3.output.dense",
                    spec=ob.QuantSpec(dtype="int2", symmetric=True, strategy="tensor"),
                )
            },
        )
    )
    assert quantized.metrics["cosine"] < 0.999 and quantized.start == 3
    assert all(math.isinf(v) for v in quantized.block_sqnr_db[:3]) and math.isfinite(quantized.block_sqnr_db[3])


def test_one_layer_changes_the_model_only_from_its_block_on(llama, llama_eval):
    runner = llama_eval.runner
    layer = "model.layers.2.mlp.down_proj"
    quant = {(layer, "weight"): _weight_quant(llama, layer)}
    cached = runner.run(quant)
    full = runner.run(quant, start=0)
    assert cached.start == 2 and full.start == 0
    assert all(torch.equal(a, b) for a, b in zip(cached.outputs, full.outputs, strict=True))
    assert full.block_sqnr_db[:2] == [math.inf, math.inf]  # blocks before it: exactly the float states
    assert cached.block_sqnr_db == full.block_sqnr_db and math.isfinite(cached.block_sqnr_db[2])
    assert any(not torch.equal(a, b) for a, b in zip(cached.outputs, runner.float_outputs, strict=True))


def test_block_by_block_loading_gives_the_whole_model_result(llama, llama_eval):
    layer = "model.layers.1.self_attn.o_proj"
    quant = {(layer, "weight"): _weight_quant(llama, layer)}
    streamed = EffectRunner(llama, samples=4, seq_len=64, sequential=True, max_memory=64 << 20)
    assert streamed.sequential and not llama_eval.runner.sequential
    a, b = llama_eval.runner.run(quant), streamed.run(quant)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.outputs, b.outputs, strict=True))


def test_kv_states_static_and_dynamic_change_the_model_from_their_block(llama, llama_eval):
    block = "model.layers.1.self_attn"
    states = llama.capture_kv([block], samples=4, seq_len=32)[block]
    spec = ob.QuantSpec(dtype="int4", symmetric=True, strategy="tensor")
    static = {}
    for which in ("k", "v"):
        obs = ob.create("minmax", spec, kind="attention")
        obs.observe(states[which])
        static[(block, which)] = TensorQuant(spec, obs.qparams())
    dynamic = {key: TensorQuant(replace(spec, dynamic=True)) for key in static}
    for quant in (static, dynamic):
        result = llama_eval.evaluate(ChoiceSet("kv", quant))
        assert result.start == 1 and result.metrics["kl"] > 0 and math.isinf(result.block_sqnr_db[0])


def test_dynamic_input_spec_uses_run_time_qparams(llama, llama_eval):
    spec = ob.QuantSpec(dtype="int4", symmetric=True, strategy="token", dynamic=True)
    config = RunConfig(specs={"input": spec}, observers=("minmax",), samples=2, seq_len=32)
    analysis = analyse(llama, ["model.layers.3.mlp.down_proj"], config)
    choice_set = from_analysis(analysis, choose(analysis), "dyn")
    (quant,) = choice_set.tensors.values()
    assert quant.qparams is None and choice_set.observers[("model.layers.3.mlp.down_proj", "input")] == "run time"
    result = llama_eval.evaluate(choice_set)
    assert result.start == 3 and result.metrics["kl"] > 0


def test_spearman_and_encoder_metrics():
    x = torch.tensor([0.3, -1.0, 2.0, 0.1])
    assert spearman(x, x.exp()) == pytest.approx(1.0) and spearman(x, -x) == pytest.approx(-1.0)
    emb = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    same = encoder_metrics([emb[:3], emb[3:]], [emb[:3], emb[3:]])
    assert same["cosine"] == pytest.approx(1.0) and same["spearman"] == pytest.approx(1.0)
    assert encoder_metrics([emb], [emb + 0.5 * torch.randn_like(emb)])["cosine"] < 0.99


# ---------------------------------------------------------------- sensitivity and choosing


def _sabotaged(analysis, layer: str, factor: float):
    """The analysis with every observer's scale of ``layer``'s weight multiplied by ``factor``."""
    entries = []
    for entry in analysis.entries:
        if entry.layer == layer:
            results = [replace(r, qparams=replace(r.qparams, scale=r.qparams.scale * factor)) for r in entry.results]
            entry = replace(entry, results=results)
        entries.append(entry)
    return replace(analysis, entries=entries)


def test_sensitivity_ranks_a_layer_with_a_deliberately_bad_scale_first(llama_eval, llama_analysis):
    honest = sensitivity(llama_eval, llama_analysis)
    assert set(honest.frame.columns) >= {"layer", "observer", "local_sqnr_db", "kl", "top1_agreement", "perplexity"}
    assert len(honest.frame) == 8 and honest.unique_runs <= honest.runs
    least = honest.ranking()["layer"].iloc[-1]
    sabotaged = _sabotaged(llama_analysis, least, 40.0)
    ranking = sensitivity(llama_eval, sabotaged).ranking()
    assert ranking["layer"].iloc[0] == least and ranking["rank"].iloc[0] == 1


def test_cached_and_naive_sweeps_agree(llama_eval, llama_analysis):
    fast = sensitivity(llama_eval, llama_analysis)
    naive = sensitivity(llama_eval, llama_analysis, reuse_prefix=False, dedupe=False)
    assert naive.unique_runs == naive.runs == fast.runs
    assert (fast.frame["kl"] - naive.frame["kl"]).abs().max() < 1e-9
    assert list(fast.frame["first_block"]) == [0, 0, 0, 0, 2, 2, 2, 2]


def test_choose_by_model_level_metric_through_the_one_ranking_rule(llama_eval, llama_analysis):
    table = sensitivity(llama_eval, llama_analysis)
    chosen = choose(llama_analysis, "model:kl", table.effect)
    for (layer, tensor), observer in chosen.items():
        rows = table.frame[(table.frame["layer"] == layer) & (table.frame["tensor"] == tensor)]
        assert rows.set_index("observer")["kl"][observer] == rows["kl"].min()
    assert chosen == table.choices(llama_analysis)
    assert choose(llama_analysis, "model:kl") == {}  # no effect table, no model-level values
    with pytest.raises(ValueError, match="model:kl"):
        check_metric("kl")
    evaluations = compare(llama_eval, llama_analysis, table)
    names = [e.name for e in evaluations]
    assert names == ["float", "all min-max", "all best-local (sqnr_db)", "best by model (kl)"]
    assert evaluations[0].metrics["kl"] == 0 and all(e.metrics["kl"] > 0 for e in evaluations[1:])
    agreement = table.best_per_layer(llama_analysis)
    assert list(agreement.columns)[:3] == ["layer", "tensor", "best by model"] and len(agreement) == 4


@pytest.mark.parametrize(
    ("metric", "values", "order"),
    [("kl", [0.3, 0.1, 0.02, 0.2], ["a", "b"]), ("cosine", [0.99, 0.9, 0.95, 0.98], ["b", "a"])],
)
def test_sensitivity_ranking_takes_the_direction_from_lab_results(metric, values, order):
    """kl: lower is better; cosine: higher is better (``lab.results.higher_is_better``)."""
    frame = pd.DataFrame(
        {
            "layer": ["a", "a", "b", "b"],
            "tensor": ["weight"] * 4,
            "observer": ["minmax", "mse_grid"] * 2,
            metric: values,
        }
    )
    table = Sensitivity(frame, metric, "sqnr_db", "decoder", 4, 4, 0.0, {})
    ranking = table.ranking()
    assert list(ranking["layer"]) == order  # most sensitive first: worst damage at its best observer
    least = dict(zip(ranking["layer"], ranking["least harmful"], strict=True))
    assert least == ({"a": "mse_grid", "b": "minmax"} if metric == "kl" else {"a": "minmax", "b": "mse_grid"})
    with pytest.raises(ValueError, match="unknown metric"):
        replace(table, metric="nonsense").ranking()


# ---------------------------------------------------------------- bad input


def test_held_out_text_shorter_than_one_window_is_refused(llama, minilm):
    with pytest.raises(ValueError, match="shorter than one window of 64 tokens"):
        Evaluator(llama, texts=["A short text."], seq_len=64)
    with pytest.raises(ValueError, match="shorter than one window"):
        Evaluator(minilm, texts=["One. Two. Three."], seq_len=64)


def test_missing_layers_and_specs_that_cannot_apply_are_named(llama, llama_eval):
    bad = _weight_quant(llama, "model.layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj"):
        llama_eval.evaluate(ChoiceSet("x", {("model.layers.9.mlp.up_proj", "weight"): bad}))
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj weight: the spec does not apply"):
        check_applies(ChoiceSet("x", {("model.layers.0.mlp.down_proj", "weight"): bad}), llama)
    token = ob.QuantSpec(dtype="int8", symmetric=True, strategy="token")
    obs = ob.create("minmax", token, kind="activation")
    obs.observe(torch.randn(10, 256))
    with pytest.raises(ValueError, match="static per-token qparams"):
        check_applies(
            ChoiceSet("x", {("model.layers.0.mlp.up_proj", "input"): TensorQuant(token, obs.qparams())}), llama
        )
    embed = ("model.embed_tokens", "weight")
    with pytest.raises(ValueError, match="only linear layers"):
        llama_eval.runner.check({embed: bad})


def _lab_file(tmp_path: Path, analysis) -> Path:
    path = tmp_path / "choices.json"
    lab_json.save_file(analysis, choose(analysis), path)
    return path


def test_a_file_for_another_model_is_refused(tmp_path, llama_analysis, minilm):
    path = _lab_file(tmp_path, llama_analysis)
    with pytest.raises(ValueError, match="other weights by fingerprint"):
        from_lab_file(lab_json.load_file(path), minilm, name=str(path))


# ---------------------------------------------------------------- CLI


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    import io

    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


def test_cli_evaluate_writes_metrics_of_the_file_and_the_float_model(tmp_path, llama_analysis):
    path = _lab_file(tmp_path, llama_analysis)
    out = tmp_path / "eval.json"
    argv = ["evaluate", "tiny-llama", "--choices", str(path), "--out", str(out), "--held-out-samples", "4"]
    code, stdout, stderr = _run_cli([*argv, "--held-out-seq-len", "64"])
    assert code == 0, stderr
    document = json.loads(out.read_text())
    assert document["format"] == "observer-lab-effect" and document["model_kind"] == "decoder"
    first, second = document["evaluations"]
    assert set(first["metrics"]) == {"kl", "top1_agreement", "perplexity", "float_perplexity"}
    assert first["metrics"]["kl"] == 0 and second["metrics"]["kl"] > 0 and second["tensors"] == 4
    assert second["block_sqnr_db"][:1] != ["inf"] and "wrote" in stdout


def test_cli_sensitivity_on_minilm_writes_table_ranking_and_comparison(tmp_path):
    out, report = tmp_path / "s.json", tmp_path / "s.html"
    argv = ["sensitivity", "minilm", "--layers", "encoder.layer.5.*.dense", "--format", "int4", "--strategy"]
    argv += ["group", "--group-size", "128", "--observers", "minmax,mse_grid", "--held-out-samples", "16"]
    code, stdout, stderr = _run_cli([*argv, "--quiet", "--out", str(out), "--report", str(report)])
    assert code == 0, stderr
    document = json.loads(out.read_text())
    table = document["sensitivity"]
    assert table["metric"] == "cosine" and {"cosine", "spearman", "local_sqnr_db"} <= set(table["table"][0])
    assert [r["rank"] for r in table["ranking"]] == [1, 2, 3]
    assert [e["name"] for e in document["evaluations"]][1:] == [
        "all min-max",
        "all best-local (sqnr_db)",
        "best by model (cosine)",
    ]
    html = report.read_text()
    assert "Model-level effect" in html and "Most sensitive tensors" in html
    assert stdout.splitlines()[0].startswith("1\tencoder.layer.5.")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--choices", "{other}"], "other weights by fingerprint"),
        (["--choices", "{missing}"], "the model has no layer 'model.layers.9.mlp.up_proj'"),
        (["--choices", "{good}", "--held-out", "{short}"], "shorter than one window"),
    ],
)
def test_cli_evaluate_bad_input_exits_2_with_one_line(tmp_path, llama_analysis, minilm, argv, needle):
    good = _lab_file(tmp_path, llama_analysis)
    document = json.loads(good.read_text())
    document["entries"][0]["layer"] = "model.layers.9.mlp.up_proj"
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(document))
    other = tmp_path / "other.json"
    config = RunConfig(specs={"weight": INT4_G}, observers=("minmax",))
    other_analysis = analyse(minilm, ["encoder.layer.0.output.dense"], config)
    lab_json.save_file(other_analysis, choose(other_analysis), other)
    short = tmp_path / "short.txt"
    short.write_text("Too short to fill a window.")
    paths = {"good": good, "missing": missing, "other": other, "short": short}
    filled = [a.format(**paths) for a in argv]
    code, _, stderr = _run_cli(["evaluate", "tiny-llama", "--out", str(tmp_path / "e.json"), *filled])
    assert code == 2 and stderr.startswith("error:") and len(stderr.splitlines()) == 1
    assert needle in stderr


def test_cli_sensitivity_rejects_an_unknown_metric():
    argv = ["sensitivity", "minilm", "--layers", "x", "--format", "int4", "--metric", "speed", "--out", "x.json"]
    code, _, stderr = _run_cli(argv)
    assert code == 2 and "not a model-level metric" in stderr


def test_decoder_metrics_of_several_models_are_each_ones_alone_and_the_formulas():
    """The float side of each held-out batch is computed once for several quantized models: each
    model's figures are those it gets alone, bit for bit, and the formulas in float64 by hand (KL
    over real positions, top-1 agreement, perplexity over real next tokens)."""
    from lab.effect.metrics import decoder_metrics, decoder_metrics_of
    from sample_models.calibration import Batch

    g = torch.Generator().manual_seed(3)
    masks = [torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]), torch.ones(2, 6, dtype=torch.long)]
    batches = [Batch(torch.randint(0, 11, (2, 6), generator=g), m, m.bool()) for m in masks]
    float_logits = [torch.randn(2, 6, 11, generator=g) for _ in batches]
    runs = [[f + scale * torch.randn(f.shape, generator=g) for f in float_logits] for scale in (0.05, 0.3, 1.0)]
    together = decoder_metrics_of(float_logits, runs, batches)
    assert together == [decoder_metrics(float_logits, run, batches) for run in runs]
    for found, run in zip(together, runs, strict=True):
        kl = agree = count = nll_p = nll_q = predicted = 0.0
        for f, q, batch in zip(float_logits, run, batches, strict=True):
            log_p, log_q = torch.log_softmax(f.double(), -1), torch.log_softmax(q.double(), -1)
            valid = batch.valid
            kl += float((log_p.exp() * (log_p - log_q)).sum(-1)[valid].sum())
            agree += float((f.argmax(-1) == q.argmax(-1))[valid].sum())
            count += float(valid.sum())
            following = valid[:, :-1] & valid[:, 1:]
            target = batch.input_ids[:, 1:].unsqueeze(-1)
            nll_p -= float(log_p[:, :-1].gather(-1, target).squeeze(-1)[following].sum())
            nll_q -= float(log_q[:, :-1].gather(-1, target).squeeze(-1)[following].sum())
            predicted += float(following.sum())
        assert found["kl"] == pytest.approx(kl / count, rel=1e-5)
        assert found["top1_agreement"] == agree / count
        assert found["perplexity"] == pytest.approx(math.exp(nll_q / predicted), rel=1e-5)
        assert found["float_perplexity"] == pytest.approx(math.exp(nll_p / predicted), rel=1e-5)
    assert together[0]["kl"] < together[1]["kl"] < together[2]["kl"]
