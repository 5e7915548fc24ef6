"""Calibration capture: shapes, padding, outliers, MoE routing, KV states, memory cap, hook
cleanup, concurrent captures and the layer-output error."""

import copy
import math
import threading

import pytest
import torch
import torch.nn.functional as F

from sample_models import CaptureSubsampledWarning, builtin_texts, layer_output_error, open_model, split_heads
from sample_models.builtin import DEAD_EXPERT, MASSIVE_CHANNELS
from sample_models.calibration import Batch
from sample_models.replay import replay_of

FFN = "encoder.layer.0.intermediate.dense"
QUERY = "encoder.layer.0.attention.self.query"
TEXTS = [
    "Short one.",
    "A noticeably longer calibration sentence, with commas, numbers like 3.14159 and 2024, and code: x = f(y).",
    "Medium length text about observers.",
]


@pytest.fixture(scope="module")
def minilm():
    return open_model("minilm")


@pytest.fixture(scope="module")
def llama():
    return open_model("tiny-llama")


def _hook_count(module: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs) for m in module.modules()
    )


def test_builtin_texts_are_varied_and_plentiful():
    texts = builtin_texts()
    assert len(texts) >= 40 and len(set(texts)) == len(texts)
    assert any("def " in t for t in texts) and any('"' in t for t in texts) and any("\n- " in t for t in texts)


def test_capture_shapes_token_counts_and_outputs(minilm):
    acts = minilm.capture([FFN, QUERY], samples=6, seq_len=64, outputs=True, batch_size=4)
    assert set(acts) == {FFN, QUERY} and not acts.subsampled
    assert acts[FFN].shape == (acts.tokens, 384) and acts.outputs[FFN].shape == (acts.tokens, 1536)
    assert 6 * 32 < acts.tokens <= 6 * 64
    assert acts.token_counts == {FFN: acts.tokens, QUERY: acts.tokens}
    expected = F.linear(acts[FFN], minilm.weight(FFN), minilm.bias(FFN))
    torch.testing.assert_close(acts.outputs[FFN], expected, atol=1e-4, rtol=1e-4)


def test_padding_tokens_are_excluded(minilm):
    batched = minilm.capture([FFN], texts=TEXTS, batch_size=3)[FFN]
    tokenizer = minilm.tokenizer()
    assert batched.shape[0] == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    one_by_one = torch.cat([minilm.capture([FFN], texts=[t])[FFN] for t in TEXTS])
    torch.testing.assert_close(batched, one_by_one, atol=1e-4, rtol=1e-4)


def test_long_texts_are_split_into_seq_len_windows(minilm):
    acts = minilm.capture([FFN], texts=[" ".join(builtin_texts()[:4])], samples=3, seq_len=32)
    assert acts.tokens == 3 * 32


def test_minilm_ffn_inputs_have_real_outliers(minilm):
    acts = minilm.capture([f"encoder.layer.{i}.intermediate.dense" for i in range(6)], samples=16, seq_len=64)
    ratios = [float(x.abs().max() / x.std()) for x in acts.values()]
    assert max(ratios) > 20


def test_tiny_llama_linear_inputs_have_massive_channels(llama):
    x = llama.capture(["model.layers.1.self_attn.q_proj"], samples=8, seq_len=64)["model.layers.1.self_attn.q_proj"]
    channel_absmax = x.abs().amax(0)
    others = [c for c in range(x.shape[1]) if c not in MASSIVE_CHANNELS]
    assert channel_absmax[list(MASSIVE_CHANNELS)].min() > 20 * channel_absmax[others].median()
    down = llama.capture(["model.layers.0.mlp.down_proj"], samples=8, seq_len=64)["model.layers.0.mlp.down_proj"]
    assert down.abs().max() > 20 * down.std()


def test_moe_has_an_expert_that_receives_no_tokens():
    moe = open_model("tiny-moe")
    names = [info.name for info in moe.layers("model.layers.*.mlp.experts.*")]
    acts = moe.capture(names, samples=8, seq_len=64, outputs=True)
    for layer in range(2):
        dead = f"model.layers.{layer}.mlp.experts.{DEAD_EXPERT}.down_proj"
        assert acts.token_counts[dead] == 0
        assert acts[dead].shape == (0, 512) and acts.outputs[dead].shape == (0, 256)
        routed = sum(acts.token_counts[f"model.layers.{layer}.mlp.experts.{e}.gate_proj"] for e in range(4))
        assert routed == 2 * acts.tokens
    busy = "model.layers.0.mlp.experts.0.down_proj"
    assert acts.token_counts[busy] == acts.tokens
    expected = F.linear(acts[busy], moe.weight(busy))
    torch.testing.assert_close(acts.outputs[busy], expected, atol=1e-5, rtol=1e-4)


def test_memory_cap_subsamples_tokens_and_records_it(minilm):
    full = minilm.capture([FFN], samples=4, seq_len=64)
    budget = 100 * (384 + 1536) * 4
    with pytest.warns(CaptureSubsampledWarning, match="max_bytes"):
        capped = minilm.capture([FFN], samples=4, seq_len=64, outputs=True, max_bytes=budget)
    assert capped.subsampled and capped.kept_fraction == pytest.approx(100 / full.tokens)
    assert capped[FFN].shape == (100, 384) and capped.token_counts[FFN] == full.tokens
    expected = F.linear(capped[FFN], minilm.weight(FFN), minilm.bias(FFN))
    torch.testing.assert_close(capped.outputs[FFN], expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="max_bytes"):
        minilm.capture([FFN], samples=1, max_bytes=16)


def test_kv_states_per_head_with_grouped_query_attention(llama):
    block = "model.layers.1.self_attn"
    assert block in llama.attention_blocks()
    kv = llama.capture_kv([block], samples=4, seq_len=48)[block]
    acts = llama.capture([f"{block}.k_proj", f"{block}.v_proj"], samples=4, seq_len=48, outputs=True)
    assert kv["k"].shape == kv["v"].shape == (1, 2, acts.tokens, 32)
    torch.testing.assert_close(kv["v"], llama.head_view(f"{block}.v_proj", acts.outputs[f"{block}.v_proj"]))
    pre_rope = llama.head_view(f"{block}.k_proj", acts.outputs[f"{block}.k_proj"])
    assert not torch.allclose(kv["k"], pre_rope, atol=1e-3)
    torch.testing.assert_close(kv["k"].norm(dim=-1), pre_rope.norm(dim=-1), atol=1e-4, rtol=1e-4)


def test_kv_states_of_an_encoder(minilm):
    block = "encoder.layer.2.attention.self"
    kv = minilm.capture_kv(block, texts=TEXTS)[block]
    keys = minilm.capture([f"{block}.key"], texts=TEXTS, outputs=True).outputs[f"{block}.key"]
    assert kv["k"].shape == (1, 12, keys.shape[0], 32)
    torch.testing.assert_close(kv["k"], split_heads(keys, 32))
    with pytest.raises(ValueError, match="encoder.layer.2.intermediate"):
        minilm.capture_kv(["encoder.layer.2.intermediate"])


def test_head_view_of_a_query_projection(minilm):
    x = minilm.capture([QUERY], texts=TEXTS, outputs=True).outputs[QUERY]
    heads = minilm.head_view(QUERY, x)
    assert heads.shape == (1, 12, x.shape[0], 32)
    torch.testing.assert_close(heads[0, 3, 5], x[5, 96:128])
    with pytest.raises(ValueError, match="intermediate"):
        minilm.head_view(FFN, x)


def test_hooks_are_removed_after_an_exception(minilm):
    module = minilm.module()
    before = _hook_count(module)

    def explode(*args):
        raise RuntimeError("boom in layer 3")

    trap = module.encoder.layer[3].register_forward_pre_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            minilm.capture([FFN, QUERY, "encoder.layer.5.output.dense"], texts=TEXTS, outputs=True)
    finally:
        trap.remove()
    assert _hook_count(module) == before
    assert minilm.capture([FFN], texts=TEXTS)[FFN].shape[1] == 384


def test_moe_expert_hooks_are_removed_after_an_exception():
    moe = open_model("tiny-moe")
    module = moe.module()
    before = _hook_count(module)
    trap = module.model.norm.register_forward_pre_hook(lambda *args: 1 / 0)
    try:
        with pytest.raises(ZeroDivisionError):
            moe.capture(["model.layers.1.mlp.experts.2.up_proj"], texts=TEXTS)
    finally:
        trap.remove()
    assert _hook_count(module) == before


def test_concurrent_captures_do_not_see_each_other(minilm):
    """Two threads capture different layers of one shared model while a third runs plain forward
    passes on it; each capture must equal the same capture run alone."""
    plans = {
        "a": ([FFN], TEXTS[:2]),
        "b": (["encoder.layer.4.output.dense", QUERY], builtin_texts()[:3]),
    }
    expected = {key: minilm.capture(names, texts=texts) for key, (names, texts) in plans.items()}
    results: dict[str, list] = {key: [] for key in plans}
    errors: list[BaseException] = []
    done = threading.Event()
    running = threading.Event()  # set after the bystander's first forward pass: captures start beside it

    def capturer(key: str) -> None:
        names, texts = plans[key]
        try:
            assert running.wait(timeout=120), "the bystander never ran a forward pass"
            for _ in range(3):
                results[key].append(minilm.capture(names, texts=texts))
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    # Tokenized here, not in the thread: a fast tokenizer's padding/truncation state is per instance,
    # so calling it while a capture tokenizes races (the capture lock covers captures, not this call).
    batch = minilm.tokenizer()(builtin_texts()[10:12], padding=True, return_tensors="pt")

    def bystander() -> None:
        with torch.no_grad():
            while not done.is_set():
                minilm.module()(**batch)
                running.set()

    capturers = [threading.Thread(target=capturer, args=(key,)) for key in plans]
    other = threading.Thread(target=bystander)
    other.start()
    for thread in capturers:
        thread.start()
    for thread in capturers:
        thread.join()
    done.set()
    other.join()
    assert not errors
    for key, runs in results.items():
        for acts in runs:
            assert set(acts) == set(expected[key])
            for name in acts:
                torch.testing.assert_close(acts[name], expected[key][name], atol=1e-5, rtol=1e-5)
    assert _hook_count(minilm.module()) == 0


def test_capture_runs_in_the_model_dtype():
    model = open_model("tiny-llama", dtype="bf16")
    x = model.capture(["model.layers.0.mlp.up_proj"], texts=TEXTS)["model.layers.0.mlp.up_proj"]
    assert x.dtype == torch.bfloat16 and x.shape[1] == 256


def test_calibration_knobs_are_checked(minilm):
    with pytest.raises(ValueError, match="samples"):
        minilm.capture([FFN], samples=0)
    with pytest.raises(ValueError, match="512 positions"):
        minilm.capture([FFN], seq_len=4096)
    with pytest.raises(ValueError, match="empty"):
        minilm.capture([FFN], texts=["   "])


def test_layer_output_error_is_zero_unquantized_and_positive_perturbed(minilm):
    x = minilm.capture([FFN], texts=TEXTS)[FFN]
    weight = minilm.weight(FFN)
    exact = layer_output_error(minilm, FFN, x, weight)
    assert set(exact) >= {"mse", "sqnr_db", "cosine", "max_abs_error"}
    assert exact["mse"] == 0 and exact["max_abs_error"] == 0 and math.isinf(exact["sqnr_db"])
    noisy_weight = weight + 0.01 * torch.randn_like(weight)
    perturbed = layer_output_error(minilm, FFN, x, noisy_weight)
    assert perturbed["mse"] > 0 and 0 < perturbed["sqnr_db"] < 60 and perturbed["cosine"] < 1
    both = layer_output_error(minilm, FFN, x, noisy_weight, quantized_inputs=x + 0.05 * torch.randn_like(x))
    assert both["mse"] > perturbed["mse"]
    assert torch.equal(minilm.weight(FFN), weight)


def test_layer_output_error_checks_shapes_and_types(minilm):
    x = minilm.capture([FFN], texts=TEXTS)[FFN]
    with pytest.raises(ValueError, match=FFN):
        layer_output_error(minilm, FFN, x, minilm.weight(FFN).t())
    with pytest.raises(ValueError, match="Embedding"):
        layer_output_error(minilm, "embeddings.word_embeddings", x, minilm.weight("embeddings.word_embeddings"))


def test_layer_output_error_of_an_expert():
    moe = open_model("tiny-moe")
    name = "model.layers.0.mlp.experts.1.down_proj"
    x = moe.capture([name], samples=4, seq_len=32)[name]
    quantized = moe.weight(name).to(torch.bfloat16).float()
    metrics = layer_output_error(moe, name, x, quantized)
    assert 30 < metrics["sqnr_db"] < 80


def _eager_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose attention is eager, as llm-compressor's calibration forces it
    (``calibration_forward_context`` sets the configuration's attention implementation)."""
    twin = copy.deepcopy(module)
    twin.config._attn_implementation = "eager"
    return twin


@pytest.mark.parametrize("sequential", [False, True])
def test_a_capture_computes_attention_eagerly_as_llm_compressor_calibrates(llama, sequential):
    """The activations a capture records behind attention are those of an eager-attention forward to
    the bit (what llm-compressor's modifiers see), and the model's attention implementation is what
    it was once the capture is over, or has failed."""
    module = llama.module()
    before = module.config._attn_implementation
    name = "model.layers.1.mlp.gate_proj"  # behind two attentions
    windows = llama.calibration_set(None, 4, 32).windows
    found = llama.capture([name], samples=4, seq_len=32, batch_size=1, sequential=sequential)
    twin, rows = _eager_twin(module), []
    handle = twin.get_submodule(name).register_forward_hook(lambda m, args, out: rows.append(args[0][0]))
    with torch.no_grad():
        for window in windows:
            twin(input_ids=torch.tensor([list(window)]), use_cache=False)
    handle.remove()
    assert torch.equal(found[name], torch.cat(rows))
    assert module.config._attn_implementation == before and before != "eager"

    def explode(stream_keys, rows):
        raise RuntimeError("boom in the stream")

    with pytest.raises(RuntimeError, match="boom"):
        llama.capture([name], samples=4, seq_len=32, batch_size=1, sequential=sequential, stream=explode)
    assert module.config._attn_implementation == before


def test_replayed_block_calls_are_recorded_under_eager_attention(llama):
    """A stage walking blocks again (AWQ's held-out walk) replays calls recorded as the capture's pass
    makes them: an eager copy of block 0 run on them gives the eager model's block-0 outputs to the
    bit (calls recorded under sdpa carry no causal mask, and eager attention would then look ahead)."""
    windows = llama.calibration_set(None, 3, 32).windows
    batches = [
        Batch(ids, mask, mask.bool())
        for ids, mask in [(torch.tensor([list(w)]), torch.ones(1, len(w), dtype=torch.long)) for w in windows]
    ]
    with replay_of(llama) as replay:
        calls = replay.record(batches)
    twin, outputs = _eager_twin(llama.module()), []
    handle = twin.model.layers[0].register_forward_hook(
        lambda m, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        for batch in batches:
            twin(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    handle.remove()
    replayed = calls.inputs(0, calls.first).run(twin.model.layers[0])
    replayed = [r[0] if isinstance(r, tuple) else r for r in replayed]
    assert all(torch.equal(r, o) for r, o in zip(replayed, outputs, strict=True))
