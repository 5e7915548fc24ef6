"""GPTQ as a stage of a run (issue 33): each weight observer's qparams put through GPTQ on its layer
(``observers.gptq``), beside round-to-nearest with the same qparams, so the ranking says what a GPTQ
model gets. ``layer`` computes a layer's rows while its weight is in hand (the pipeline hands it the
weight and the Hessian of the layer's inputs, streamed with the calibration statistics, and the
held-out Hessian ``held_out`` measures); ``table`` reads them back from an analysis. What leaves
the stage: errors and clipped shares, and each layer's Hessian (``TensorAnalysis.hessian``; kept
beside the JSON by ``hessians``), from which ``deploy`` and ``layer.gptq_weight`` make a chosen
observer's GPTQ weight again for the checkpoint, propagation and the model-level effect.
"""
