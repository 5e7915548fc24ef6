"""The words the lab uses for what it analyses, and its defaults, in one place.

The observer library speaks of observer kinds (weight, activation, attention) and strategies
(``observers.vocab``); the lab speaks of the *tensors of a layer* it captures: a layer's
``weight``, ``input`` and ``output``, and an attention block's key and value states ``k`` / ``v``
(what a KV cache holds). The app, the CLI, the pipeline and the exporters read these names from
here, so a new tensor kind or a changed default is one edit.
"""

from __future__ import annotations

from enum import StrEnum


class TensorKind(StrEnum):
    """A tensor the lab analyses: a layer's weight, input or output, an attention block's k or v."""

    WEIGHT = "weight"
    INPUT = "input"
    OUTPUT = "output"
    K = "k"
    V = "v"


LAYER_TENSORS = (TensorKind.WEIGHT, TensorKind.INPUT, TensorKind.OUTPUT)
ACTIVATION_TENSORS = (TensorKind.INPUT, TensorKind.OUTPUT)
KV_TENSORS = (TensorKind.K, TensorKind.V)
KV = "kv"
"""The spec key of key/value states: one KV-cache scheme covers both ``k`` and ``v``."""
SPEC_KEYS = (*LAYER_TENSORS, KV)

OBSERVER_KIND = {
    TensorKind.WEIGHT: "weight",
    TensorKind.INPUT: "activation",
    TensorKind.OUTPUT: "activation",
    TensorKind.K: "attention",
    TensorKind.V: "attention",
}
"""The observer kind (``observers`` vocabulary) that observes each tensor kind."""


def spec_key(tensor: str) -> str:
    """The ``RunConfig.specs`` key of a tensor kind: ``kv`` for ``k``/``v``, else the kind itself."""
    return KV if tensor in KV_TENSORS else str(tensor)


def observer_kind(tensor: str) -> str:
    """The observer kind for a tensor kind or spec key (``kv`` observes attention states)."""
    return "attention" if tensor == KV else OBSERVER_KIND[TensorKind(tensor)]


LINEAR_TYPES = ("Linear", "Conv1D", "ExpertLinear")
"""Module types the lab treats as linear layers (default selection, compressed-tensors targets)."""

DEFAULT_SAMPLES = 32
DEFAULT_SEQ_LEN = 128
DEFAULT_BATCH_SIZE = 8
SAMPLE_BYTES = 256 << 20
"""Bytes of activation tokens an analysis keeps, across all its tensors, for plots and error
metrics (the same seeded tokens for every tensor); the observers see every token regardless.
A run under a ``max_memory`` budget keeps at most a quarter of it (``RunConfig.sample_bytes``)."""
"""Calibration defaults: 32 windows of 128 tokens (about 4k tokens) for app, CLI and bench."""

FEW_TOKENS = 16
"""An activation tensor that saw fewer calibration tokens than this gets a warning."""

DEFAULT_METRIC = "sqnr_db"
"""The metric the best observer is chosen by unless a person picks another."""

MODEL_METRICS = {"kl": False, "top1_agreement": True, "perplexity": False, "cosine": True, "spearman": True}
"""Model-level metrics (what a choice does to the model's output on held-out text) and whether
higher is better: a decoder LM's next-token distributions (mean KL(float || quantized), top-1
agreement, perplexity of the quantized model), an encoder's sentence embeddings (mean cosine to
the float ones, Spearman correlation of the pairwise similarities)."""
DECODER_METRICS = ("kl", "top1_agreement", "perplexity")
ENCODER_METRICS = ("cosine", "spearman")
MODEL_METRIC_PREFIX = "model:"
"""How "choose by" names a model-level metric next to the local ones (``model:kl``): the local
``cosine`` of a tensor and the model-level ``cosine`` of sentence embeddings are different things."""


GPTQ_METRICS = {"gptq_error": False, "gptq_held_out": False, "gptq_clipped": False}
"""What a weight observer's qparams give under GPTQ (``lab.gptq``), and whether higher is better:
the relative layer-output error on the calibration inputs and on held-out inputs, the share of
updated weights that clip."""
GPTQ_METRIC_PREFIX = "gptq:"
"""How "choose by" names a GPTQ figure (``gptq:gptq_error``); tensors GPTQ does not touch
(activations, key/value states) are then chosen by ``DEFAULT_METRIC``."""


AWQ_METRICS = {
    "mapping_error": False,
    "held_out_error": False,
    "layer_error": False,
    "held_out_layer_error": False,
    "gptq_error": False,
    "gptq_held_out_error": False,
}
"""What a weight observer gives under AWQ (``lab.awq``), per mapping and variant, and whether higher
is better: the parent's relative output error on calibration and held-out tokens, the balance
layers' mean relative output error on both, and (a run with GPTQ) the parent's error once GPTQ follows, on
calibration and held-out tokens."""
AWQ_METRIC_PREFIX = "awq:"
"""How "choose by" names an AWQ figure (``awq:mapping_error``): it chooses each mapping's observer
under the deployed variant (``lab.awq.deploy``); the analysis's own tensors, which carry no AWQ
figures, are then chosen by ``DEFAULT_METRIC``."""


PER_LAYER_PREFIX = "per-layer:"
"""How "choose by" names a local metric with each layer's own scales (``per-layer:sqnr_db``) instead of
the figures as served, where a fusing server (vLLM, SGLang) shares a fused group's scales: for
runtimes that run each layer alone (transformers' own forward). It ranks; it never changes what a
checkpoint holds, which is always what a fusing server loads correctly."""


def model_metric(name: str) -> str:
    """The "choose by" key of a model-level metric: ``kl`` -> ``model:kl``."""
    return MODEL_METRIC_PREFIX + name


GLOBAL_SCALE_CONVENTION = (
    "compressed-tensors: element step = scale / global_scale, global_scale = 448 * 6 / amax of the tensor; "
    "ModelOpt stores the inverse, amax / (448 * 6), as weight_scale_2"
)
"""How every export's NVFP4 ``global_scale`` is to be read: the tools store it inversely to each other."""
