"""lab.analyse.pipeline: the analysis path of the app and CLI, on a small stand-in model."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import streamed_capture

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from lab.results import choose


class _Model:
    """Just the interface analyse() uses: name/source, layers(), weight(), capture()."""

    name = "stand-in"
    source = "stand-in"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = {"fc": torch.randn(16, 64, generator=g)}
        scale = torch.ones(64)
        scale[:4] = 40.0
        self.inputs = {"fc": torch.randn(200, 64, generator=g) * scale}
        self.captures = 0

    def layers(self):
        return [SimpleNamespace(name=n, type="Linear", shape=tuple(w.shape)) for n, w in self.weights.items()]

    def weight(self, name):
        return self.weights[name]

    def capture(self, names, texts=None, samples=32, seq_len=128, outputs=False, stream=None, done=None, **_):
        self.captures += 1
        return streamed_capture({n: self.inputs[n] for n in names}, None, stream, batches=4, done=done)


def test_imatrix_gets_importance_from_captured_inputs():
    spec = ob.QuantSpec("int4", strategy="group", group_size=16)
    config = RunConfig(specs={"weight": spec, "input": ob.QuantSpec("int8")}, observers=("mse_grid", "imatrix_mse"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analysis = analyse(_Model(), ["fc"], config)
    result = analysis.entry("fc", "weight").result("imatrix_mse")
    assert result.error is None
    streamed, whole = result.knobs["importance"], ob.column_importance(_Model().inputs["fc"])
    torch.testing.assert_close(streamed, whole, rtol=1e-6, atol=0)  # summed batch by batch in fp64
    plain = analysis.entry("fc", "weight").result("mse_grid")
    assert not torch.equal(result.qparams.scale, plain.qparams.scale)


def test_a_weights_only_run_captures_the_importance_its_observers_take():
    """imatrix's column importance needs the layer's inputs: a weights-only run captures them when
    the model can run, and gives the importance of every input row."""
    config = RunConfig(specs={"weight": ob.QuantSpec("int4", strategy="channel")}, observers=("imatrix_mse",))
    model = _Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analysis = analyse(model, ["fc"], config)
    assert model.captures == 1
    result = analysis.entry("fc", "weight").results[0]
    assert result.error is None
    torch.testing.assert_close(result.knobs["importance"], ob.column_importance(model.inputs["fc"]), rtol=1e-6, atol=0)


def test_weights_only_imatrix_on_a_model_that_cannot_run_falls_back_with_warning():
    config = RunConfig(specs={"weight": ob.QuantSpec("int4", strategy="channel")}, observers=("imatrix_mse",))
    model = _Model()
    model.supports_activations = False  # a bare weights file: nothing to run the inputs through
    with pytest.warns(UserWarning, match="importance"):
        analysis = analyse(model, ["fc"], config)
    assert model.captures == 0 and analysis.entry("fc", "weight").results[0].error is None


def test_actorder_groups_weight_columns_by_input_importance():
    spec = ob.QuantSpec("int4", strategy="group", group_size=16)
    model = _Model()
    analysis = analyse(model, ["fc"], RunConfig(specs={"weight": spec}, observers=("minmax",), actorder=True))
    entry = analysis.entry("fc", "weight")
    assert entry.g_idx is not None and entry.g_idx[:4].tolist() == [0, 0, 0, 0]
    assert torch.equal(entry.results[0].qparams.extras["g_idx"], entry.g_idx)


class _Tap:
    """A block tap that changes nothing, saying it does by its ``key``."""

    key = "smoothed upstream"

    def hooks(self, index, block):
        from contextlib import nullcontext

        return nullcontext()

    def start(self, batch) -> None:
        pass

    def finished(self, index, block):
        return None


def test_results_made_on_a_pass_a_tap_changes_are_cached_apart_from_a_plain_pass():
    model = _Model()
    cache = ResultCache()
    config = RunConfig(specs={"weight": ob.QuantSpec("int8"), "input": ob.QuantSpec("int8")}, observers=("minmax",))
    analyse(model, ["fc"], config, cache=cache, tap=_Tap())
    assert (cache.hits, cache.misses) == (0, 2)
    analyse(model, ["fc"], config, cache=cache)  # a plain pass: nothing of the tapped one is taken
    assert (cache.hits, cache.misses) == (0, 4)
    analyse(model, ["fc"], config, cache=cache, tap=_Tap())
    assert (cache.hits, cache.misses) == (2, 4)


def test_cache_reruns_only_changed_observer_and_choose_picks_best():
    model = _Model()
    cache = ResultCache()
    spec = ob.QuantSpec("int8")
    config = RunConfig(specs={"weight": spec}, observers=("minmax", "moving_average_minmax", "percentile"))
    first = analyse(model, ["fc"], config, cache=cache)
    assert (cache.hits, cache.misses) == (0, 3)
    changed = RunConfig(specs={"weight": spec}, observers=config.observers, knobs={"percentile": {"percentile": 99.0}})
    analyse(model, ["fc"], changed, cache=cache)
    assert (cache.hits, cache.misses) == (2, 4)
    best = choose(first, "sqnr_db")[("fc", "weight")]
    scores = {r.name: r.metrics["sqnr_db"] for r in first.entries[0].results}
    assert scores[best] == max(scores.values())
    with pytest.raises(ValueError, match="unknown metric"):
        choose(first, "speed")


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="tensor kind"):
        RunConfig(specs={"bias": ob.QuantSpec("int8")})
    with pytest.raises(ValueError, match="at least one layer"):
        analyse(_Model(), [], RunConfig(specs={"weight": ob.QuantSpec("int8")}))


def test_weight_observers_get_their_input_statistics_from_the_captured_inputs():
    """``imatrix_mse`` gets the column importance and ``local_hessian`` the block Hessian of the
    layer's own captured inputs, unless the person set them."""
    import observers as ob
    from lab.analyse.pipeline import analyse
    from lab.analyse.run_config import RunConfig
    from sample_models import open_model

    model = open_model("tiny-llama")
    layer = "model.layers.0.mlp.down_proj"
    specs = {"weight": ob.QuantSpec(dtype="nvfp4"), "input": ob.QuantSpec(dtype="int8")}
    config = RunConfig(specs=specs, observers=("local_hessian", "imatrix_mse"), samples=2, seq_len=16)
    analysis = analyse(model, [layer], config)
    inputs = analysis.entry(layer, "input").data
    weight = analysis.entry(layer, "weight")
    assert torch.allclose(weight.result("local_hessian").knobs["hessian"], ob.local_hessian(inputs))
    assert torch.allclose(weight.result("imatrix_mse").knobs["importance"], ob.column_importance(inputs))


def test_an_embedding_fed_token_ids_gets_no_input_statistic_and_its_observers_fall_back():
    """An embedding's inputs are token ids, not its weight's columns: a weights-only NVFP4A16 run
    over it and a linear layer gives the linear layer its statistics, the embedding none (its
    observers warn and run unweighted, instead of the run stopping on local_hessian), and GPTQ
    says why the embedding has no Hessian."""
    from lab.gptq.layer import NO_HESSIAN
    from sample_models import open_model

    model = open_model("tiny-llama")
    embedding, linear = "model.embed_tokens", "model.layers.0.self_attn.q_proj"
    specs = {"weight": ob.preset("NVFP4A16")["weight"]}
    config = RunConfig(
        specs=specs, observers=("local_hessian", "imatrix_mse"), samples=2, seq_len=16, gptq=ob.GPTQSpec()
    )
    with pytest.warns(UserWarning) as caught:
        analysis = analyse(model, [embedding, linear], config)
    assert {"local_hessian: no inputs were observed; running the plain NVFP4 sweep"} <= {str(w.message) for w in caught}
    for name, knob in (("local_hessian", "hessian"), ("imatrix_mse", "importance")):
        assert analysis.entry(embedding, "weight").result(name).knobs[knob] is None
        assert analysis.entry(embedding, "weight").result(name).qparams is not None
        assert isinstance(analysis.entry(linear, "weight").result(name).knobs[knob], torch.Tensor)
    assert {row.error for row in analysis.entry(embedding, "weight").gptq} == {NO_HESSIAN}
    assert all(row.error is None for row in analysis.entry(linear, "weight").gptq)


def test_layers_that_read_the_same_input_share_its_results():
    """q, k and v of an attention block read one hidden state: observed once, same results;
    a tensor that differs in one value is observed on its own."""
    model = _Model()
    g = torch.Generator().manual_seed(1)
    for name in ("q", "k", "v", "near"):
        model.weights[name] = torch.randn(8, 64, generator=g)
    model.inputs |= {"q": model.inputs["fc"] * 0.5}
    model.inputs |= {"k": model.inputs["q"], "v": model.inputs["q"], "near": model.inputs["q"].clone()}
    model.inputs["near"][7, 3] += 1.0
    config = RunConfig(specs={"input": ob.QuantSpec("int8")}, observers=("minmax", "percentile"))
    analysis = analyse(model, ["q", "k", "v", "near"], config)
    q, k, v, near = (analysis.entry(name, "input") for name in ("q", "k", "v", "near"))
    assert all(a is b for a, b in zip(k.results + v.results, q.results + q.results, strict=True))  # observed once
    assert near.results[0].metrics != q.results[0].metrics  # observed on its own
    assert near.results[0].error is None and near.results[0] is not q.results[0]


def test_the_default_observers_are_those_that_apply_to_each_format():
    spec_w, spec_x = ob.QuantSpec("int4", strategy="group", group_size=16), ob.QuantSpec("int8")
    config = RunConfig(specs={"weight": spec_w, "input": spec_x})
    assert config.observers_for("weight") == tuple(ob.applicable(spec_w, "weight"))
    assert "histogram" not in config.observers_for("weight") and "histogram" in config.observers_for("input")
    assert "nvfp4_expanded_mse" not in config.observer_names  # tuned for NVFP4: runs only when chosen
    assert "nvfp4_expanded_mse" in ob.applicable(ob.QuantSpec("nvfp4"), "weight")
    analysis = analyse(_Model(), ["fc"], config)
    for entry in analysis.entries:
        assert [r.name for r in entry.results] == list(config.observers_for(entry.tensor))
        assert all(r.error is None for r in entry.results), [(r.name, r.error) for r in entry.results if r.error]
    named = RunConfig(specs={"weight": spec_w}, observers=("histogram",))
    assert analyse(_Model(), ["fc"], named).entries[0].results[0].error is not None  # named: runs and says why
