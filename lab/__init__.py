"""Observer Lab's application layer: the analysis pipeline shared by the app and the CLI,
plotting helpers, and exports. UI-free except ``lab.plots`` (plotly)."""
