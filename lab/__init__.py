"""Observer Lab's application layer, shared by the app and the CLI, in packages by stage:

- ``lab.calibrate``: the calibration stream, from the model's batches through the capture hooks
  into the observers (state only, a bounded sample of tokens for plots);
- ``lab.analyse``: what a run is (``RunConfig``, each tool's defaults) and ``analyse``, which
  drives the stream and the weight observers and caches their results;
- ``lab.results``: reading an analysis (the ranking rule, tables, warnings), its figures
  (``lab.results.plots``, plotly) and the HTML report;
- ``lab.export``: the files a choice becomes (Observer Lab JSON, compressed-tensors);
- ``lab.effect``: what a choice does to the model's output on held-out text;
- ``lab.scale``: whole-model sweeps, their resumable file, and torchrun ranks.

Beside them: ``vocab`` (names and defaults), ``settings`` (settings as a person gives them),
``cli`` / ``cli_args``, and the app's ``workspace`` and ``ui`` (the only streamlit import).

Calibration data comes from ``sample_models`` (records, tokenizer, batches) and stops in
``lab.calibrate``: later stages get small values (qparams, metrics, histograms), never the
tensors the hooks saw.
"""
