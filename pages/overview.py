"""Overview: a layers × observers heatmap of one metric, so a whole model is scanned at a glance;
before any run, a one-click demo on the default sample."""

import streamlit as st

from lab import results, ui
from lab.results import plots
from lab.settings import default_layer_names

st.title("Overview")
ws = ui.workspace()
if ws.analysis is None:
    st.markdown(
        "**Observer Lab** helps you pick **how** each layer's quantization ranges are set:\n"
        "run every observer on it and compare what each one does.\n\n"
        "1. **Model**: open a model (the MiniLM sample is preselected) and pick layers.\n"
        "2. **Run**: choose a format and the observers, then press Run.\n"
        "3. **Ranges**, **Scales**, **Error**: compare the observers layer by layer.\n"
        "4. **Choose & export**: keep the best observer per layer and export the result."
    )
    st.subheader("See it in one click")
    st.caption(
        "The demo runs every observer on MiniLM's first 6 linear layers (a real pretrained encoder, offline): "
        "weights as int4 in groups of 128, input activations as int8 per tensor, calibrated on the built-in text."
    )
    if st.button("Run the demo", type="primary", icon=":material/play_arrow:"):
        with ui.guard("The demo run"):
            model = ui.open_shared_model("minilm", "auto", "fp32")
            ws.start_demo(default_layer_names(model.layers()))
            ui.reseed_all()
            ui.run_with_status(ws, model, ws.settings.config())
            st.rerun()
    st.page_link("pages/model.py", label="Go to Model to choose your own", icon=":material/deployed_code:")
    st.stop()

analysis = ui.require_analysis(ws)
metric = ui.metric_select("Metric", ws)
frame = results.error_table(analysis)
how = f" ({ui.run_summary(ws.last_run)})" if ws.last_run is not None and ws.last_run.analysis is analysis else ""
st.caption(
    f"{analysis.facts.name}: {len(analysis.entries)} tensors × "
    f"{len(analysis.config.observer_names)} observers, computed in {analysis.seconds:.1f} s{how}. "
    + ui.plain(ws.calibration_line(analysis) or "")
)
with ui.guard("Drawing the overview"):
    st.plotly_chart(plots.metric_heatmap(frame, metric), theme="streamlit")
for note in results.token_warnings(analysis):
    st.warning(note)
