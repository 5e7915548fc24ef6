"""Overview: a layers × observers heatmap of one metric, so a whole model is scanned at a glance."""

import streamlit as st

from lab import plots, ui

st.title("Overview")
analysis = ui.current_analysis()
if analysis is None:
    st.markdown(
        "**Observer Lab** helps you pick **how** each layer's quantization ranges are set:\n"
        "run every observer on it and compare what each one does.\n\n"
        "1. **Model**: open a model (the MiniLM sample is preselected) and pick layers.\n"
        "2. **Run**: choose a format and the observers, then press Run.\n"
        "3. **Ranges**, **Scales**, **Error**: compare the observers layer by layer.\n"
        "4. **Choose & export**: keep the best observer per layer and export the result."
    )
    st.info("No results yet.")
    st.page_link("pages/model.py", label="Go to Model", icon=":material/deployed_code:")
    st.stop()

metric = ui.metric_select("Metric", "overview_metric")
frame = ui.error_table(analysis)
st.caption(
    f"{analysis.source.get('name', '')}: {len(ui.tensor_keys(analysis))} tensors × "
    f"{len(analysis.config.observer_names)} observers, computed in {analysis.seconds:.1f} s"
)
with ui.guard("Drawing the overview"):
    st.plotly_chart(plots.metric_heatmap(frame, metric), theme="streamlit")
for note in ui.token_warnings(analysis):
    st.warning(note)
