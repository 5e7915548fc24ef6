"""The lab's AWQ (issue 41) against llm-compressor 0.14's ``oneshot`` with ``AWQModifier`` (defaults:
``n_grid`` 20, duo scaling) and ``QuantizationModifier`` (int4 symmetric in groups of 16,
``memoryless_minmax``, every decoder Linear) on tiny-llama written as a directory, the same token
ids (the lab's built-in calibration windows, 32 × 128, one unpadded record a batch, the sequential
pipeline per ``LlamaDecoderLayer``), and ModelOpt 0.47's ``awq_lite`` and ``awq_clip`` on the same
layers.

- **llm-compressor's variant**: the lab's deployment of its ``llm-compressor`` variant
  (``lab.awq.deploy``: the scales folded into the weights, ``memoryless_minmax`` on the final
  smoothed weights) against oneshot of the lab's own recipe for it (``AWQModifier`` with the
  run's exact mappings, then ``QuantizationModifier``): the smoothed norms and balance weights,
  and the int4 codes of every balance layer against oneshot's ``weight_scale``. The lab's
  calibration computes attention eagerly, as oneshot's calibration does, and the two agree to the
  bit. Symmetric int4 with llm-compressor's half-range scale puts each group's negative extreme
  exactly on a rounding tie (``-7.5`` steps), so a candidate's loss moves by a percent when the
  activations move by one float32 ulp, and a mapping whose grid losses are close then picks
  another point: the row shows llm-compressor against itself with the calibration batches in
  reverse order (the same statistics up to summation order) beside it.
- **Speed**: the lab's CLI (``run --awq``, every default int4 weight observer, the four variants,
  held-out figures, and the run's own analysis) against a fresh process running oneshot with one
  observer, imports and loading included on both sides.
- **Clip search's pick**: ``ob.awq.clip_picks`` (the ``group_clip`` kernel) against its eager path
  (``kernels.disabled()``) on 20 gate/up-sized candidates (688 × 256, int4 groups of 16, eleven
  ratios, each candidate's own Hessian blocks): what one ``clip-search`` pass of a mapping costs.
- **ModelOpt**: ``mtq.quantize`` with ``awq_lite`` (``alpha_step`` 0.1) and with ``awq_full``
  (``awq_lite`` then ``awq_clip``, clip ratios 0.5–0.95 by 0.05) on int4 groups of 16 of every
  decoder Linear; each layer's relative output error on the calibration inputs beside the lab's
  ``observer-in-search`` and ``clip-search`` rows for min-max.

    .bench-venv/bin/python -m bench --only awq_oneshot
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_fused_oneshot import calibration_batches, write_model
from bench.common import Ref, activation_batches, case, llm_weight, measure, reference

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, SEQ_LEN, GROUP = 32, 128, 16
REFERENCE = "llm-compressor 0.14 oneshot AWQModifier + QuantizationModifier"
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}

# A fresh process: oneshot on the model directory argv[1] with the batches saved in argv[2] and the lab's
# recipe argv[4] (AWQModifier with the run's exact mappings, then QuantizationModifier), saving the smoothed
# state dict (weights and weight scales) to argv[3]. Tensor.pin_memory is a no-op: llm-compressor 0.14 pins
# the AWQ caches unconditionally, which fails without an accelerator.
ONESHOT = """
import sys, torch
torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
from llmcompressor import oneshot
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
batches = torch.load(sys.argv[2], weights_only=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
oneshot(model=model, recipe=sys.argv[4], dataset=DataLoader(batches, batch_size=None), pipeline="sequential",
        sequential_targets=["LlamaDecoderLayer"])
state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if "layers." in k}
save_file(state, sys.argv[3])
"""


def oneshot_process(
    model_dir: Path, batches: list, recipe: Path, scratch: Path, tag: str
) -> tuple[float, dict[str, torch.Tensor]]:
    """oneshot of ``recipe`` in a fresh process: its wall seconds and the smoothed state dict it left."""
    from safetensors.torch import load_file

    data, target = scratch / f"{tag}-batches.pt", scratch / f"{tag}.safetensors"
    torch.save(batches, data)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", ONESHOT, str(model_dir), str(data), str(target), str(recipe)],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"oneshot failed: {done.stderr.strip().splitlines()[-1][-300:]}")
    return seconds, load_file(str(target))


def lab_process(model_dir: Path, scratch: Path) -> tuple[float, str]:
    """The lab's CLI with every default int4 weight observer and ``--awq``: wall seconds, "" or why it failed."""
    command = [sys.executable, "-m", "observers", "run", str(model_dir), "--layers", r"re:model\.layers\.\d+\..*"]
    command += ["--kinds", "weight", "--format", "int4", "--strategy", "group", "--group-size", str(GROUP)]
    command += ["--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN), "--batch-size", "1", "--awq", "--quiet"]
    command += ["--out", str(scratch / "lab.json")]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, "" if done.returncode == 0 else f"lab CLI failed: {done.stderr.strip()[-300:]}"


def lab_variant(model_dir: Path, scratch: Path, device: str = "cpu") -> tuple:
    """The lab's ``llm-compressor`` variant on ``model_dir`` (``run_awq`` with ``memoryless_minmax``,
    then its deployment): the run, the smoothed tensors it folds, each balance layer's int4 codes,
    and the recipe file that reproduces it in ``oneshot`` (written under ``scratch``)."""
    import observers as ob
    from lab.analyse.model_facts import ModelFacts
    from lab.awq.deploy import of_run
    from lab.awq.run import run_awq
    from lab.awq.search import SEARCH_OBSERVER, Variant
    from lab.export import recipe
    from lab.export.chosen import Chosen
    from sample_models import open_model

    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=GROUP, symmetric=True)
    model = open_model(str(model_dir), device=device)
    run = run_awq(model, spec, {SEARCH_OBSERVER: {}}, samples=SAMPLES, seq_len=SEQ_LEN, batch_size=1)
    deployed = of_run(model, run, Variant.LLM_COMPRESSOR, {r.mapping.name: SEARCH_OBSERVER for r in run.results})
    stored = set(model.stored_keys())
    ours = {k: deployed.fold(k, model.stored(k)).float().cpu() for k in deployed.touched() if k in stored}
    codes = {
        layer: ob.quantize(ours[f"{layer}.weight"], qparams, spec).float().reshape(ours[f"{layer}.weight"].shape)
        for layer, qparams in deployed.qparams.items()
    }
    linears = [i.name for i in model.layers() if i.type == "Linear" and ".layers." in i.name]
    recipe_file = scratch / "recipe.yaml"
    chosen = [Chosen(name, "weight", spec, SEARCH_OBSERVER) for name in linears]
    recipe.of_chosen(chosen, ModelFacts.of(model), awq=deployed).write(recipe_file)
    return run, ours, codes, recipe_file


def codes_of(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 codes of ``weight`` under per-group ``scale`` (compressed-tensors' rounding)."""
    grouped = weight.reshape(weight.shape[0], -1, GROUP) / scale.unsqueeze(-1)
    return torch.clamp(torch.round(grouped), -8, 7).reshape(weight.shape)


def compare(ours: dict[str, torch.Tensor], ours_codes: dict, theirs: dict[str, torch.Tensor]) -> dict:
    """Smoothed tensors within fp32 rounding (1e-6 relative), and each layer's share of equal codes."""
    close = [k for k, t in ours.items() if float((t - theirs[k]).abs().max()) <= 1e-6 * float(theirs[k].abs().max())]
    shares = {}
    for layer, codes in ours_codes.items():
        theirs_codes = codes_of(theirs[f"{layer}.weight"], theirs[f"{layer}.weight_scale"])
        shares[layer] = float((codes == theirs_codes).double().mean())
    return {"close": len(close), "tensors": len(ours), "shares": shares}


def _share_text(found: dict) -> str:
    shares = found["shares"].values()
    full = sum(s >= 0.999 for s in shares)
    close = f"smoothed tensors within fp32 rounding {found['close']}/{found['tensors']}"
    return f"{close}; codes >= 99.9% in {full}/{len(shares)} layers (least {min(shares):.2%})"


def clip_pick_rows(device: str) -> list[dict]:
    """The clip search's pick on 20 candidates of a 688 x 256 weight: native kernel against eager."""
    import observers as ob
    from observers import kernels

    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=GROUP, symmetric=True)
    weights = torch.stack([llm_weight(688, 256, device, seed=seed) for seed in range(20)])
    observer = ob.create("memoryless_minmax", spec, "weight")
    observer.observe(weights.reshape(-1, 256))
    ranges = ob.awq.shrunk(observer.qparams(), spec, ob.AWQSpec().clip_ratios())
    x = activation_batches(1, 1024, 256, device)[0]
    moment = (x.T @ x / x.shape[0]).reshape(16, GROUP, 16, GROUP).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    blocks = moment.unsqueeze(0).expand(20, -1, -1, -1).contiguous()

    def ours() -> torch.Tensor:
        return ob.awq.clip_picks(weights, ranges, blocks, spec)

    def eager() -> torch.Tensor:
        with kernels.disabled():
            return ours()

    def agree(mine: torch.Tensor, theirs: torch.Tensor) -> str:
        return f"{float((mine == theirs).double().mean()):.4%} of the groups' picks equal"

    name = "AWQ clip search's pick, 20 candidates 688x256 int4 g16, 11 ratios"
    return measure(name, ours, weights.sum, device, [Ref("ours, eager path (kernels.disabled())", eager, agree)])


def cases(device: str) -> list[dict]:
    rows = clip_pick_rows(device)
    missing = [found for found in map(reference, ("llmcompressor", "compressed_tensors")) if isinstance(found, str)]
    label = "AWQ of tiny-llama (int4 g16, memoryless_minmax) vs llm-compressor oneshot"
    if missing:
        return [*rows, case(label, 0.0, agreement="; ".join(missing))]
    with tempfile.TemporaryDirectory(prefix="bench-awq-") as scratch_name:
        scratch = Path(scratch_name)
        model_dir = write_model("tiny-llama", scratch / "tiny-llama")
        batches = calibration_batches(model_dir)
        start = time.perf_counter()
        run, ours, ours_codes, recipe_file = lab_variant(model_dir, scratch, device)
        lab_s = time.perf_counter() - start
        theirs_s, theirs = oneshot_process(model_dir, batches, recipe_file, scratch, "oneshot")
        _, itself = oneshot_process(model_dir, batches[::-1], recipe_file, scratch, "reversed")
        against = compare(ours, ours_codes, theirs)
        mirror = compare(
            {k: itself[k] for k in ours},
            {n: codes_of(itself[f"{n}.weight"], itself[f"{n}.weight_scale"]) for n in ours_codes},
            theirs,
        )
        text = f"lab: {_share_text(against)}; llm-compressor against itself, batches reversed: {_share_text(mirror)}"
        rows.append(
            case(f"{label}: llm-compressor's variant, smoothing and codes", lab_s, theirs_s, REFERENCE, agreement=text)
        )
        cli_s, failure = lab_process(model_dir, scratch)
        ratio = f"lab CLI with every default weight observer, four variants and held-out: {cli_s / theirs_s:.2f}x "
        ratio += "oneshot's process with one observer"
        rows.append(
            case(
                f"{label}: speed, every default observer (7)",
                cli_s,
                theirs_s,
                f"{REFERENCE} (fresh process)",
                agreement=failure or ratio,
            )
        )
        rows.append(_modelopt_row(model_dir, batches, run))
    return rows


MODELOPT = "ModelOpt 0.47 mtq.quantize, INT4_AWQ_CFG with blocks of 16"


def _modelopt_row(model_dir: Path, batches: list, run) -> dict:
    """ModelOpt's ``awq_lite`` and ``awq_full`` (lite, then ``awq_clip``) on tiny-llama's decoder
    Linears in int4 blocks of 16: each layer's relative output error on the calibration inputs,
    averaged, beside the lab's min-max ``observer-in-search`` and ``clip-search`` (a single-observer
    run of the lab has only ``memoryless_minmax``: its rows are min-max's)."""
    found = reference("modelopt.torch.quantization")
    label = "AWQ of tiny-llama: ModelOpt awq_lite / awq_full against the lab's observer-in-search / clip-search"
    if isinstance(found, str):
        return case(label, 0.0, agreement=found)
    from lab.awq.search import SEARCH_OBSERVER, Variant

    lab = {variant: [] for variant in (Variant.OBSERVER_IN_SEARCH, Variant.CLIP_SEARCH)}
    for result in run.results:
        for variant, errors in lab.items():
            errors += list(result.row(variant, SEARCH_OBSERVER).layer_errors.values())
    theirs, seconds = {}, {}
    for method in ("awq_lite", "awq_full"):
        start = time.perf_counter()
        theirs[method] = _modelopt_errors(found, model_dir, batches, method)
        seconds[method] = time.perf_counter() - start
    mean = {k: sum(v) / len(v) for k, v in (lab | theirs).items()}
    text = (
        "mean relative layer-output error over the balanced layers: lab observer-in-search "
        f"{mean[Variant.OBSERVER_IN_SEARCH]:.4g}, ModelOpt awq_lite {mean['awq_lite']:.4g}; "
        f"lab clip-search {mean[Variant.CLIP_SEARCH]:.4g}, "
        f"ModelOpt awq_full (lite + clip) {mean['awq_full']:.4g}; ModelOpt judges each Linear's own output "
        "with alpha steps of 0.1 and its int4 step is amax/7 (llm-compressor's amax/7.5)"
    )
    return case(label, seconds["awq_full"], reference=MODELOPT, agreement=text)


def _modelopt_errors(mtq, model_dir: Path, batches: list, method: str) -> list[float]:
    """Each balanced decoder Linear's ``Σ‖ŷ − y‖² / Σ‖y‖²`` on its float calibration inputs after
    ModelOpt's ``method``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    names = [n for n in names if not n.endswith("o_proj")]  # tiny-llama's v -> o is no mapping (GQA widths)
    inputs: dict[str, list] = {n: [] for n in names}
    hooks = [model.get_submodule(n).register_forward_hook(_keep(inputs[n])) for n in names]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for hook in hooks:
        hook.remove()
    floats = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    config = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"] = {-1: GROUP, "type": "static"}
    config["algorithm"] = {"method": method, "alpha_step": 0.1} if method == "awq_lite" else {"method": method}

    def forward_loop(m) -> None:
        with torch.no_grad():
            for batch in batches:
                m(**batch)

    mtq.quantize(model, config, forward_loop)
    errors = []
    with torch.no_grad():
        for name in names:
            module = model.get_submodule(name)
            error = energy = 0.0
            for x in inputs[name]:
                y = torch.nn.functional.linear(x, floats[name])
                error += float((module(x) - y).double().square().sum())
                energy += float(y.double().square().sum())
            errors.append(error / energy)
    return errors


def _keep(into: list):
    def hook(module, args, output):
        into.append(args[0].detach().clone())

    return hook
