"""Error: metrics per layer and observer, SQNR bars, the error histogram and layer-output error."""

import streamlit as st

from lab import plots, ui

st.title("Error")
analysis = ui.require_analysis()
order = ui.observer_order(analysis)
for note in ui.token_warnings(analysis):
    st.warning(note)
metric = ui.metric_select("Best by", "metric")
table = ui.error_table(analysis)
st.caption("The best observer per layer · tensor is highlighted. Click a column header to sort.")
st.dataframe(ui.highlight_best(table, metric), hide_index=True)
with ui.guard("Drawing the bars"):
    st.plotly_chart(plots.metric_bars(table, metric, order=order), theme="streamlit")

st.subheader("Error distribution")
entry = ui.tensor_picker(analysis, "error_tensor")
with ui.guard("Drawing the error histogram"):
    st.plotly_chart(plots.error_histogram(entry, order=order), theme="streamlit")

st.subheader("Layer-output error")
has_pairs = {e.layer for e in analysis.entries if e.tensor == "weight"} & {
    e.layer for e in analysis.entries if e.tensor == "input"
}
if not has_pairs:
    st.info("Layer-output error needs weights and input activations of the same layer: tick both on the Model page.")
elif ui.widget(st.toggle, "Compute layer-output error on the captured inputs", "layer_output", False):
    with ui.guard("Computing layer-output error"):
        with st.spinner("Running the layers on the captured inputs…"):
            rows = ui.layer_output_rows(ui.current_model(), analysis, analysis.config.observer_names)
        st.dataframe(rows, hide_index=True)
        if not rows.empty:
            fig = plots.layer_output_bars(rows, order=order)
            st.plotly_chart(fig, theme="streamlit")
