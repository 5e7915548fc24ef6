"""Model-level effect: what a set of choices does to the model's output on held-out text
(evaluation, per-layer sensitivity); its text never comes from the calibration set."""
