"""Error: metrics per layer and observer (as served, each fused layer's own beside them), SQNR bars,
the error histogram, the picked tensor as served against its own, each observer under GPTQ beside
round-to-nearest, each observer under AWQ's four variants on the picked layer's mapping, and
layer-output error."""

import pandas as pd
import streamlit as st

from lab import results, ui
from lab.awq import session as awq_session
from lab.gptq.table import gptq_frame
from lab.results import plots, served
from lab.ui import serving

GPTQ_COLUMNS = {
    "observer": st.column_config.TextColumn("observer"),
    "rtn_error": st.column_config.NumberColumn("RTN error", help="relative ‖WX − ŴX‖² after round-to-nearest"),
    "gptq_error": st.column_config.NumberColumn("GPTQ error", help="relative ‖WX − ŴX‖² after GPTQ"),
    "rtn_rank": st.column_config.NumberColumn("RTN rank", help="place in this layer by RTN error (1 = least)"),
    "gptq_rank": st.column_config.NumberColumn("GPTQ rank", help="place in this layer by GPTQ error (1 = least)"),
    "rtn_clipped": st.column_config.NumberColumn("clipped after RTN", help="share of the weight outside the range"),
    "gptq_clipped": st.column_config.NumberColumn(
        "clipped after GPTQ", help="share of the error-updated weights outside the observer's range"
    ),
    "rtn_held_out": st.column_config.NumberColumn(
        "RTN held-out", help="relative ‖WX − ŴX‖² after round-to-nearest on held-out inputs"
    ),
    "gptq_held_out": st.column_config.NumberColumn(
        "GPTQ held-out", help="relative ‖WX − ŴX‖² after GPTQ on held-out inputs: what its fit carries over"
    ),
    "held_out_rank": st.column_config.NumberColumn(
        "held-out rank", help="place in this layer by GPTQ's held-out error (1 = least)"
    ),
    "fallback": st.column_config.CheckboxColumn("RTN fallback", help="the Hessian would not factor: RTN instead"),
    "error": st.column_config.TextColumn("why not", width="large"),
}
AWQ_COLUMNS = {
    "mapping_error": st.column_config.NumberColumn(
        "mapping error", help="the parent module's relative output error Σ(out − float)² / Σ float², calibration tokens"
    ),
    "rank": st.column_config.NumberColumn("rank", help="place among the observers under this variant (1 = least)"),
    "held_out_error": st.column_config.NumberColumn(
        "held-out error", help="the same on held-out text, which the search never saw: what its pick carries over"
    ),
    "held_out_rank": st.column_config.NumberColumn("held-out rank", help="place by held-out error (1 = least)"),
    "gptq_error": st.column_config.NumberColumn(
        "then GPTQ", help="the mapping error once GPTQ quantizes the smoothed weights (rtn: GPTQ alone)"
    ),
    "gptq_rank": st.column_config.NumberColumn("GPTQ rank", help="place by the error once GPTQ follows (1 = least)"),
    "gptq_held_out_error": st.column_config.NumberColumn(
        "then GPTQ, held-out", help="the same on held-out text (GPTQ's weights from the calibration Hessian)"
    ),
    "gptq_held_out_rank": st.column_config.NumberColumn(
        "GPTQ held-out rank", help="place by the held-out error once GPTQ follows (1 = least)"
    ),
    "layer_error": st.column_config.NumberColumn(
        "layer error", help="relative ‖WX − ŴX‖² of each balance layer, their mean"
    ),
    "held_out_layer_error": st.column_config.NumberColumn(
        "held-out layer error", help="the balance layers' error on held-out text, their mean"
    ),
    "clipped": st.column_config.NumberColumn("clipped", help="share of the smoothed weight outside the range, mean"),
    "ratio": st.column_config.NumberColumn("strength r", help="the winning s = x̄^r / w̄^(1−r); none: not smoothed"),
    "duo": st.column_config.CheckboxColumn("duo", help="the weights took part in the winning scales (w̄ in s)"),
    "error": st.column_config.TextColumn("why not", width="large"),
}
BEST = "font-weight: bold; background-color: rgba(46, 160, 67, 0.25)"


def figures_and_failures(rows: pd.DataFrame, where: str, styled, columns: dict, none: str) -> None:
    """The rows with figures as a table (``styled``), and in an expander why the others have none."""
    failed = rows[rows["error"].notna()]
    shown = rows[rows["error"].isna()].drop(columns=[where, "error"]).reset_index(drop=True)
    st.dataframe(styled(shown), hide_index=True, column_config=columns)
    if not failed.empty:
        with st.expander(f"Why {len(failed)} {none} figures here"):
            reasons = [c for c in ("observer", "variant", "error") if c in failed.columns]
            st.dataframe(failed[reasons], hide_index=True, column_config=columns)


def best_by_gptq(rows: pd.DataFrame):
    """The layer's rows with the best by GPTQ error in bold and green, errors and shares readable."""
    best = rows["gptq_rank"].eq(1).fillna(False)
    styled = rows.style.apply(lambda row: [BEST if best[row.name] else "" for _ in row], axis=1)
    errors = ["rtn_error", "gptq_error", "rtn_held_out", "gptq_held_out"]
    styled = styled.format("{:.4g}", subset=errors, na_rep="–")
    return styled.format("{:.2%}", subset=["rtn_clipped", "gptq_clipped"], na_rep="–")


def best_per_variant(rows: pd.DataFrame):
    """A mapping's rows with the best observer under each variant in bold and green."""
    best = rows["rank"].eq(1).fillna(False)
    styled = rows.style.apply(lambda row: [BEST if best[row.name] else "" for _ in row], axis=1)
    errors = [c for c in rows.columns if c.endswith("_error")]
    styled = styled.format("{:.4g}", subset=errors, na_rep="–")
    return styled.format("{:.2%}", subset=["clipped"], na_rep="–").format("{:.2f}", subset=["ratio"], na_rep="–")


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

if entry.served is not None:
    st.subheader("As served")
    st.caption(served.served_sentence(entry))
    st.dataframe(served.served_frame(entry, metric), hide_index=True)

gptq = gptq_frame(analysis)
if not gptq.empty:
    st.subheader("Under GPTQ")
    knobs = analysis.config.gptq
    if entry.tensor != "weight":
        st.caption("GPTQ quantizes weights: pick a layer's weight above to see its observers under GPTQ.")
    elif entry.layer not in set(gptq["layer"]):
        st.caption("This weight has no GPTQ rows.")
    else:
        layer_rows = gptq[gptq["layer"] == entry.layer]
        st.caption(
            f"Each observer's qparams put through GPTQ ({knobs.scales} scales, activation order {knobs.actorder}, "
            f"block {knobs.block_size}, dampening {knobs.dampening}) beside round-to-nearest (RTN): the relative "
            "layer-output error ‖WX − ŴX‖² / ‖WX‖² on the calibration inputs, each observer's rank under each, and "
            "the share of weights outside its range, which clip; the same errors on held-out inputs, which GPTQ "
            "never fitted, say what its fit carries over. The best by GPTQ error is highlighted."
        )
        figures_and_failures(layer_rows, "layer", best_by_gptq, GPTQ_COLUMNS, "observer(s) have no GPTQ")
        with ui.guard("Drawing the GPTQ bars"):
            st.plotly_chart(plots.gptq_bars(layer_rows), theme="streamlit")
        st.caption(ui.plain(plots.gptq_turnover(layer_rows)))
        if gptq["layer"].nunique() > 1:
            st.caption(ui.plain(plots.gptq_turnover_summary(gptq)))

searched = awq_session.state_of(ws).shown_with(analysis)
if searched is not None:
    st.subheader("Under AWQ")
    mapping = searched.mapping_of(entry.layer)
    if entry.tensor != "weight":
        st.caption("AWQ smooths weights: pick a balance layer's weight above to see its mapping under AWQ.")
    elif mapping is None:
        st.caption(ui.plain(f"{entry.layer} is not a balance layer of a mapping AWQ searched."))
    else:
        awq_rows = searched.rows(mapping)
        settings = searched.run.awq
        st.caption(
            ui.plain(
                f"{mapping.mapping.name}, judged on the output of {mapping.mapping.parent}. Each observer under "
                f"AWQ's four variants (n_grid {settings.n_grid}, duo scaling {settings.duo_scaling}): the parent's "
                "relative output error on the calibration tokens and on held-out text with the observer's rank, the "
                "balance layers' own error and clipped share, and the winning strength. The best under each variant "
                "is highlighted."
            )
        )
        figures_and_failures(awq_rows, "mapping", best_per_variant, AWQ_COLUMNS, "row(s) have no AWQ")
        with ui.guard("Drawing the AWQ bars"):
            st.plotly_chart(plots.awq_bars(awq_rows, order=order), theme="streamlit")
        st.caption(ui.plain(searched.turnover(mapping)))
    if searched.effect is None:
        if st.button("Measure each variant's model-level effect", icon=":material/model_training:"):
            with ui.guard("Measuring the model-level effect"), st.spinner("Running the quantized models…"):
                searched.measure_effect(ui.open_request(searched.request), serving.heavy_slot())
    if searched.effect is not None:
        best = ", ".join(f"{variant}: {observer}" for variant, observer in searched.effect_best().items())
        st.caption(
            f"Every balance layer quantized as each variant deploys it (the other layers float), on held-out text "
            f"against the float model. Best by {searched.effect_metric} per variant: {best}."
        )
        metrics = [c for c in searched.effect.columns if c not in ("observer", "variant")]
        st.dataframe(searched.effect.style.format("{:.4g}", subset=metrics), hide_index=True)

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
