"""AWQ as a stage (``lab.awq``, issue 41): where a decoder smooths, llm-compressor 0.14's search against
a plain-torch reimplementation of its ``_compute_best_scale`` / ``_apply_smoothing`` on the same
blocks, the four variants' guarantees, the folded weights and the one-line refusals."""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import save_checkpoint
from helpers import tiny_llama as random_llama
from torch import nn

import observers as ob
from lab.awq import candidates
from lab.awq.deploy import of_run
from lab.awq.inputs import hooked
from lab.awq.mappings import NOT_A_DECODER, resolve
from lab.awq.moment import InputMoment
from lab.awq.observed import observe
from lab.awq.run import run_awq
from lab.awq.search import SEARCH_OBSERVER, Variant
from lab.awq.table import awq_frame
from sample_models import open_model

INT4_G16 = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
SAMPLES, SEQ_LEN = 8, 96  # 768 tokens: more than down_proj's 688 columns, so its loss takes the linear form


@pytest.fixture(scope="module")
def tiny_llama():
    return open_model("tiny-llama")


@pytest.fixture(scope="module")
def minmax_run(tiny_llama):
    return run_awq(tiny_llama, INT4_G16, {SEARCH_OBSERVER: {}}, samples=SAMPLES, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def suite_run(tiny_llama):
    observers = {name: {} for name in ("memoryless_minmax", "mse_grid", "imatrix_mse")}
    return run_awq(tiny_llama, INT4_G16, observers, ob.AWQSpec(n_grid=6), samples=SAMPLES, seq_len=SEQ_LEN)


def folded(model, run, variant: Variant, observer: str) -> dict[str, torch.Tensor]:
    """Every stored tensor ``observer``'s ``variant`` scales change, folded (none for ``rtn``)."""
    deployed = of_run(model, run, variant, {r.mapping.name: observer for r in run.results})
    stored = set(model.stored_keys())
    return {key: deployed.fold(key, model.stored(key)) for key in deployed.touched() if key in stored}


# ------------------------------------------------------------------------------------------ mappings


def test_tiny_llama_smooths_as_llm_compressor_maps_it(tiny_llama) -> None:
    mappings = resolve(tiny_llama.module(), "model.layers", "tiny-llama")
    block = [m for m in mappings.found if m.block == 1]
    prefix = "model.layers.1"
    assert [(m.smooth, m.balance, m.parent) for m in block] == [
        (f"{prefix}.input_layernorm", tuple(f"{prefix}.self_attn.{p}_proj" for p in "qkv"), f"{prefix}.self_attn"),
        (f"{prefix}.post_attention_layernorm", (f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"), f"{prefix}.mlp"),
        (f"{prefix}.mlp.up_proj", (f"{prefix}.mlp.down_proj",), f"{prefix}.mlp.down_proj"),
    ]
    # grouped-query attention: v_proj (64 wide) does not feed o_proj's 256 columns one to one
    assert not any(m.smooth.endswith("v_proj") for m in mappings.found)
    assert len(mappings.found) == 12 and mappings.left_out == ()


def test_full_attention_gets_the_v_to_o_mapping() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    mappings = resolve(LlamaForCausalLM(config), "model.layers", "mha")
    v_to_o = [m for m in mappings.found if m.smooth.endswith("v_proj")]
    assert [(m.balance, m.parent) for m in v_to_o] == [
        (("model.layers.0.self_attn.o_proj",), "model.layers.0.self_attn.o_proj")
    ]


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(8), nn.LayerNorm(8)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, name, nn.Linear(8, 8))
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(8, 2)
        self.mlp.experts = nn.ModuleList([_Expert(), _Expert()])


def test_linear_experts_balance_with_their_router_scaled_along() -> None:
    root = nn.Module()
    root.layers = nn.ModuleList([_MoEBlock()])
    mappings = resolve(root, "layers", "moe")
    gate_up = next(m for m in mappings.found if m.smooth.endswith("post_attention_layernorm"))
    assert gate_up.parent == "layers.0.mlp" and gate_up.scaled == ("layers.0.mlp.gate",)
    assert hooked(gate_up) == "layers.0.mlp.gate"  # every token's statistics, not expert 0's tokens only
    assert gate_up.balance == tuple(f"layers.0.mlp.experts.{e}.{p}_proj" for e in (0, 1) for p in ("gate", "up"))
    downs = [m for m in mappings.found if m.smooth.endswith("up_proj")]
    assert [m.parent for m in downs] == ["layers.0.mlp.experts.0.down_proj", "layers.0.mlp.experts.1.down_proj"]


def test_experts_that_are_not_gated_linear_layers_are_left_out_with_a_line() -> None:
    block = _MoEBlock()
    block.mlp.experts[1] = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))  # an ungated expert
    root = nn.Module()
    root.layers = nn.ModuleList([block])
    mappings = resolve(root, "layers", "moe")
    assert [m.smooth for m in mappings.found] == ["layers.0.input_layernorm", "layers.0.self_attn.v_proj"]
    assert mappings.left_out == (
        "layers.0.post_attention_layernorm → the experts: layers.0.mlp's experts are not gated linear layers: "
        "not smoothed",
    )


@pytest.fixture(scope="module")
def tiny_moe():
    return open_model("tiny-moe")


def test_fused_experts_are_mapped_by_the_names_the_lab_lists_them_under(tiny_moe) -> None:
    mappings = resolve(tiny_moe.module(), "model.layers", "tiny-moe")
    listed = {info.name for info in tiny_moe.layers()}
    block = [m for m in mappings.found if m.block == 0]
    assert [m.smooth.rsplit(".", 1)[-1] for m in block] == ["input_layernorm", "post_attention_layernorm"] + [
        "up_proj"
    ] * 4
    gate_up = block[1]
    assert gate_up.parent == "model.layers.0.mlp" and gate_up.scaled == ("model.layers.0.mlp.gate",)
    assert gate_up.name == "model.layers.0.post_attention_layernorm → gate_proj, up_proj of 4 experts"
    assert set(gate_up.balance) <= listed and all(set(m.balance) <= listed for m in block)
    assert not mappings.left_out


def test_linearized_experts_compute_what_the_fused_module_computes(tiny_moe) -> None:
    from lab.awq.experts import LinearExperts, linearize

    original = tiny_moe.module().model.layers[0]
    block = linearize(copy.deepcopy(original))
    assert isinstance(block.mlp.experts, LinearExperts) and len(block.mlp.experts) == 4
    fused = original.mlp.experts
    half = fused.gate_up_proj.shape[1] // 2
    assert torch.equal(block.mlp.experts[2].up_proj.weight, fused.gate_up_proj[2, half:])
    hidden = torch.randn(2, 24, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = block.mlp(hidden), original.mlp(hidden)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_an_moe_parent_judges_stacked_candidates_as_it_judges_each_alone(tiny_moe) -> None:
    # the replicas of a batch reach each linearized expert as contiguous shares, in token order
    from lab.awq.experts import linearize
    from lab.awq.parent import ParentCalls

    block = linearize(copy.deepcopy(tiny_moe.module().model.layers[0]))
    mlp = block.mlp
    hidden = torch.randn(1, 20, 256, generator=torch.Generator().manual_seed(1))
    mlp.gate.weight.data.normal_(generator=torch.Generator().manual_seed(2))  # every expert gets tokens
    calls = ParentCalls(mlp, [((hidden,), {})], [torch.ones(1, 20, dtype=torch.bool)])
    balance = {f"experts.{e}.{p}": mlp.get_submodule(f"experts.{e}.{p}") for e in range(4) for p in ("gate_proj",)}
    noisy = [
        {name: layer.weight.detach() + 0.01 * k * torch.ones_like(layer.weight) for name, layer in balance.items()}
        for k in (1, 2, 3)
    ]
    reference = calls.outputs()
    moment = InputMoment.of_matrix(torch.eye(256, dtype=torch.float64), 64)
    stacked = calls.losses(balance, noisy, reference, 512, moment)
    alone = torch.cat([calls.losses(balance, [r], reference, 512, moment) for r in noisy])
    assert torch.allclose(stacked, alone, rtol=1e-6) and bool((stacked > 0).all())


def test_a_stacked_replay_swaps_the_balance_layers_forward_and_puts_back_what_was_there() -> None:
    # each balance layer computes only the stacked shares' products while a replay runs; a forward
    # already set on the instance (accelerate's hooks set one) is there again afterwards
    from lab.awq.parent import ParentCalls

    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    first, calls = mlp[0], []
    own = first.forward
    first.forward = lambda x: calls.append(x.shape) or own(x)
    x = torch.randn(2, 10, 16)
    parent = ParentCalls(mlp, [((x,), {})], [torch.ones(2, 10, dtype=torch.bool)])
    reference = parent.outputs()
    calls.clear()
    replaced = [first.weight.detach() + 0.05 * torch.randn(32, 16) for _ in range(3)]
    stacked = parent.losses({"0": first}, [{"0": w} for w in replaced], reference, 32, torch.eye(16).double())
    by_hand = [F.mse_loss(mlp[2](mlp[1](F.linear(x, w, first.bias))), reference[0]).item() for w in replaced]
    assert calls == [] and torch.allclose(stacked, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5)
    mlp(x)
    assert calls == [(2, 10, 16)]  # the instance's own forward is back
    with pytest.raises(TypeError, match="plain linear map"):
        ParentCalls(mlp, [((x,), {})], [torch.ones(2, 10, dtype=torch.bool)]).losses(
            {"1": mlp[1]}, [{"1": torch.zeros(1)}], reference, 32, torch.eye(16).double()
        )


class _Viewing(nn.Module):
    """A parent that views its input in another shape, as a MoE block does (``view(-1, hidden)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.seen = nn.Linear(16, 8), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.stride(0))
        return self.proj(x.view(-1, x.shape[-1])).view(*x.shape[:-1], 8).relu()


def test_a_batch_of_one_reaches_the_parent_as_a_view_and_a_module_that_cannot_take_one_gets_copies() -> None:
    # n shares of a batch of one are the same numbers: a view (stride 0 along the shares) saves
    # writing n copies per call; a module that views its input otherwise refuses it, and gets copies
    from lab.awq.parent import ParentCalls

    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(1, 10, 16)
    seen = []
    mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].stride(0)))
    parent = ParentCalls(mlp, [((x,), {})], [torch.ones(1, 10, dtype=torch.bool)])
    reference = parent.outputs()
    replaced = [mlp[0].weight.detach() + 0.05 * torch.randn(32, 16) for _ in range(3)]
    seen.clear()
    losses = parent.losses({"0": mlp[0]}, [{"0": w} for w in replaced], reference, 32, torch.eye(16).double())
    by_hand = [F.mse_loss(mlp[2](mlp[1](F.linear(x, w, mlp[0].bias))), reference[0]).item() for w in replaced]
    assert seen == [0] and torch.allclose(losses, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5)

    viewing = _Viewing()
    parent = ParentCalls(viewing, [((x,), {})], [torch.ones(1, 10, dtype=torch.bool)])
    reference = parent.outputs()
    replaced = [viewing.proj.weight.detach() + 0.05 * torch.randn(8, 16) for _ in range(3)]
    for _ in range(2):
        viewing.seen.clear()
        losses = parent.losses({"proj": viewing.proj}, [{"proj": w} for w in replaced], reference, 8, torch.eye(16))
        by_hand = [F.mse_loss(F.linear(x, w, viewing.proj.bias).relu(), reference[0]).item() for w in replaced]
        assert torch.allclose(losses, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5)
    assert viewing.seen == [160]  # the second replay copies at once, without trying a view again


def test_experts_stored_one_per_expert_are_searched_and_chosen_by_their_stored_names(tmp_path) -> None:
    """tiny-moe as transformers saves it (each expert's w1/w3/w2 stored apart, the router renamed,
    loaded fused): the layer-by-layer pass reads it through transformers' conversion, and its experts'
    mappings are searched under their modules' names, found from the names the model lists them by
    (where they are stored), as the built-in tiny-moe's are; choosing the stored names chooses them."""
    from lab.awq.run import listed_names
    from sample_models.builtin import build_tiny_moe

    model = open_model(str(save_checkpoint(build_tiny_moe(), tmp_path / "moe")))
    stored = [info.name for info in model.layers() if ".block_sparse_moe.experts." in info.name]
    assert "model.layers.0.block_sparse_moe.experts.0.w1" in stored
    assert listed_names(
        model, ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.2.down_proj"]
    ) == {
        "model.layers.0.mlp.experts.0.gate_proj": "model.layers.0.block_sparse_moe.experts.0.w1",
        "model.layers.0.mlp.experts.2.down_proj": "model.layers.0.block_sparse_moe.experts.2.w2",
    }
    chosen = [name for name in stored if name.startswith("model.layers.0.")]
    run = run_awq(model, INT4_G16, {"minmax": {}}, ob.AWQSpec(n_grid=3), layers=chosen, samples=2, seq_len=16)
    names = [r.mapping.name for r in run.results]
    assert names[0] == "model.layers.0.post_attention_layernorm → gate_proj, up_proj of 4 experts"
    assert all(r.mapping.block == 0 for r in run.results) and len(names) >= 2  # gate/up, and up → down of routed ones
    assert run.results[0].mapping.scaled == ("model.layers.0.mlp.gate",)  # the router, folded with the experts


def test_the_app_finds_an_expert_stored_one_per_expert_by_the_name_the_analysis_lists(tmp_path) -> None:
    """The Error and Ranges pages ask for a layer by the analysis's name: for a hub Mixtral's expert
    that is where it is stored (``block_sparse_moe.experts.0.w1``); the app's AWQ result finds its
    mapping and draws its smoothed weight with the qparams the search gave its module."""
    from lab.awq.run import AWQWalk
    from lab.awq.session import AWQState
    from sample_models.builtin import build_tiny_moe

    class Analysis:  # what finish keeps a weak reference to
        pass

    model = open_model(str(save_checkpoint(build_tiny_moe(), tmp_path / "moe")))
    stored = "model.layers.0.block_sparse_moe.experts.0.w1"
    walk = AWQWalk(model, INT4_G16, {"minmax": {}}, ob.AWQSpec(n_grid=3), layers=[stored], samples=2, seq_len=16)
    model.capture([], tap=walk, samples=2, seq_len=16)
    analysis = Analysis()
    result = AWQState().finish(model, None, analysis, walk)
    mapping = result.mapping_of(stored)
    assert mapping is not None and "model.layers.0.mlp.experts.0.gate_proj" in mapping.mapping.balance
    weight, drawn = result.smoothed(model, mapping, stored, Variant.LLM_COMPRESSOR, "minmax")
    scales = mapping.scales[(Variant.LLM_COMPRESSOR, "minmax")]
    assert torch.equal(weight, candidates.smoothed(model.weight(stored), scales))
    module_qparams = mapping.qparams[(Variant.LLM_COMPRESSOR, "minmax")]["model.layers.0.mlp.experts.0.gate_proj"]
    assert drawn.qparams is module_qparams and drawn.error is None


def test_tiny_moe_searches_its_expert_mlps_and_folds_them_into_the_fused_weights(tiny_moe) -> None:
    from lab.awq.deploy import StoredByLayer, of_run

    layers = [f"model.layers.0.mlp.experts.{e}.{p}" for e in (0, 1) for p in ("gate_proj", "down_proj")]
    observers = {SEARCH_OBSERVER: {}, "mse_grid": {}}
    run = run_awq(tiny_moe, INT4_G16, observers, ob.AWQSpec(n_grid=3), layers=layers, samples=2, seq_len=32)
    names = [r.mapping.name for r in run.results]
    assert names[0].endswith("of 4 experts") and len(names) == 3  # gate/up; up -> down of experts 0 and 1
    for result in run.results:
        assert {(r.observer, r.variant) for r in result.rows} == {(o, v) for o in observers for v in Variant}
        assert all(r.error is None and r.mapping_error > 0 for r in result.rows)
    assert run.left_out == ()  # the float model routes block 0's tokens to experts 0 and 1 only
    for variant in (Variant.LLM_COMPRESSOR, Variant.CLIP_SEARCH):
        deployed = of_run(tiny_moe, run, variant, {r.mapping.name: "mse_grid" for r in run.results})
        stored = StoredByLayer(tiny_moe)
        up = "model.layers.0.mlp.experts.1.up_proj"
        gate_up = next(r for r in run.results if up in r.mapping.balance).scales[(variant, "mse_grid")]
        down = next(r for r in run.results if r.mapping.smooth == up).scales[(variant, "mse_grid")]
        by_hand = ((stored(f"{up}.weight").double() * gate_up).float().double() / down.view(-1, 1)).float()
        assert torch.equal(deployed.fold(f"{up}.weight", stored(f"{up}.weight")), by_hand)
        # the fused 3-D tensors folded as their experts' views: the folded model is the float model
        model = copy.deepcopy(tiny_moe.module())
        model.load_state_dict({key: deployed.fold(key, tiny_moe.stored(key)) for key in tiny_moe.stored_keys()})
        fused = model.model.layers[0].mlp.experts.gate_up_proj
        half = fused.shape[1] // 2
        assert torch.equal(fused[1, half:], deployed.fold(f"{up}.weight", stored(f"{up}.weight")))
        ids = torch.tensor([list(tiny_moe.calibration_set(None, 1, SEQ_LEN).windows[0])])
        with torch.no_grad():
            ours, theirs = model(input_ids=ids).logits, tiny_moe.module()(input_ids=ids).logits
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_tiny_moes_model_level_effect_is_the_folded_and_quantized_models(tiny_moe) -> None:
    """A fused MoE's experts run at model level inside their fused module: the runner's outputs with
    the deployment's weights in the model's coordinates are the folded model's with every balance
    layer (the experts' views of the 3-D weights included) quantized by the observer on its folded
    weight, and ``model_effect`` measures every pair."""
    from lab.awq.deploy import of_run
    from lab.awq.effect import model_effect, variant_weights
    from lab.effect.evaluate import Evaluator
    from sample_models.effect import TensorQuant
    from sample_models.layers import resolve_layer

    layers = [f"model.layers.0.mlp.experts.{e}.{p}" for e in (0, 1) for p in ("gate_proj", "down_proj")]
    observers = {SEARCH_OBSERVER: {}, "mse_grid": {}}
    run = run_awq(tiny_moe, INT4_G16, observers, ob.AWQSpec(n_grid=3), layers=layers, samples=2, seq_len=32)
    evaluator = Evaluator(tiny_moe, samples=4)
    weights = variant_weights(tiny_moe, run, Variant.LLM_COMPRESSOR, "mse_grid")
    assert any(".experts." in name for name in weights)
    ours = evaluator.runner.run({(n, "weight"): TensorQuant(INT4_G16, None, w) for n, w in weights.items()}).outputs
    deployed = of_run(tiny_moe, run, Variant.LLM_COMPRESSOR, {r.mapping.name: "mse_grid" for r in run.results})
    model = copy.deepcopy(tiny_moe.module())
    model.load_state_dict({key: deployed.fold(key, tiny_moe.stored(key)) for key in tiny_moe.stored_keys()})
    with torch.no_grad():
        for name in weights:
            view = resolve_layer(model, name).weight()
            found = ob.run_one("mse_grid", view.detach().clone(), INT4_G16, "weight").qparams
            view.copy_(ob.fake_quantize(view.detach().clone(), found, INT4_G16))
        folded_model = [
            model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits for b in evaluator.runner.batches
        ]
    apart = max(float((a - b).abs().max()) for a, b in zip(ours, folded_model, strict=True))
    effect = max(float((a - b).abs().max()) for a, b in zip(evaluator.runner.float_outputs, folded_model, strict=True))
    assert effect > 0 and apart <= 1e-4 * effect
    table = model_effect(tiny_moe, run, evaluator)
    assert len(table) == len(observers) * len(Variant) and (table["kl"] > 0).all()


def test_an_encoder_is_one_line() -> None:
    model = open_model("minilm")
    with pytest.raises(ValueError) as raised:
        run_awq(model, INT4_G16, {SEARCH_OBSERVER: {}}, samples=2, seq_len=16)
    assert str(raised.value) == NOT_A_DECODER.format(model=model.name)


def test_a_group_size_that_does_not_divide_is_refused_before_any_search(tiny_llama) -> None:
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=32, symmetric=True)
    with pytest.raises(ValueError) as raised:
        run_awq(tiny_llama, spec, {SEARCH_OBSERVER: {}}, samples=2, seq_len=16)
    message = str(raised.value)
    assert "down_proj has 688 input columns" in message and "\n" not in message


# ----------------------------------------------------- llm-compressor's search, reimplemented in plain torch


def _abs_sum(into: list):
    """A forward hook adding |x| of a layer's input over its tokens (float32) and their count."""

    def hook(module, args, output):
        x = args[0].abs().detach().flatten(0, -2)
        into[0] = into[0] + x.float().sum(0)
        into[1] += x.shape[0]

    return hook


def _calls(into: list):
    """A forward pre-hook keeping a module's every call."""

    def hook(module, args, kwargs):
        into.append((args, kwargs))

    return hook


def _reference_awq(model: nn.Module, batches: list[torch.Tensor], spec: ob.QuantSpec, n_grid: int = 20):
    """llm-compressor 0.14's AWQ (duo scaling, memoryless min-max during the search) typed out on a
    Llama: per block, every batch through the block with hooks (|x| sums on the first balance
    layer, the parent's calls), then per mapping the grid loop one candidate at a time with
    ``F.linear`` weights swapped in, the winner folded in; the next block fed by the smoothed one.
    Attention is eager, as llm-compressor's ``calibration_forward_context`` forces it. Returns each
    mapping's winning grid index and the smoothed state dict."""
    model = copy.deepcopy(model)
    model.config._attn_implementation = "eager"
    layers = model.model.layers
    inputs: list[tuple] = []

    def record(module, args, kwargs):
        inputs.append((args, kwargs))

    handle = layers[0].register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    handle.remove()
    hidden = [kwargs.get("hidden_states", args[0] if args else None) for args, kwargs in inputs]
    rest = [{k: v for k, v in kwargs.items() if k != "hidden_states"} for _, kwargs in inputs]
    picks = []
    grid = [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]
    for block in layers:
        maps = [
            (
                block.input_layernorm,
                [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
                block.self_attn,
            ),
            (block.post_attention_layernorm, [block.mlp.gate_proj, block.mlp.up_proj], block.mlp),
            (block.mlp.up_proj, [block.mlp.down_proj], block.mlp.down_proj),
        ]
        sums = {id(m[0]): [0, 0] for m in maps}
        calls = {id(m[2]): [] for m in maps}
        handles = []
        for smooth, balance, parent in maps:
            handles.append(balance[0].register_forward_hook(_abs_sum(sums[id(smooth)])))
            handles.append(parent.register_forward_pre_hook(_calls(calls[id(parent)]), with_kwargs=True))
        with torch.no_grad():
            for h, kwargs in zip(hidden, rest, strict=True):
                block(h, **kwargs)
        for handle in handles:
            handle.remove()
        for smooth, balance, parent in maps:
            with torch.no_grad():
                run = [parent(*a, **k) for a, k in calls[id(parent)]]
                reference = [r[0] if isinstance(r, tuple) else r for r in run]
                x_mean = sums[id(smooth)][0] / torch.tensor(sums[id(smooth)][1])
                total, rows = 0, 0
                for layer in balance:
                    w = layer.weight.clone().reshape(-1, spec.group_size).abs()
                    w = (w / (w.amax(dim=1, keepdim=True) + 1e-6)).reshape(layer.weight.shape)
                    total, rows = total + w.sum(0, dtype=torch.float64), rows + w.shape[0]
                w_mean = total / rows
                originals = {layer: layer.weight.clone() for layer in balance}
                best, best_error, best_scales = -1, float("inf"), None
                for index, (ratio, duo) in enumerate(grid):
                    if duo:
                        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
                    else:
                        scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
                    scales = scales / (scales.max() * scales.min()).sqrt()
                    for layer in balance:
                        smoothed = (originals[layer] * scales.view(1, -1)).to(layer.weight.dtype)
                        groups = smoothed.reshape(-1, spec.group_size)
                        step = groups.abs().amax(dim=1, keepdim=True) / 7.5
                        step = torch.where(step == 0, torch.ones_like(step), step)
                        q = (torch.clamp(torch.round(groups / step), -8, 7) * step).reshape(smoothed.shape)
                        layer.weight.data = (q / scales.view(1, -1)).to(layer.weight.dtype)
                    out = [parent(*a, **k) for a, k in calls[id(parent)]]
                    out = [o[0] if isinstance(o, tuple) else o for o in out]
                    loss = sum(F.mse_loss(r, o, reduction="sum") for r, o in zip(reference, out, strict=True))
                    loss = (loss / sum(r.numel() for r in reference)).item()
                    if loss < best_error:
                        best, best_error, best_scales = index, loss, scales.clone()
                for layer in balance:
                    layer.weight.data = (originals[layer] * best_scales.view(1, -1)).to(layer.weight.dtype)
                if smooth.weight.dim() == 1:
                    smooth.weight.div_(best_scales)
                else:
                    smooth.weight[-best_scales.numel() :].div_(best_scales.view(-1, 1))
                picks.append(best)
        with torch.no_grad():
            hidden = [block(h, **kwargs) for h, kwargs in zip(hidden, rest, strict=True)]
            hidden = [h[0] if isinstance(h, tuple) else h for h in hidden]
    return picks, model.state_dict()


def test_the_llm_compressor_variant_is_llm_compressors_search(tiny_llama, minmax_run) -> None:
    windows = tiny_llama.calibration_set(None, SAMPLES, SEQ_LEN).windows
    batches = [torch.tensor([list(w)]) for w in windows]
    picks, smoothed = _reference_awq(tiny_llama.module(), batches, INT4_G16)
    grid = ob.AWQSpec().grid()
    ours = [
        grid.index(
            (r.row(Variant.LLM_COMPRESSOR, SEARCH_OBSERVER).ratio, r.row(Variant.LLM_COMPRESSOR, SEARCH_OBSERVER).duo)
        )
        for r in minmax_run.results
    ]
    assert ours == picks
    changed = folded(tiny_llama, minmax_run, Variant.LLM_COMPRESSOR, SEARCH_OBSERVER)
    assert len(changed) == 4 * (2 + 3 + 2 + 1)  # per block: 2 norms, q/k/v, gate/up (up twice), down
    for key, tensor in changed.items():
        assert torch.allclose(tensor, smoothed[key], rtol=1e-6, atol=1e-7), key


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is None, reason="llm-compressor is not installed")
def test_the_llm_compressor_variant_equals_llm_compressors_oneshot(tmp_path) -> None:
    """Parity with the installed llm-compressor (the bench environment has it): ``oneshot`` of the
    lab's recipe on tiny-llama, on the same 32 × 128 records, folds every smoothed norm and balance
    weight the lab's deployment folds, to the bit, and every balance layer's codes are the lab's."""
    from bench.bench_awq_oneshot import calibration_batches, compare, lab_variant, oneshot_process, write_model

    model_dir = write_model("tiny-llama", tmp_path / "tiny-llama")
    _, ours, codes, recipe_file = lab_variant(model_dir, tmp_path)
    _, theirs = oneshot_process(model_dir, calibration_batches(model_dir), recipe_file, tmp_path, "oneshot")
    assert len(ours) == 4 * 8 and all(torch.equal(tensor, theirs[key]) for key, tensor in ours.items())
    found = compare(ours, codes, theirs)
    assert found["close"] == 32 and set(found["shares"].values()) == {1.0}


# --------------------------------------------------------------------------------- the four variants


def test_every_observer_has_four_rows_per_mapping(suite_run) -> None:
    for result in suite_run.results:
        assert {(r.observer, r.variant) for r in result.rows} == {(o, v) for o in suite_run.observers for v in Variant}
        for row in result.rows:
            assert row.error is None and row.mapping_error is not None and row.mapping_error >= 0
            assert set(row.layer_errors) == set(result.mapping.balance) == set(row.clipped)
            assert (row.ratio is None) == (row.variant == Variant.RTN)


def test_the_observer_inside_the_search_is_never_worse_than_rtn_or_llm_compressor(suite_run) -> None:
    # its grid holds the identity (round-to-nearest) and llm-compressor's winner
    for result in suite_run.results:
        for observer in suite_run.observers:
            inside = result.row(Variant.OBSERVER_IN_SEARCH, observer).mapping_loss
            assert inside <= result.row(Variant.RTN, observer).mapping_loss
            assert inside <= result.row(Variant.LLM_COMPRESSOR, observer).mapping_loss


def test_llm_compressor_scales_do_not_depend_on_the_observer_and_minmax_inside_agrees(suite_run) -> None:
    for result in suite_run.results:
        scales = [result.scales[(Variant.LLM_COMPRESSOR, o)] for o in suite_run.observers]
        assert all(torch.equal(scales[0], s) for s in scales)
        same = (
            result.row(Variant.OBSERVER_IN_SEARCH, SEARCH_OBSERVER),
            result.row(Variant.LLM_COMPRESSOR, SEARCH_OBSERVER),
        )
        assert (same[0].ratio, same[0].duo) == (same[1].ratio, same[1].duo)


def test_the_clip_search_clips_and_the_others_do_not_with_min_max(suite_run) -> None:
    for result in suite_run.results:
        assert all(v == 0.0 for v in result.row(Variant.LLM_COMPRESSOR, SEARCH_OBSERVER).clipped.values())
        assert any(v > 0.0 for v in result.row(Variant.CLIP_SEARCH, SEARCH_OBSERVER).clipped.values())


def test_folded_weights_keep_the_float_model(tiny_llama, suite_run) -> None:
    for variant in (Variant.LLM_COMPRESSOR, Variant.OBSERVER_IN_SEARCH, Variant.CLIP_SEARCH):
        model = copy.deepcopy(tiny_llama.module())
        model.load_state_dict(folded(tiny_llama, suite_run, variant, "mse_grid"), strict=False)
        ids = torch.tensor([list(tiny_llama.calibration_set(None, 1, SEQ_LEN).windows[0])])
        with torch.no_grad():
            ours, theirs = model(input_ids=ids).logits, tiny_llama.module()(input_ids=ids).logits
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    assert folded(tiny_llama, suite_run, Variant.RTN, "mse_grid") == {}


# ------------------------------------------------------------------------------ how candidates are made


@pytest.mark.parametrize("observer", ["memoryless_minmax", "mse_grid", "modelopt_mse", "imatrix_mse"])
@pytest.mark.parametrize("clip", [None, [0.5, 0.75, 1.0]])
@pytest.mark.parametrize(("rows", "seed"), [((12, 8), 1), ((2, 2), 13)])
def test_stacked_candidates_are_the_candidates_made_one_at_a_time(observer: str, clip, rows, seed) -> None:
    """Two-row weights have four groups: mse_grid's early stop then bites on some candidates and
    not others, which stacking keeps apart (``observe(apart=…)``)."""
    torch.manual_seed(seed)
    weights = {"a": torch.randn(rows[0], 32) * torch.rand(1, 32) * 4, "b": torch.randn(rows[1], 32)}
    x = torch.randn(64, 32) * torch.rand(32) * 3
    moment = InputMoment.of(x)
    scales = ob.awq.candidate_scales(
        x.abs().mean(0), ob.awq.weight_means(list(weights.values()), INT4_G16), ob.AWQSpec(n_grid=4).grid()
    )
    together = candidates.make(weights, scales, observer, INT4_G16, {}, moment, clip)
    for row, made in zip(scales, together, strict=True):
        alone = candidates.make(weights, row.unsqueeze(0), observer, INT4_G16, {}, moment, clip)[0]
        for name in weights:
            assert torch.equal(made.effective[name], alone.effective[name])
            assert torch.equal(made.qparams[name].scale, alone.qparams[name].scale)


def test_every_observer_reads_the_smoothed_grid_as_views_and_leaves_it_as_it_was() -> None:
    # a search smooths its grid once per layer (one stacked product, each row the weight smoothed
    # by its own scales) and every observer and clip search reads those rows in place: none may
    # write into them, or the next observer would see another weight
    torch.manual_seed(2)
    weights = {"a": torch.randn(12, 32) * torch.rand(1, 32) * 4}
    x = torch.randn(64, 32) * torch.rand(32) * 3
    moment = InputMoment.of(x)
    scales = ob.awq.candidate_scales(x.abs().mean(0), None, ob.AWQSpec(n_grid=5, duo_scaling="off").grid())
    memo: dict = {}
    candidates.make(weights, scales, "memoryless_minmax", INT4_G16, {}, moment, None, memo)
    (grid,) = [value for key, value in memo.items() if key.startswith("smoothed:a:")]
    before = grid.clone()
    assert all(torch.equal(grid[i], candidates.smoothed(weights["a"], row)) for i, row in enumerate(scales))
    for observer in ob.applicable(INT4_G16):
        for clip in (None, [0.5, 0.75, 1.0]):
            candidates.make(weights, scales, observer, INT4_G16, {}, moment, clip, memo)
    assert torch.equal(grid, before)


def test_a_clip_search_keeps_the_ratio_whose_output_error_is_least() -> None:
    # one group with an outlier column the inputs never use: shrinking below it costs nothing, and
    # the finer grid on the other columns gains; a group the inputs use evenly keeps its range
    weight = torch.tensor([[8.0, 1.0, -1.2, 0.7] + [1.0, -0.9, 0.8, -1.0]])
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=4, symmetric=True)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 0.0
    moment = InputMoment.of(x)
    found = candidates.make({"w": weight}, None, "memoryless_minmax", spec, {}, moment, [0.25, 0.5, 1.0])[0]
    plain = ob.run_one("memoryless_minmax", weight, spec, "weight").qparams
    ratio = (found.qparams["w"].max_val / plain.max_val).reshape(-1)
    assert ratio[0] < 1.0 and ratio[1] == 1.0


def test_a_linear_parents_loss_is_its_mean_squared_output_difference_raced_by_row_blocks() -> None:
    from lab.awq.parent import ROW_BLOCK, ROW_BLOCK_COST, LinearCalls, ParentCalls
    from lab.awq.race import Entrant, Heat, Race

    torch.manual_seed(2)
    layer = nn.Linear(16, 2 * ROW_BLOCK + 8, bias=False)  # three row blocks, the last one short
    tokens = ROW_BLOCK_COST * 16 + 1
    x = torch.randn(1, tokens, 16)
    parent = ParentCalls(layer, [((x,), {})], [torch.ones(1, tokens, dtype=torch.bool)])
    spreads = (0.05, 0.01, 0.3, 0.012, 0.2, 0.5)
    replaced = [layer.weight.detach() + spread * torch.randn(layer.out_features, 16) for spread in spreads]
    moment = InputMoment.of(x[0])
    reference = parent.outputs()
    assert isinstance(parent.judged({"w": layer}, moment), LinearCalls)  # 65 tokens: more than 4 x 16 columns
    linear = parent.losses({"w": layer}, [{"w": w} for w in replaced], reference, 16, moment)
    forward = torch.tensor([F.mse_loss(F.linear(x, w), reference[0]).item() for w in replaced], dtype=torch.float64)
    assert torch.allclose(linear, forward, rtol=1e-5)
    # the race reads the row blocks as calls: the first least of the whole losses, to the bit, with
    # the far candidates stopped before the last block
    race, heat = Race(parent, {"w": layer}, reference, 16, moment), Heat()
    race.run([Entrant(i, f"w{i}", {"w": w}, heat) for i, w in enumerate(replaced)])
    assert race.calls == 3 and heat.leader == (float(linear.min()), int(linear.argmin())) == (float(linear[1]), 1)
    assert {"w2", "w4", "w5"} <= race.bounds.keys()


def test_a_linear_parent_with_few_tokens_a_column_is_judged_by_running_them() -> None:
    # float64 row blocks cost about four float32 token products a multiply-add: with no more than
    # ROW_BLOCK_COST tokens a column the calls themselves are cheaper, and judge the same losses
    from lab.awq.parent import ROW_BLOCK_COST, ParentCalls

    torch.manual_seed(3)
    layer = nn.Linear(16, 8, bias=False)
    x = torch.randn(1, ROW_BLOCK_COST * 16, 16)
    parent = ParentCalls(layer, [((x,), {})], [torch.ones(1, x.shape[1], dtype=torch.bool)])
    moment = InputMoment.of(x[0])
    assert parent.judged({"w": layer}, moment) is parent
    replaced = [layer.weight.detach() + 0.1 * torch.randn(8, 16) for _ in range(3)]
    reference = parent.outputs()
    losses = parent.losses({"w": layer}, [{"w": w} for w in replaced], reference, 16, moment)
    forward = torch.tensor([F.mse_loss(F.linear(x, w), reference[0]).item() for w in replaced], dtype=torch.float64)
    assert torch.allclose(losses, forward, rtol=1e-5)


def test_a_checkpoint_is_walked_one_block_at_a_time_never_loaded_whole(tmp_path) -> None:
    # the stage rides a sequential pass: each block's weights are loaded while the pass is on it,
    # and the search sees what it sees when the whole model was loaded before
    directory = save_checkpoint(random_llama(layers=2), tmp_path / "llama")
    observers = {SEARCH_OBSERVER: {}, "mse_grid": {}}
    awq = ob.AWQSpec(n_grid=4)
    layers = ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    streamed_model = open_model(str(directory))
    streamed = run_awq(
        streamed_model, INT4_G16, observers, awq, layers=layers, samples=4, seq_len=64, max_memory=64 << 20
    )
    assert not streamed_model._require_runtime().module.ready  # the whole model was never loaded
    loaded = open_model(str(directory))
    loaded.module()
    whole = run_awq(loaded, INT4_G16, observers, awq, layers=layers, samples=4, seq_len=64)
    assert [r.mapping for r in streamed.results] == [r.mapping for r in whole.results] and len(whole.results) == 2
    assert (streamed.tokens, streamed.held_out_tokens) == (whole.tokens, whole.held_out_tokens)
    for mine, theirs in zip(streamed.results, whole.results, strict=True):
        assert torch.allclose(mine.searched, theirs.searched, rtol=1e-5)
        for a, b in zip(mine.rows, theirs.rows, strict=True):
            assert (a.observer, a.variant, a.ratio, a.duo) == (b.observer, b.variant, b.ratio, b.duo)
            assert a.mapping_error == pytest.approx(b.mapping_error, rel=1e-4)
            assert a.held_out_error == pytest.approx(b.held_out_error, rel=1e-4)


def test_the_picks_are_measured_on_held_out_text(suite_run) -> None:
    assert suite_run.held_out_tokens > 0
    for result in suite_run.results:
        for row in result.rows:
            assert row.held_out_error is not None and row.held_out_error >= 0
            assert set(row.held_out_layer_errors) == set(result.mapping.balance)
        # held-out is not calibration: the observer inside the search is not always the best there
        assert any(r.held_out_error != r.mapping_error for r in result.rows)
    # the table shows each row's balance layers' held-out error beside the calibration one, their mean
    frame = awq_frame(suite_run).set_index(["mapping", "observer", "variant"])
    for result in suite_run.results:
        for row in result.rows:
            shown = frame.loc[(result.mapping.name, row.observer, str(row.variant))]
            errors = row.held_out_layer_errors.values()
            assert shown["held_out_layer_error"] == pytest.approx(sum(errors) / len(errors), rel=1e-12)
            assert shown["held_out_layer_error"] != shown["layer_error"]


def test_only_mappings_of_the_chosen_layers_are_searched(tiny_llama) -> None:
    chosen = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.k_proj"]
    run = run_awq(
        tiny_llama, INT4_G16, {SEARCH_OBSERVER: {}}, ob.AWQSpec(n_grid=3), layers=chosen, samples=2, seq_len=16
    )
    assert [r.mapping.smooth for r in run.results] == ["model.layers.0.input_layernorm", "model.layers.1.mlp.up_proj"]
    with pytest.raises(ValueError, match="none of the chosen layers is a balance layer"):
        run_awq(tiny_llama, INT4_G16, {SEARCH_OBSERVER: {}}, layers=["lm_head"], samples=2, seq_len=16)


def test_fused_layers_share_the_scale_a_server_keeps_in_every_candidate(tiny_llama) -> None:
    # NVFP4: q/k/v are one linear to vLLM, which keeps one global scale (the max); llm-compressor
    # links their observers during its search; so does every candidate here
    spec = ob.preset("NVFP4A16")["weight"]
    prefix = "model.layers.0.self_attn"
    weights = {f"{prefix}.{p}_proj": tiny_llama.weight(f"{prefix}.{p}_proj").float() for p in "qkv"}
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    moment = InputMoment.of(x)
    scales = ob.awq.candidate_scales(
        x.abs().mean(0), ob.awq.weight_means(list(weights.values()), spec), ob.AWQSpec(n_grid=3).grid()
    )
    made = candidates.make(weights, scales, "memoryless_minmax", spec, {}, moment)
    for candidate in made:
        globals_ = [candidate.qparams[name].global_scale for name in weights]
        assert all(torch.equal(g, globals_[0]) for g in globals_)
        alone = [
            ob.run_one(
                "memoryless_minmax", candidates.smoothed(w, candidate.scales), spec, "weight"
            ).qparams.global_scale
            for w in weights.values()
        ]
        assert torch.equal(globals_[0], torch.stack(alone).min().reshape(globals_[0].shape))  # the widest member's


def test_observers_that_agree_on_a_weight_observed_once_search_it_once(tiny_llama, monkeypatch) -> None:
    # minmax and moving_average_minmax are memoryless_minmax on a weight observed once, and
    # mse_grid_moving_average is mse_grid: a search's memo runs each twin's observer once per grid
    # point and gives every twin the same qparams; other knobs are other qparams
    weights = {"w": tiny_llama.weight("model.layers.0.mlp.gate_proj").float()}
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    moment = InputMoment.of(x)
    scales = ob.awq.candidate_scales(x.abs().mean(0), None, ob.AWQSpec(n_grid=3, duo_scaling="off").grid())
    created = []
    real = ob.create
    monkeypatch.setattr(ob, "create", lambda name, *a, **k: created.append(name) or real(name, *a, **k))
    memo: dict = {}
    made = {
        (name, repr(knobs)): candidates.make(weights, scales, name, INT4_G16, knobs, moment, None, memo)
        for name, knobs in (
            ("memoryless_minmax", {}),
            ("minmax", {}),
            ("moving_average_minmax", {"averaging_constant": 0.5}),
            ("mse_grid", {}),
            ("mse_grid_moving_average", {}),
            ("mse_grid_moving_average", {"grid": 20}),
        )
    }
    assert sorted(set(created)) == ["memoryless_minmax", "mse_grid"] and len(created) == 3  # stacked rows
    keys = {label: [c.key for c in found] for label, found in made.items()}
    assert keys[("minmax", "{}")] == keys[("memoryless_minmax", "{}")]
    assert keys[("moving_average_minmax", "{'averaging_constant': 0.5}")] == keys[("memoryless_minmax", "{}")]
    assert keys[("mse_grid_moving_average", "{}")] == keys[("mse_grid", "{}")]
    assert keys[("mse_grid_moving_average", "{'grid': 20}")] != keys[("mse_grid", "{}")]


def test_a_candidate_whose_digest_is_alive_shares_its_effective_weights_and_the_memo_keeps_none() -> None:
    # a twin observer's candidates are the first one's: they take its effective weights instead of
    # quantizing and dividing again, equal to those made afresh; once no candidate holds them, the
    # memo holds nothing, and the next call makes them again
    torch.manual_seed(4)
    weights = {"a": torch.randn(12, 32) * torch.rand(1, 32) * 4, "b": torch.randn(8, 32)}
    x = torch.randn(64, 32) * torch.rand(32) * 3
    moment = InputMoment.of(x)
    scales = ob.awq.candidate_scales(
        x.abs().mean(0), ob.awq.weight_means(list(weights.values()), INT4_G16), ob.AWQSpec(n_grid=4).grid()
    )
    fresh = candidates.make(weights, scales, "minmax", INT4_G16, {}, moment)
    memo: dict = {}
    first = candidates.make(weights, scales, "memoryless_minmax", INT4_G16, {}, moment, None, memo)
    twin = candidates.make(weights, scales, "minmax", INT4_G16, {}, moment, None, memo)
    for one, other, alone in zip(first, twin, fresh, strict=True):
        assert other.key == one.key == alone.key
        for name in weights:
            assert other.effective[name] is one.effective[name]
            assert torch.equal(other.effective[name], alone.effective[name])
    assert len(memo["effective"]) == len(first) * len(weights)
    del first, twin, one, other
    gc.collect()
    assert len(memo["effective"]) == 0
    again = candidates.make(weights, scales, "minmax", INT4_G16, {}, moment, None, memo)
    assert all(torch.equal(a.effective[n], b.effective[n]) for a, b in zip(again, fresh, strict=True) for n in weights)


def test_nvfp4_runs_and_the_clip_search_says_why_it_does_not(tiny_llama) -> None:
    spec = ob.preset("NVFP4A16")["weight"]
    run = run_awq(
        tiny_llama,
        spec,
        {SEARCH_OBSERVER: {}},
        ob.AWQSpec(n_grid=3),
        layers=["model.layers.0.self_attn.q_proj"],
        samples=2,
        seq_len=16,
    )
    (result,) = run.results
    assert result.row(Variant.LLM_COMPRESSOR, SEARCH_OBSERVER).error is None
    assert "integer grid" in result.row(Variant.CLIP_SEARCH, SEARCH_OBSERVER).error


# ------------------------------------------------------------------------------------ model-level effect


@pytest.fixture(scope="module")
def evaluator(tiny_llama):
    from lab.effect.evaluate import Evaluator

    return Evaluator(tiny_llama, samples=4)


@pytest.mark.parametrize("observer", ["memoryless_minmax", "mse_grid"])
@pytest.mark.parametrize("variant", [Variant.LLM_COMPRESSOR, Variant.OBSERVER_IN_SEARCH])
def test_a_variants_effect_is_the_folded_and_quantized_models(tiny_llama, suite_run, evaluator, observer, variant):
    # the lab runs the model as loaded with effective weights Q(W·s)/s; the deployed model is the
    # folded one with every balance layer quantized by the observer on its folded weight
    from lab.awq.effect import variant_weights
    from sample_models.effect import TensorQuant

    weights = variant_weights(tiny_llama, suite_run, variant, observer)
    ours = evaluator.runner.run({(n, "weight"): TensorQuant(INT4_G16, None, w) for n, w in weights.items()}).outputs
    model = copy.deepcopy(tiny_llama.module())
    model.load_state_dict(folded(tiny_llama, suite_run, variant, observer), strict=False)
    with torch.no_grad():
        for name in weights:
            layer = model.get_submodule(name)
            found = ob.run_one(observer, layer.weight.detach(), INT4_G16, "weight").qparams
            layer.weight.copy_(ob.fake_quantize(layer.weight.detach(), found, INT4_G16))
        deployed = [
            model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits for b in evaluator.runner.batches
        ]
    apart = max(float((a - b).abs().max()) for a, b in zip(ours, deployed, strict=True))
    effect = max(float((a - b).abs().max()) for a, b in zip(evaluator.runner.float_outputs, deployed, strict=True))
    # the same quantized model in two coordinate systems: apart by float rounding only
    assert apart <= 1e-4 * effect


def test_every_observer_and_variant_has_its_model_level_figures(tiny_llama, suite_run, evaluator, monkeypatch) -> None:
    from lab.awq import effect as awq_effect
    from lab.awq.effect import model_effect, variant_weights

    ran, made, pending = [], set(), []
    run_stacked, digest = evaluator.runner.run_stacked, awq_effect._digest

    def digest_and_count(quantization) -> str:  # distinct weights made and not yet run, as each pair is made
        key = digest(quantization)
        made.add(key)
        pending.append(len(made) - len(ran))
        return key

    monkeypatch.setattr(
        evaluator.runner, "run_stacked", lambda asked, **how: ran.extend(asked) or run_stacked(asked, **how)
    )
    monkeypatch.setattr(awq_effect, "STACKED_VARIANTS", 2)
    monkeypatch.setattr(awq_effect, "_digest", digest_and_count)
    effect = model_effect(tiny_llama, suite_run, evaluator)
    assert len(effect) == len(suite_run.observers) * len(Variant)
    assert (effect["kl"] > 0).all() and (effect["top1_agreement"] <= 1).all()
    # pairs that deploy the same weights run once and share their figures: min-max inside the
    # search is llm-compressor's pick
    pairs = [(o, v, variant_weights(tiny_llama, suite_run, v, o)) for o in suite_run.observers for v in Variant]
    distinct: list[dict] = []
    for _, _, weights in pairs:
        if not any(all(torch.equal(weights[n], other[n]) for n in weights) for other in distinct):
            distinct.append(weights)
    assert len(ran) == len(distinct) < len(pairs)
    assert max(pending) == 2  # the pairs' weights are made as they run: never more than two held
    minmax = effect[effect["observer"] == SEARCH_OBSERVER].set_index("variant")
    assert minmax.loc["llm-compressor", "kl"] == minmax.loc["observer-in-search", "kl"]


def test_the_model_level_effect_holds_no_more_deployed_weights_than_its_byte_bound(
    tiny_llama, suite_run, evaluator, monkeypatch
) -> None:
    # each quantization holds a block's balance layers while the block runs (0.8 GB for a 7B-wide
    # block): a byte bound below two blocks' runs them one at a time, with the same figures; the
    # weights are made as their layers run, not when the deployment is made
    from lab.awq import effect as awq_effect

    together = awq_effect.model_effect(tiny_llama, suite_run, evaluator)
    one = awq_effect.variant_weights(tiny_llama, suite_run, Variant.RTN, SEARCH_OBSERVER)
    by_block: dict[int, int] = {}
    for name, weight in one.items():
        block = evaluator.runner.block_of(name)
        by_block[block] = by_block.get(block, 0) + weight.numel() * weight.element_size()
    assert len(by_block) > 1  # the run's balance layers are in several blocks: one block's are less
    held = max(by_block.values())
    sizes, run_stacked = [], evaluator.runner.run_stacked
    monkeypatch.setattr(
        evaluator.runner, "run_stacked", lambda asked, **how: sizes.append(len(asked)) or run_stacked(asked, **how)
    )
    monkeypatch.setattr(awq_effect, "STACKED_BYTES", 2 * held - 1)
    apart = awq_effect.model_effect(tiny_llama, suite_run, evaluator)
    assert sizes and set(sizes) == {1}
    deployed = awq_effect.variant_deployment(tiny_llama, suite_run, Variant.RTN, SEARCH_OBSERVER)
    quantization = awq_effect._made_when_run(tiny_llama, suite_run, deployed)
    assert all(q.weight is None and torch.equal(q.made(), one[name]) for (name, _), q in quantization.items())
    assert apart[["observer", "variant"]].equals(together[["observer", "variant"]])
    for metric in evaluator.metric_names:
        assert torch.allclose(torch.tensor(apart[metric].values), torch.tensor(together[metric].values), rtol=1e-4)


def test_the_deployment_and_the_model_level_effect_map_their_large_blocks_for_themselves(
    tiny_llama, suite_run, evaluator, monkeypatch
) -> None:
    # their folded and quantized weights (some in float64), left in the CLI's heap that keeps freed
    # blocks, held 8 GB resident for 1.5 GB live at a 7B-wide block: every fold and every deployed
    # weight is made with large blocks mapped for themselves, and the heap's rule is back after
    import lab.allocator
    from lab.awq import deploy as awq_deploy
    from lab.awq import effect as awq_effect

    class Libc:
        calls: list[tuple[int, int]] = []

        def mallopt(self, option: int, value: int) -> int:
            self.calls.append((option, value))
            return 1

    monkeypatch.setattr(lab.allocator, "_kept_by", Libc())
    depths: dict[str, list[int]] = {"fold": [], "model_weight": []}
    for method in depths:
        real = getattr(awq_deploy.AWQDeploy, method)

        def recorded(self, *args, _real=real, _seen=depths[method], **kwargs):
            _seen.append(lab.allocator._mapped_depth)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(awq_deploy.AWQDeploy, method, recorded)
    effect = awq_effect.model_effect(tiny_llama, suite_run, evaluator, [Variant.LLM_COMPRESSOR])
    assert len(effect) == len(suite_run.observers)
    assert depths["fold"] and depths["model_weight"] and min(depths["fold"] + depths["model_weight"]) >= 1
    depths["fold"].clear()
    of_run(tiny_llama, suite_run, Variant.LLM_COMPRESSOR, {r.mapping.name: "mse_grid" for r in suite_run.results})
    assert depths["fold"] and min(depths["fold"]) == 1  # the checkpoint's deployment, outside the effect
    assert lab.allocator._mapped_depth == 0
    assert Libc.calls[-1] == (lab.allocator._M_MMAP_THRESHOLD, lab.allocator.KEPT_BYTES)


def test_twin_observers_fold_once_and_share_their_model_level_figures(
    tiny_llama, suite_run, evaluator, monkeypatch
) -> None:
    # minmax observes a weight once as memoryless_minmax does, and the search gives twins the same
    # picks (their candidates share digests): the effect folds the pair's weights once, for both
    from dataclasses import replace

    from lab.awq import effect as awq_effect

    def with_twin(found: dict) -> dict:
        return {**found, **{(v, "minmax"): p for (v, o), p in found.items() if o == SEARCH_OBSERVER}}

    results = [replace(r, scales=with_twin(r.scales), qparams=with_twin(r.qparams)) for r in suite_run.results]
    run = replace(suite_run, observers={SEARCH_OBSERVER: {}, "minmax": {}}, results=results)
    folded, real = [], awq_effect.variant_deployment
    monkeypatch.setattr(awq_effect, "variant_deployment", lambda m, r, v, o: folded.append(o) or real(m, r, v, o))
    effect = awq_effect.model_effect(tiny_llama, run, evaluator)
    assert folded == [SEARCH_OBSERVER] * len(Variant)
    figures = effect.drop(columns="observer").reset_index(drop=True)
    half = len(Variant)
    assert len(effect) == 2 * half and figures[:half].equals(figures[half:].reset_index(drop=True))
    # another observer, or the twin's rows changed on one mapping, is another deployment
    assert awq_effect._deployment(run, Variant.RTN, "mse_grid") != awq_effect._deployment(run, Variant.RTN, "minmax")
    moved = replace(run, results=[replace(results[0], qparams=with_twin(suite_run.results[1].qparams)), *results[1:]])
    assert awq_effect._deployment(moved, Variant.RTN, "minmax") != awq_effect._deployment(run, Variant.RTN, "minmax")


# ------------------------------------------------------------------------------------ AWQ then GPTQ


def test_the_smoothed_hessian_is_the_hessian_of_the_smoothed_inputs() -> None:
    from lab.awq.then_gptq import smoothed_hessian

    x = torch.randn(50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    s = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) + 0.5
    moment = x.T @ x / 50
    smoothed = x / s
    assert torch.allclose(smoothed_hessian(moment, s), (2 * smoothed.T @ smoothed / 50).float(), rtol=1e-6)
    assert torch.equal(smoothed_hessian(moment, None), (2 * moment).float())


def test_gptq_after_each_variant_is_judged_and_under_rtn_is_gptq_alone(tiny_llama) -> None:
    from lab.gptq.layer import gptq_weight

    gptq = ob.GPTQSpec()
    observers = {SEARCH_OBSERVER: {}, "mse_grid": {}}
    down = "model.layers.0.mlp.down_proj"
    awq = ob.AWQSpec(n_grid=4)
    run = run_awq(tiny_llama, INT4_G16, observers, awq, layers=[down], samples=8, seq_len=96, gptq=gptq)
    (result,) = run.results
    for row in result.rows:
        assert row.gptq_error is not None and row.gptq_error < row.mapping_error, (row.observer, row.variant)
    # down_proj is its own parent: the mapping error is its layer-output error on the block's float
    # inputs, so GPTQ alone (rtn) by hand on those inputs gives the same figure
    # and on held-out text, the same GPTQ weights (from the calibration Hessian) on held-out inputs
    from sample_models.effect import held_out_texts

    def moment_on(texts) -> torch.Tensor:
        inputs = []
        hook = tiny_llama.module().get_submodule(down).register_forward_hook(lambda m, a, o: inputs.append(a[0][0]))
        with torch.no_grad():
            for window in tiny_llama.calibration_set(texts, 8, 96).windows:
                tiny_llama.module()(input_ids=torch.tensor([list(window)]))
        hook.remove()
        x = torch.cat(inputs).double()
        return x.T @ x / x.shape[0]

    moment, held_out = moment_on(None), moment_on(list(held_out_texts()))
    weight = tiny_llama.weight(down).float()
    for observer in observers:
        qparams = result.qparams[(Variant.RTN, observer)][down]
        done = gptq_weight(weight, (2 * moment).float(), INT4_G16, gptq, observer, qparams, {})
        row = result.row(Variant.RTN, observer)
        assert row.gptq_error == pytest.approx(ob.layer_output_error(weight, done.weight, moment.float()), rel=1e-3)
        by_hand = ob.layer_output_error(weight, done.weight, held_out.float())
        assert row.gptq_held_out_error == pytest.approx(by_hand, rel=1e-3)
        assert row.gptq_held_out_error != pytest.approx(row.gptq_error, rel=1e-3)
    frame = awq_frame(run)
    assert frame["gptq_held_out_error"].notna().all() and frame["gptq_held_out_rank"].min() == 1


def test_a_mappings_input_moment_holds_the_parents_recorded_inputs_not_a_copy(tiny_llama, monkeypatch) -> None:
    # a 7B-wide block's four mappings hold 0.4 GB of recorded parent inputs on each of the calibration
    # and held-out sides: the moment's token rows (fewer tokens than columns) are views of them, and
    # the figures they give are the ones a moment of copied rows gives
    import lab.awq.run as awq_run

    seen = []

    def recorded(mapping, inputs, *args, **kwargs):
        seen.append(inputs)
        return real(mapping, inputs, *args, **kwargs)

    real = awq_run.search
    monkeypatch.setattr(awq_run, "search", recorded)
    run = run_awq(tiny_llama, INT4_G16, {SEARCH_OBSERVER: {}}, ob.AWQSpec(n_grid=3), samples=2, seq_len=16)
    assert len(seen) == len(run.results) >= 3
    for inputs in seen:
        moment = inputs.moment
        assert moment.held_as_tokens and moment.count == 32
        recorded_inputs = [args[0] if args else kwargs["hidden_states"] for args, kwargs in inputs.parent.calls]
        assert [r.untyped_storage().data_ptr() for r in moment._rows] == [
            x.untyped_storage().data_ptr() for x in recorded_inputs
        ]
        copied = InputMoment(moment.columns)
        for x in recorded_inputs:
            copied.add(x.reshape(-1, moment.columns).clone())
        weight = next(iter(inputs.balance.values())).weight.detach()
        assert moment.energy(weight) == copied.energy(weight)
        assert torch.equal(moment.diagonal(), copied.diagonal())


def test_a_padded_batchs_moment_takes_only_its_real_tokens() -> None:
    from lab.awq.inputs import _Statistics

    x = torch.randn(2, 5, 16)  # fewer tokens than columns: the moment holds its rows
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    stats = _Statistics()
    stats.add(x, valid)
    assert stats.count == 7 and stats.moment.count == 7
    assert torch.allclose(stats.moment.full(), (x[valid].double().T @ x[valid].double()) / 7)
    assert torch.equal(stats.abs_sum, x[valid].abs().sum(0))
    full = _Statistics()
    full.add(x, torch.ones(2, 5, dtype=torch.bool))
    assert full.moment._rows[0].data_ptr() == x.data_ptr()  # every token real: a view, no copy


def test_a_picks_clipped_share_is_its_metrics_clip_ratio() -> None:
    # the figure reads one mask (``clip_ratio``), not every metric over a 7B-wide layer: the same share
    torch.manual_seed(3)
    weights = {"a": torch.randn(24, 64), "b": torch.randn(8, 64) * 3}
    scales = torch.rand(64, dtype=torch.float64) + 0.5
    qparams = {}
    for name, w in weights.items():
        qp = observe("memoryless_minmax", candidates.smoothed(w, scales), INT4_G16, {})
        qparams[name] = dataclasses.replace(qp, scale=qp.scale * 0.7)
    candidate = candidates.Candidate(scales, qparams, {})
    shares = candidate.clipped(weights, INT4_G16)
    for name, w in weights.items():
        metrics = ob.quantization_metrics(candidates.smoothed(w, scales), qparams[name], INT4_G16)
        assert shares[name] == metrics["clip_ratio"] > 0
