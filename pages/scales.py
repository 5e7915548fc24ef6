"""Scales: per-group scale heatmaps per observer on one color scale, the ratio of two observers'
scales, zero points, MX exponents and the distribution of scales."""

import streamlit as st

from lab import plots, ui

st.title("Scales")
analysis = ui.require_analysis()
entry = ui.tensor_picker(analysis)
order = ui.observer_order(analysis)
shown = ui.observer_picker(entry, "scales_observers", limit=4)
results = [r for r in entry.results if r.name in shown]
fields = {"scale": "scale", "log2_scale": "log2(scale)"}
if not entry.spec.symmetric:
    fields["zero_point"] = "zero point"
if entry.spec.format.scale_kind in ("e8m0", "pow2"):
    fields["exponent"] = "shared exponent"
field = ui.widget(
    st.radio, "Show", "scales_field", "scale", options=list(fields), format_func=fields.get, horizontal=True
)
if field not in fields:
    field = "scale"
if not results:
    st.info("Select at least one observer.")
elif field == "scale" and all(r.qparams.scale.numel() == 1 for r in results):
    st.caption("Per-tensor granularity: one scale per observer.")
    st.plotly_chart(plots.scale_bars(results, order=order), theme="streamlit")
else:
    with ui.guard("Drawing the heatmaps"):
        fig = plots.qparam_heatmaps(results, field, order=order)
        st.plotly_chart(fig, theme="streamlit")
        rows = entry.results[0].qparams.scale.shape[0] if entry.results[0].qparams is not None else 0
        if rows > plots.MAX_HEATMAP_ROWS:
            st.caption(
                f"{rows} rows reduced to ≤ {plots.MAX_HEATMAP_ROWS} for the browser: "
                "each cell shows the max of its rows."
            )

ok = [r.name for r in entry.results if r.qparams is not None]
if len(ok) >= 2:
    st.subheader("Ratio of two observers' scales")
    c1, c2 = st.columns(2)
    with c1:
        first = ui.widget(st.selectbox, "Observer A", "ratio_a", ok[0], options=ok)
    with c2:
        second = ui.widget(st.selectbox, "Observer B", "ratio_b", ok[-1], options=ok)
    with ui.guard("Drawing the scale ratio"):
        st.plotly_chart(plots.scale_ratio_heatmap(entry.result(first), entry.result(second)), theme="streamlit")

st.subheader("Distribution of scales")
with ui.guard("Drawing the scale distribution"):
    st.plotly_chart(plots.scale_distribution(results, order=order), theme="streamlit")
