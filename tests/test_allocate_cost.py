"""The cost of a scheme (issue 34, ``lab.scheme.cost``): what the packed checkpoint stores for a
layer's weight and its scales, checked against the bytes of checkpoints the lab writes, for every
preset and for settings the checkpoint leaves dense."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

import observers as ob
from lab.analyse.pipeline import analyse
from lab.analyse.run_config import RunConfig
from lab.export import checkpoint, lab_json
from lab.scheme.cost import bits_per_weight, weight_bytes
from sample_models import open_model

LAYERS = ("encoder.layer.0.intermediate.dense", "encoder.layer.0.output.dense")
EXTRA = {
    "int8 group 64": {"weight": ob.QuantSpec("int8", strategy="group", group_size=64)},
    "int4 channel": {"weight": ob.QuantSpec("int4", strategy="channel")},
    "int4 asymmetric g128 (dense), fp8 input": {
        "weight": ob.QuantSpec("int4", strategy="group", group_size=128, symmetric=False),
        "input": ob.QuantSpec("fp8_e4m3"),
    },
}


@pytest.fixture(scope="module")
def minilm():
    return open_model("minilm")


def _schemes() -> dict[str, dict[str, ob.QuantSpec]]:
    presets = {name: {k: v for k, v in ob.preset(name).items() if v is not None} for name in ob.PRESET_NAMES}
    return presets | EXTRA


def _stored_bytes(directory: Path, layer: str) -> int:
    """Bytes of the layer's tensors in the written checkpoint, its bias aside."""
    total = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                if key.startswith(f"{layer}.") and key != f"{layer}.bias":
                    tensor = handle.get_tensor(key)
                    total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("name", list(_schemes()))
def test_the_cost_is_what_the_written_checkpoint_stores(minilm, tmp_path, name):
    specs = _schemes()[name]
    analysis = analyse(minilm, list(LAYERS), RunConfig(specs=specs, observers=("minmax",), samples=4, seq_len=32))
    chosen = {key: "minmax" for key in analysis.keys()}
    lab_file = lab_json.parse_document(lab_json.build_document(analysis, chosen))
    checkpoint.write(lab_file, minilm, tmp_path / "out")
    for layer in LAYERS:
        shape = tuple(minilm.weight(layer).shape)
        expected = weight_bytes(specs["weight"], shape, 4, "Linear", specs.get("input"))
        assert expected == _stored_bytes(tmp_path / "out", layer), (name, layer)


def test_bits_per_weight_say_each_schemes_figure():
    shape = (4096, 4096)
    assert bits_per_weight(ob.preset("NVFP4")["weight"], shape, 2) == pytest.approx(4.5, abs=1e-5)
    assert bits_per_weight(ob.preset("W4A16")["weight"], shape, 2) == pytest.approx(4.25, abs=1e-5)
    assert bits_per_weight(ob.preset("MXFP4")["weight"], shape, 2) == pytest.approx(4.25, abs=1e-5)
    assert bits_per_weight(ob.preset("FP8")["weight"], shape, 2) == pytest.approx(8.0, abs=1e-5)
    assert bits_per_weight(None, shape, 2) == 16
    assert weight_bytes(ob.preset("W4A16")["weight"], (10, 20), 2, "Embedding") == 10 * 20 * 2  # not Linear: dense
