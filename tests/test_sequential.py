"""Sequential (block-by-block) calibration: the same activations, KV states, token counts and qparams
as a whole-model capture on every architecture the app opens; hidden states offloaded to disk;
bounded weights on a generated checkpoint; and clear errors for what it cannot do."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest
import torch
from helpers import save_checkpoint, tiny_llama
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import observers as ob
from bench.bench_sequential import PeakRss
from sample_models import ModelSourceError, SequentialFallbackWarning, SequentialUnsupportedError, open_model
from sample_models.builtin import DEAD_EXPERT, VOCAB_SIZE, build_tiny_moe, minilm_dir
from sample_models.sequential import SequentialModel
from sample_models.stores import ModuleWeights
from sample_models.synthetic import write_llama_checkpoint

CALIBRATION = {"samples": 6, "seq_len": 48, "batch_size": 4}
CAPTURED_TYPES = ("Linear", "ExpertLinear", "Embedding")
SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)


def _all_layers(model) -> list[str]:
    return [info.name for info in model.layers() if info.type in CAPTURED_TYPES]


def _assert_same_activations(whole, sequential) -> None:
    assert set(whole) == set(sequential) and set(whole.outputs) == set(sequential.outputs)
    assert whole.token_counts == sequential.token_counts
    assert (whole.tokens, whole.kept_fraction) == (sequential.tokens, sequential.kept_fraction)
    for name in whole:
        torch.testing.assert_close(sequential[name], whole[name])
        torch.testing.assert_close(sequential.outputs[name], whole.outputs[name])


def _assert_same_kv(whole: dict, sequential: dict) -> None:
    assert set(whole) == set(sequential)
    for block, states in whole.items():
        for which in "kv":
            torch.testing.assert_close(sequential[block][which], states[which])


def _minmax_scale(x: torch.Tensor) -> torch.Tensor:
    (result,) = ob.run_suite(x.float(), ob.QuantSpec("int8"), ["minmax"], kind="activation")
    return result.qparams.scale


class _BlockInputs:
    """A block tap that sums each block's input hidden states over the real tokens, and doubles
    block 0's output for the next block when ``double``."""

    def __init__(self, double: bool) -> None:
        self.double, self.sums, self.batches, self.loaded = double, {}, 0, []
        self.valid = None
        self.key = "doubled block 0" if double else ""

    def hooks(self, index, block):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            total = float(hidden[self.valid].double().abs().sum())
            self.sums[index] = self.sums.get(index, 0.0) + total

        return _handle_context(block.register_forward_pre_hook(hook, with_kwargs=True))

    def start(self, batch) -> None:
        self.batches += 1
        self.valid = batch.valid

    def finished(self, index, block):
        self.loaded.append(block.mlp.down_proj.weight.device.type != "meta")
        if not (self.double and index == 0):
            return None
        doubled = lambda m, a, out: 2 * out if isinstance(out, torch.Tensor) else (2 * out[0], *out[1:])  # noqa: E731
        return lambda module: _handle_context(block.register_forward_hook(doubled))


@contextmanager
def _handle_context(handle):
    """A hook's handle as a context: removed on the way out."""
    try:
        yield
    finally:
        handle.remove()


def test_a_block_tap_rides_the_sequential_pass_and_may_change_what_the_next_block_receives():
    model = open_model("tiny-llama")
    blocks = model.module().model.layers
    float_sums: dict[int, float] = {}
    batches = model.calibration_set(None, CALIBRATION["samples"], CALIBRATION["seq_len"]).windows
    for index, block in enumerate(blocks):  # the float model's block inputs, by hand

        def hook(module, args, kwargs, index=index):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            float_sums[index] = float_sums.get(index, 0.0) + float(hidden.double().abs().sum())

        handle = block.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            for window in batches:
                model.module()(input_ids=torch.tensor([list(window)]))
        handle.remove()
    plain, doubled = _BlockInputs(double=False), _BlockInputs(double=True)
    found = model.capture([], tap=plain, **CALIBRATION)
    assert len(found) == 0 and plain.loaded == [True] * len(blocks)  # each block finished with its weights
    assert plain.batches == len(blocks) * -(-CALIBRATION["samples"] // CALIBRATION["batch_size"])
    for index, total in float_sums.items():
        assert plain.sums[index] == pytest.approx(total, rel=1e-5)
    captured = model.capture(["model.layers.1.mlp.down_proj"], tap=doubled, **CALIBRATION)
    assert doubled.sums[0] == pytest.approx(float_sums[0], rel=1e-5)
    assert doubled.sums[1] == pytest.approx(2 * float_sums[1], rel=1e-5)  # block 1 got what the tap propagated
    assert captured.token_counts["model.layers.1.mlp.down_proj"] > 0
    with pytest.raises(ValueError, match="needs the layer-by-layer capture"):
        model.capture([], tap=plain, sequential=False, **CALIBRATION)


@pytest.mark.parametrize("source", ["minilm", "tiny-llama", "tiny-moe"])
def test_sequential_capture_equals_whole_model_capture(source):
    model = open_model(source)
    names = _all_layers(model)
    whole = model.capture(names, outputs=True, sequential=False, **CALIBRATION)
    sequential = model.capture(names, outputs=True, sequential=True, **CALIBRATION)
    _assert_same_activations(whole, sequential)
    for name in names[:: max(1, len(names) // 8)]:
        if whole.token_counts[name]:
            torch.testing.assert_close(_minmax_scale(sequential[name]), _minmax_scale(whole[name]))
    stats = model.last_sequential
    assert stats.blocks == model.config.num_hidden_layers
    assert 0 < stats.peak_weight_bytes < 2.1 * stats.largest_unit[1]  # last pass: embedding, norm and head


@pytest.mark.parametrize(("source", "after"), [("minilm", ["pooler.dense"]), ("tiny-llama", ["lm_head"])])
def test_inputs_after_the_blocks_stop_the_last_pass_before_the_head_runs(source, after, monkeypatch):
    from sample_models import sequential

    model = open_model(source)
    stops = []
    monkeypatch.setattr(sequential.StopPass, "__init__", lambda self, *args: stops.append(1))
    whole = model.capture(after, sequential=False, **CALIBRATION)
    sequential_run = model.capture(after, sequential=True, **CALIBRATION)
    assert len(stops) == 2  # one per batch: 6 samples in batches of 4, each stopped before the head
    for name in after:
        torch.testing.assert_close(sequential_run[name], whole[name])
        assert sequential_run.token_counts[name] == whole.token_counts[name]


@pytest.mark.parametrize("source", ["minilm", "tiny-llama", "tiny-moe"])
def test_sequential_kv_states_equal_whole_model_kv_states(source):
    model = open_model(source)
    blocks = model.attention_blocks()
    whole = model.capture_kv(blocks, sequential=False, **CALIBRATION)
    _assert_same_kv(whole, model.capture_kv(blocks, sequential=True, **CALIBRATION))


def test_sequential_moe_experts_without_tokens_come_out_empty():
    moe = open_model("tiny-moe")
    names = [info.name for info in moe.layers("model.layers.*.mlp.experts.*")]
    acts = moe.capture(names, outputs=True, sequential=True, **CALIBRATION)
    for layer in range(2):
        dead = f"model.layers.{layer}.mlp.experts.{DEAD_EXPERT}.down_proj"
        assert acts.token_counts[dead] == 0
        assert acts[dead].shape == (0, 512) and acts.outputs[dead].shape == (0, 256)
        assert acts[dead].device == moe.device and not acts[dead].is_meta


@pytest.mark.parametrize(
    "module",
    [
        lambda: tiny_llama(layers=3),
        lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8)),
    ],
    ids=["llama", "qwen2-sliding-window-layers", "mistral-sliding-window"],
)
def test_sequential_checkpoints_from_disk_equal_whole_model(module, tmp_path):
    """Sharded checkpoints of Llama-, Qwen2- and Mistral-style decoders; Qwen2's sliding-window
    layers get a different attention mask than its full-attention layer, so each block must be fed
    the mask the model gives that block."""
    model = open_model(save_checkpoint(module().eval(), tmp_path / "ckpt", max_shard_size="200KB"))
    names = _all_layers(model)
    whole = model.capture(names, outputs=True, sequential=False, **CALIBRATION)
    _assert_same_activations(whole, model.capture(names, outputs=True, sequential=True, **CALIBRATION))
    blocks = model.attention_blocks()
    whole_kv = model.capture_kv(blocks, sequential=False, **CALIBRATION)
    _assert_same_kv(whole_kv, model.capture_kv(blocks, sequential=True, **CALIBRATION))
    assert whole_kv[blocks[-1]]["k"].shape[2] == whole.tokens  # sliding layers keep every token's key


def test_hidden_states_offloaded_to_disk_give_the_same_result_and_are_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    model = open_model("tiny-llama")
    names = ["model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"]
    whole = model.capture(names, outputs=True, sequential=False, **CALIBRATION)
    largest = model.layers("model.embed_tokens")[0].params * 4
    offloaded = model.capture(names, outputs=True, sequential=True, max_memory=largest + 1000, **CALIBRATION)
    assert model.last_sequential.offloaded
    _assert_same_activations(whole, offloaded)
    assert list(tmp_path.iterdir()) == []


def test_progress_is_reported_per_block_and_a_failed_run_leaves_the_skeleton_empty():
    model = open_model("tiny-llama")
    seen = []
    model.capture(["model.layers.1.mlp.up_proj"], sequential=True, progress=lambda *args: seen.append(args))
    assert seen == [(i + 1, 4, f"model.layers.{i}") for i in range(4)]

    def fail_at_block_two(done, total, label):
        if done == 2:
            raise RuntimeError("stop at block 2")

    with pytest.raises(RuntimeError, match="block 2"):
        model.capture(["model.layers.3.mlp.up_proj"], sequential=True, progress=fail_at_block_two)
    skeleton = model._sequential.get()
    assert all(param.is_meta for param in skeleton.module.parameters())
    assert all(type(block).__name__ == "LlamaDecoderLayer" for block in skeleton.blocks)
    name = "model.layers.3.mlp.up_proj"
    torch.testing.assert_close(model.capture([name], sequential=True)[name], model.capture([name])[name])


def test_automatic_mode_goes_sequential_only_when_the_weights_exceed_the_budget(tmp_path):
    directory = save_checkpoint(tiny_llama(layers=3), tmp_path / "ckpt")
    name = "model.layers.2.self_attn.o_proj"
    model = open_model(directory)
    assert model.kv_shape(model.attention_blocks()[0]) == (2, 8)  # read from the skeleton: nothing loaded
    small = model.capture([name], max_memory=5_000_000)  # weights ~8 MB: sequential
    assert model.last_sequential is not None and not model._runtime.module.ready
    model.last_sequential = None
    whole = model.capture([name], max_memory=1 << 40)  # fits: whole model, loaded once
    assert model.last_sequential is None and model._runtime.module.ready
    torch.testing.assert_close(small[name], whole[name])
    model.capture([name], max_memory=5_000_000)  # already loaded: nothing to save
    assert model.last_sequential is None


def test_a_budget_below_the_largest_block_names_both_sizes():
    model = open_model("tiny-llama")
    with pytest.raises(ValueError, match=r"max_memory=1\.0 MiB is smaller than model\.embed_tokens .*\(29\.8 MiB\)"):
        model.capture(["model.layers.0.mlp.up_proj"], sequential=True, max_memory=1 << 20)
    with pytest.raises(ValueError, match="max_memory must be a positive"):
        model.capture_kv(["model.layers.0.self_attn"], max_memory=0)


def test_a_model_without_findable_blocks_is_refused_by_name():
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    toy = Toy()
    with pytest.raises(SequentialUnsupportedError, match="cannot find the decoder blocks of toy: sequential"):
        SequentialModel(toy, ModuleWeights(lambda: toy, "toy"), "toy", 2)
    assert issubclass(SequentialUnsupportedError, ValueError)


def test_a_checkpoint_transformers_converts_is_read_through_its_conversion(tmp_path):
    """Mixtral checkpoints store one tensor per expert (and the router under another name), fused by
    transformers when loading: sequential calibration puts each fused parameter together from the
    stored tensors transformers' own conversion names, so the layer-by-layer capture of every kind of
    layer (attention, router, experts, one the router never chose) equals the whole model's."""
    model = open_model(save_checkpoint(build_tiny_moe(), tmp_path / "moe"))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in model.stored_keys()
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.experts.0.up_proj",
        "model.layers.1.mlp.experts.2.gate_proj",
        "model.layers.1.mlp.experts.3.down_proj",
        f"model.layers.0.mlp.experts.{DEAD_EXPERT}.up_proj",
    ]
    layered = model.capture(names, sequential=True, samples=4, seq_len=32)
    whole = model.capture(names, sequential=False, samples=4, seq_len=32)
    for name in names:
        assert torch.equal(layered[name], whole[name]), name
        assert layered.token_counts[name] == whole.token_counts[name]
    assert layered.token_counts[f"model.layers.0.mlp.experts.{DEAD_EXPERT}.up_proj"] == 0
    assert model.last_sequential.blocks == 2


def test_a_parameter_no_stored_tensor_or_conversion_places_is_refused(tmp_path):
    """One expert's stored tensor missing: the conversion cannot put the fused parameter together, and
    the layer-by-layer capture is refused in one line naming it."""
    directory = save_checkpoint(build_tiny_moe(), tmp_path / "moe")
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    model = open_model(directory)
    fused = r"model\.layers\.0\.mlp\.experts\.gate_up_proj"
    with pytest.raises(SequentialUnsupportedError, match=rf"cannot find tensor '{fused}' of .* neither places it"):
        model.capture(["model.layers.0.self_attn.q_proj"], sequential=True)


def test_a_tensor_renamed_outside_the_conversion_is_captured_whole_with_a_warning(tmp_path):
    """A legacy LayerNorm ``gamma`` transformers renames when it loads, which its conversion does not
    write back: sequential calibration cannot place it and is refused; automatic mode captures the
    whole model instead, with a SequentialFallbackWarning that says why."""
    directory = tmp_path / "minilm"
    shutil.copytree(minilm_dir(), directory)
    weights = next(directory.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["embeddings.LayerNorm.gamma"] = tensors.pop("embeddings.LayerNorm.weight")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    model = open_model(str(directory))
    name = "encoder.layer.0.attention.self.query"
    with pytest.raises(SequentialUnsupportedError, match=r"cannot find tensor 'embeddings\.LayerNorm\.weight'"):
        model.capture([name], sequential=True, samples=2, seq_len=16)
    with pytest.warns(SequentialFallbackWarning, match="capturing with the whole model"):
        captured = model.capture([name], max_memory=1 << 16, samples=2, seq_len=16)
    assert captured.token_counts[name] == captured.tokens > 0


def test_a_missing_shard_is_named(tmp_path):
    directory = save_checkpoint(tiny_llama(layers=3), tmp_path / "ckpt", max_shard_size="400KB")
    model = open_model(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    shard = directory / index["model.layers.1.mlp.up_proj.weight"]
    shard.unlink()
    with pytest.raises(ModelSourceError, match=f"cannot read tensor .* from {shard}"):
        model.capture(["model.layers.2.mlp.up_proj"], sequential=True)
    with pytest.raises(ModelSourceError, match=f"names missing files: {shard}"):
        open_model(directory)


# A Llama-shaped checkpoint of about 470 MB: 22 blocks of 20.4 MB, embedding and head 12.6 MB each.
BIG = dict(
    vocab_size=4096,
    hidden_size=768,
    intermediate_size=1536,
    num_hidden_layers=22,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
)


@pytest.mark.slow
def test_a_checkpoint_larger_than_the_budget_is_calibrated_one_block_at_a_time(tmp_path):
    size = write_llama_checkpoint(tmp_path / "big", LlamaConfig(**BIG))
    model = open_model(tmp_path / "big")
    names = [f"model.layers.{i}.{layer}" for i in (0, 11, 21) for layer in ("self_attn.q_proj", "mlp.down_proj")]
    names.append("lm_head")
    sampler = PeakRss()
    acts = model.capture(names, samples=8, seq_len=64, max_memory=150 << 20)
    growth = sampler.growth()
    stats = model.last_sequential
    assert stats is not None and stats.blocks == 22 and not model._runtime.module.ready
    block = 4 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 1536 + 2 * 768)  # attention, MLP, norms; fp32
    assert stats.largest_unit == ("model.layers.0", block)
    assert stats.largest_unit[1] < size / 20
    assert stats.peak_weight_bytes <= 1.5 * stats.largest_unit[1]  # last pass: embedding, norm and head
    # 25 MiB of weights at most; the rest is the captured inputs and the heap glibc keeps after frees
    assert growth < size / 2, f"RSS grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    for name in names:
        assert acts.token_counts[name] == acts.tokens and torch.isfinite(acts[name]).all()
