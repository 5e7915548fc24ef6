"""Calibration: the model's batches streamed through the capture hooks into every chosen
observer, block by block; what leaves this package is each tensor's results, its shape, the input
statistics the weight observers take and a bounded sample of tokens, never a captured tensor."""
