"""Scale: whole-model sweeps written as they go and resumable, and several torchrun ranks
splitting the layers or the calibration batches."""
