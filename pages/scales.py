"""Scales: per-group scale heatmaps per observer on one colour scale, the ratio of two observers'
scales, zero points, MX exponents and the distribution of scales."""

import streamlit as st

from lab import results, ui
from lab.results import plots

st.title("Scales")
ws = ui.workspace()
analysis = ui.require_analysis(ws)
entry = ui.tensor_picker(ws, analysis)
order = results.observer_order(analysis)
shown = ui.observer_picker(ws, entry, "scales_observers", limit=4)
chosen = [r for r in entry.results if r.name in shown]
fields = {"scale": "scale", "log2_scale": "log2(scale)"}
if not entry.spec.symmetric:
    fields["zero_point"] = "zero point"
if entry.spec.format.scale_kind in ("e8m0", "pow2"):
    fields["exponent"] = "shared exponent"
field = ui.bound(
    st.radio,
    "Show",
    "scales_field",
    ws.view.get("scales_field", "scale"),
    options=list(fields),
    format_func=fields.get,
    horizontal=True,
)
field = ws.view["scales_field"] = field if field in fields else "scale"
if not chosen:
    st.info("Select at least one observer.")
else:
    per_tensor = plots.scale_figure_kind(chosen) == "bars"
    if per_tensor:
        st.caption("Per-tensor granularity: one value per observer, so bars instead of a heatmap.")
    with ui.guard("Drawing the heatmaps"):
        st.plotly_chart(plots.qparam_heatmaps(chosen, field, order=order), theme="streamlit")
        rows = chosen[0].qparams.scale.shape[0]
        if rows > plots.MAX_HEATMAP_ROWS:
            st.caption(
                f"{rows} rows reduced to ≤ {plots.MAX_HEATMAP_ROWS} for the browser: "
                "each cell shows the max of its rows."
            )
    if not per_tensor:
        st.subheader("Distribution of scales")
        with ui.guard("Drawing the scale distribution"):
            st.plotly_chart(plots.scale_distribution(chosen, order=order), theme="streamlit")

usable = results.usable_observers(entry)
if len(usable) >= 2 and chosen and plots.scale_figure_kind(chosen) == "heatmap":
    st.subheader("Ratio of two observers' scales")
    c1, c2 = st.columns(2)
    first = ws.view.get("ratio_a") if ws.view.get("ratio_a") in usable else usable[0]
    second = ws.view.get("ratio_b") if ws.view.get("ratio_b") in usable else usable[-1]
    with c1:
        first = ws.view["ratio_a"] = ui.bound(st.selectbox, "Observer A", "ratio_a", first, options=usable)
    with c2:
        second = ws.view["ratio_b"] = ui.bound(st.selectbox, "Observer B", "ratio_b", second, options=usable)
    with ui.guard("Drawing the scale ratio"):
        st.plotly_chart(plots.scale_ratio_heatmap(entry.result(first), entry.result(second)), theme="streamlit")
