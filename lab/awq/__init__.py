"""AWQ as a stage (issue 41): each weight observer under llm-compressor's activation-aware scale
search, four ways side by side (``search.Variant``). ``mappings`` finds where a decoder smooths,
``experts`` turns fused MoE experts into linear layers in the block copies, ``candidates`` makes
each way's candidates (smoothed, observed, clip-searched), ``parent`` judges them on the parent
module's output (many in one replay), ``search`` runs one mapping's four ways for every observer,
``run`` walks the blocks as llm-compressor's sequential pipeline does, ``fold`` folds scales into
stored tensors, ``deploy`` is what a checkpoint holds (one variant, one observer per mapping, the
qparams on the folded weights), ``effect`` measures each variant's deployed model on held-out
text, ``table`` reads a run back, ``options`` and ``command`` are ``run --awq``, ``session`` the
app's Run, Error and Ranges pages. What leaves the stage: per mapping and observer small rows
(errors, clipped shares, the winning strength), the scales and qparams each way smooths with, and
the deployment.
"""
