"""Error: metrics per layer and observer, SQNR bars, the error histogram and layer-output error."""

import streamlit as st

from lab import results, ui
from lab.results import plots

st.title("Error")
ws = ui.workspace()
analysis = ui.require_analysis(ws)
order = results.observer_order(analysis)
for note in results.token_warnings(analysis):
    st.warning(note)
metric = ui.metric_select("Best by", ws)
table = results.error_table(analysis)
st.caption("The best observer per layer · tensor is highlighted. Click a column header to sort.")
st.dataframe(ui.highlight_best(table, metric), hide_index=True)
with ui.guard("Drawing the bars"):
    st.plotly_chart(plots.metric_bars(table, metric, order=order), theme="streamlit")

st.subheader("Error distribution")
entry = ui.tensor_picker(ws, analysis)
with ui.guard("Drawing the error histogram"):
    st.plotly_chart(plots.error_histogram(entry, order=order), theme="streamlit")
ui.metrics_note(entry)

st.subheader("Layer-output error")
weights = {e.layer for e in analysis.entries if e.tensor == "weight"}
inputs = {e.layer for e in analysis.entries if e.tensor == "input"}
if not weights & inputs:
    st.info("Layer-output error needs weights and input activations of the same layer: tick both on the Model page.")
else:
    ws.view["layer_output"] = ui.bound(
        st.toggle,
        "Compute layer-output error on the captured inputs",
        "layer_output",
        ws.view.get("layer_output", False),
    )
    if ws.view["layer_output"]:
        with ui.guard("Computing layer-output error"):
            with st.spinner("Running the layers on the captured inputs…"):
                rows = ui.layer_output(ws, analysis)
            st.dataframe(rows, hide_index=True)
            if not rows.empty:
                st.plotly_chart(plots.layer_output_bars(rows, order=order), theme="streamlit")
