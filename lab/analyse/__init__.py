"""Analysis: what a run is (``RunConfig``, the tools' defaults), what it produced (``Analysis``),
``analyse`` (calibration, then the weight observers as each layer's block is done), the result
cache and the facts of the model an analysis came from."""
