"""The lab's NVFP4 checkpoints of a decoder against llm-compressor 0.14's ``oneshot`` (issue 39): fused
layers (q/k/v, gate/up) share one global scale, as llm-compressor's linked observers make them.

tiny-llama (the built-in decoder, written out as a directory; its 28 decoder Linears) quantized by
both with ``memoryless_minmax`` weights:

- NVFP4A16, the lab's ``run --preset NVFP4A16 --checkpoint`` against ``oneshot`` with
  ``QuantizationModifier(scheme="NVFP4A16")``, and against ``oneshot`` running the recipe the lab
  wrote beside its checkpoint;
- NVFP4 with static input global scales on the lab's built-in calibration text (``static_minmax``
  inputs, the preset's; the lab's ``minmax``), the same token ids handed to ``oneshot`` one unpadded
  record a batch;
- GPTQ on NVFP4A16 weights (the modifier's defaults: block 128, dampening 0.01, static activation
  order, scales fixed before the sweep), every block calibrated on the float model's outputs
  (``propagate_error=False``; the lab without ``--propagate``), where both sides' Hessians are
  the same up to summation order.

Both checkpoints are read by one reader (the FP4 codes from ``weight_packed``, with ``-0`` read as
``+0``: llm-compressor writes a negative weight rounded to zero as ``-0``, the lab as ``+0``; both
decode to 0). Per layer: global scales equal, block scales equal (bit for bit), the share of equal
FP4 codes, and the input global scales where there are inputs; the q/k/v and gate/up groups must
each hold one global scale. Without GPTQ the codes must be equal everywhere; under GPTQ the row
gives each layer's share (its rounding cascades along each row from any float difference).

    python -m bench --only fused_oneshot
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import case, reference

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, SEQ_LEN = 32, 128
LAYERS = r"re:model\.layers\.\d+\..*"
REFERENCE = "llm-compressor 0.14 oneshot"


def write_model(name: str, directory: Path) -> Path:
    """The built-in decoder ``name`` saved as a Hugging Face directory (weights, config, tokenizer)."""
    from sample_models import open_model

    model = open_model(name)
    model.module().save_pretrained(str(directory))
    model.tokenizer().save_pretrained(str(directory))
    return directory


def calibration_batches(directory: Path) -> list[dict[str, torch.Tensor]]:
    """The lab's built-in calibration windows for ``directory``'s model as ``oneshot``'s batches:
    one unpadded record each, in the lab's order."""
    from sample_models import open_model

    windows = open_model(str(directory)).calibration_set(None, SAMPLES, SEQ_LEN).windows
    ids = [torch.tensor([window]) for window in windows]
    return [{"input_ids": tokens, "attention_mask": torch.ones_like(tokens)} for tokens in ids]


def lab_cli(directory: Path, out: Path, *flags: str, layers: str = LAYERS) -> tuple[float, str]:
    """The lab's CLI on ``directory`` writing ``out/lab`` (checkpoint) and ``out/recipe.yaml``: its
    wall seconds and "" or why it failed."""
    command = [sys.executable, "-m", "observers", "run", str(directory), "--layers", layers, *flags]
    command += ["--samples", str(SAMPLES), "--seq-len", str(SEQ_LEN), "--batch-size", "1", "--quiet"]
    command += ["--out", str(out / "lab.json"), "--checkpoint", str(out / "lab"), "--recipe", str(out / "recipe.yaml")]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        tail = " / ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:])
        return seconds, f"lab CLI failed (exit {done.returncode}): {tail[-300:]}"
    return seconds, ""


def oneshot_checkpoint(
    directory: Path, recipe: object, out: Path, batches: list | None = None, propagate: bool = True
) -> float:
    """``oneshot`` on ``directory``'s model with ``recipe`` (a modifier or the lab's recipe file),
    saved compressed to ``out``: its wall seconds from loading the model to the saved checkpoint."""
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    options = {}
    if batches is not None:
        options = {"dataset": DataLoader(batches, batch_size=None), "pipeline": "sequential"}
        options |= {"sequential_targets": ["LlamaDecoderLayer"], "propagate_error": propagate}
    oneshot(model=model, recipe=recipe if not isinstance(recipe, Path) else str(recipe), **options)
    model.save_pretrained(str(out), save_compressed=True)
    return time.perf_counter() - start


def read_nvfp4(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every NVFP4 layer of a compressed-tensors checkpoint: its FP4 codes (``-0`` read as ``+0``),
    block scales, global scale and input global scale (when there is one)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(path))
    layers = {}
    for key in (k for k in tensors if k.endswith(".weight_packed")):
        name = key.removesuffix(".weight_packed")
        rows, columns = tensors[key].shape[0], 2 * tensors[key].shape[1]  # two FP4 codes a byte
        codes = unpack_fp4_from_uint8(tensors[key], rows, columns, dtype=torch.float32)
        found = {"codes": codes + 0.0, "scale": tensors[f"{name}.weight_scale"].float()}  # + 0.0: -0 -> +0
        found["global_scale"] = tensors[f"{name}.weight_global_scale"].float()
        if f"{name}.input_global_scale" in tensors:
            found["input_global_scale"] = tensors[f"{name}.input_global_scale"].float()
        layers[name] = found
    return layers


def agreement(ours: dict, theirs: dict, codes_exact: bool = True) -> str:
    """The verdict on the weights: every layer the lab packs has llm-compressor's global and block
    scales bit for bit, its FP4 codes (all equal when ``codes_exact``, else each layer's share), and
    one global scale per fused group; then the input global scales, naming the layers that differ."""
    missing = sorted(set(ours) - set(theirs))
    if missing or not ours:
        return f"FAIL: layers the reference did not pack: {', '.join(missing[:4]) or 'none packed'}"
    scales = sum(torch.equal(ours[n]["scale"], theirs[n]["scale"]) for n in ours)
    globals_ = sum(torch.equal(ours[n]["global_scale"], theirs[n]["global_scale"]) for n in ours)
    shares = {n: float((ours[n]["codes"] == theirs[n]["codes"]).double().mean()) for n in ours}
    least = min(shares, key=shares.get)
    fused = _groups_share(ours) and _groups_share(theirs)
    passed = scales == globals_ == len(ours) and fused and (not codes_exact or shares[least] == 1.0)
    text = f"{'PASS' if passed else 'FAIL'}: {len(ours)} layers; global scales equal {globals_}/{len(ours)}, "
    text += f"block scales equal {scales}/{len(ours)}; FP4 codes equal {sum(s == 1.0 for s in shares.values())}"
    text += f"/{len(ours)} layers (least {shares[least]:.4%} at {least}); q/k/v and gate/up share one global "
    text += f"scale each: {'yes' if fused else 'NO'}"
    inputs = [n for n in ours if "input_global_scale" in ours[n]]
    if inputs:
        differ = [
            n for n in inputs if not torch.equal(ours[n]["input_global_scale"], theirs[n].get("input_global_scale"))
        ]
        text += f"; input global scales equal {len(inputs) - len(differ)}/{len(inputs)}"
        if differ:
            kinds = sorted({n.rpartition(".")[2] for n in differ})
            text += f" (differ: every {', '.join(kinds)}: {len(differ)} layers)"
    return text


def _groups_share(layers: dict) -> bool:
    from lab.runtime.fusion import Level, fused_groups

    return all(
        all(torch.equal(layers[m]["global_scale"], layers[members[0]]["global_scale"]) for m in members)
        for _, members in fused_groups(sorted(layers), Level.LINEAR)
    )


def cases(device: str) -> list[dict]:
    missing = [found for found in map(reference, ("llmcompressor", "compressed_tensors")) if isinstance(found, str)]
    label = "NVFP4 checkpoint of tiny-llama (28 decoder Linears) vs llm-compressor oneshot"
    if missing:
        return [case(label, 0.0, agreement="; ".join(missing))]
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fused-") as scratch:
        model_dir = write_model("tiny-llama", Path(scratch) / "tiny-llama")
        batches = calibration_batches(model_dir)
        runs = {
            "NVFP4A16, memoryless_minmax": (
                ("--preset", "NVFP4A16", "--kinds", "weight", "--observers", "memoryless_minmax"),
                partial(QuantizationModifier, targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]),
                None,
            ),
            f"NVFP4, static input global scales on {len(batches)}x{SEQ_LEN} tokens": (
                ("--preset", "NVFP4", "--kinds", "weight,input", "--observers", "minmax", "--choose", "*=minmax"),
                partial(QuantizationModifier, targets="Linear", scheme="NVFP4", ignore=["lm_head"]),
                batches,
            ),
            "GPTQ NVFP4A16, every block on float inputs": (
                ("--preset", "NVFP4A16", "--kinds", "weight", "--observers", "memoryless_minmax", "--gptq"),
                partial(GPTQModifier, targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]),
                batches,
            ),
        }
        for name, (flags, modifier, data) in runs.items():
            work = Path(scratch) / name.split(",")[0].replace(" ", "_")
            work.mkdir()
            lab_s, failure = lab_cli(model_dir, work, *flags)
            if failure:
                rows.append(case(f"{label}, {name}", lab_s, 0.0, REFERENCE, agreement=failure))
                continue
            gptq = "GPTQ" in name
            theirs_s = oneshot_checkpoint(model_dir, modifier(), work / "oneshot", data, propagate=False)
            theirs = read_nvfp4(work / "oneshot")
            text = agreement(read_nvfp4(work / "lab"), theirs, codes_exact=not gptq)
            if gptq:  # GPTQ's own chaos: llm-compressor against itself, the batches reversed
                oneshot_checkpoint(model_dir, modifier(), work / "reversed", data[::-1], propagate=False)
                itself = {
                    n: float((theirs[n]["codes"] == found["codes"]).double().mean())
                    for n, found in read_nvfp4(work / "reversed").items()
                }
                text += "; llm-compressor against itself, batches reversed: FP4 codes equal in "
                text += (
                    f"{sum(v == 1.0 for v in itself.values())}/{len(itself)} layers (least {min(itself.values()):.4%})"
                )
            else:  # the recipe the lab wrote beside its checkpoint reproduces it
                oneshot_checkpoint(model_dir, work / "recipe.yaml", work / "recipe", data, propagate=False)
                text += f"; the lab's recipe: {agreement(read_nvfp4(work / 'lab'), read_nvfp4(work / 'recipe'))}"
            reference_name = f"{REFERENCE} {modifier.func.__name__}(scheme={json.dumps(modifier.keywords['scheme'])})"
            rows.append(case(f"{label}, {name}", lab_s, theirs_s, reference_name, agreement=text))
        rows.append(_moe_row(Path(scratch), QuantizationModifier))
    rows.append(_serving_cost())
    return rows


def _serving_cost() -> dict:
    """What serving a run costs: ``analyse`` of tiny-llama's 28 decoder Linears under NVFP4A16 with
    every default weight observer, as served (fused groups' shared global scales, the searches
    run again under them, every served figure) against the same run with each layer alone
    (``lab.analyse.pipeline.serve`` off), in this process, interleaved."""
    import observers as ob
    from bench.common import interleaved_medians
    from lab.analyse import pipeline
    from lab.analyse.run_config import RunConfig
    from sample_models import open_model

    model = open_model("tiny-llama")
    layers = [info.name for info in model.layers() if info.name.startswith("model.layers.")]
    config = RunConfig({"weight": ob.preset("NVFP4A16")["weight"]}, samples=SAMPLES, seq_len=SEQ_LEN)
    served = pipeline.serve

    def alone() -> None:
        pipeline.serve = lambda *args, **kwargs: None
        try:
            pipeline.analyse(model, layers, config)
        finally:
            pipeline.serve = served

    times = interleaved_medians({"served": lambda: pipeline.analyse(model, layers, config), "alone": alone})
    label = "serving cost: analyse tiny-llama's 28 decoder Linears, NVFP4A16, every default weight observer"
    note = "reference: the same run with each layer alone (no shared global scales, no served figures)"
    return case(label, times["served"], times["alone"], "the lab, each layer alone", agreement=note)


def _moe_row(scratch: Path, modifier_class: type) -> dict:
    """tiny-moe under NVFP4A16: its attention's Linears (transformers keeps the experts as fused
    parameters, which neither side packs as Linear layers)."""
    model_dir = write_model("tiny-moe", scratch / "tiny-moe")
    work = scratch / "moe"
    work.mkdir()
    label = "NVFP4A16 checkpoint of tiny-moe's attention (8 Linears) vs llm-compressor oneshot, memoryless_minmax"
    # compared on the layers the lab packs: llm-compressor also packs the experts, which the lab's
    # checkpoint leaves dense (transformers holds them as fused parameters, not Linear layers)
    flags = ("--preset", "NVFP4A16", "--kinds", "weight", "--observers", "memoryless_minmax")
    lab_s, failure = lab_cli(model_dir, work, *flags, layers=r"re:model\.layers\.\d+\.self_attn\..*")
    if failure:
        return case(label, lab_s, 0.0, REFERENCE, agreement=failure)
    modifier = modifier_class(targets="Linear", scheme="NVFP4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    theirs_s = oneshot_checkpoint(model_dir, modifier, work / "oneshot")
    text = agreement(read_nvfp4(work / "lab"), read_nvfp4(work / "oneshot"))
    return case(label, lab_s, theirs_s, f'{REFERENCE} QuantizationModifier(scheme="NVFP4A16")', agreement=text)
