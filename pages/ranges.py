"""Ranges: the value histogram with every observer's range (where its format clips), a weight as
GPTQ's sweep updated it against an observer's range, a balance layer's weight as an AWQ variant
smoothed it against an observer's range, per-channel ranges, and the per-token vs per-channel view
of activations."""

from dataclasses import replace

import streamlit as st

from lab import results, ui
from lab.awq import session as awq_session
from lab.awq.search import Variant
from lab.gptq.layer import entry_gptq
from lab.results import dynamic, plots, ranges

st.title("Ranges")
ws = ui.workspace()
analysis = ui.require_analysis(ws)
entry = ui.tensor_picker(ws, analysis)
order = results.observer_order(analysis)
shown = ui.observer_picker(ws, entry, "ranges_observers")
view = ws.view
c1, c2, c3 = st.columns(3)
with c1:
    view["log"] = ui.bound(st.checkbox, "Log count", "ranges_log", view.get("log", True))
with c2:
    view["abs"] = ui.bound(st.checkbox, "Absolute values |x|", "ranges_abs", view.get("abs", False))
with c3:
    zooms = ["full", "left tail", "right tail"]
    view["zoom"] = ui.bound(st.radio, "Zoom", "ranges_zoom", view.get("zoom", "full"), options=zooms, horizontal=True)
chosen = [r for r in entry.results if r.name in shown]
note = ranges.granularity_note(entry.spec, entry.tensor)
if note:
    st.info(note)
tail = None if view["zoom"] == "full" else view["zoom"].split()[0]


def histogram(data, drawn, spec, title: str, specs=None) -> None:
    """The value histogram with each result's range, as the controls above say."""
    options = {"log_count": view["log"], "absolute": view["abs"], "tail": tail, "order": order, "specs": specs}
    st.plotly_chart(plots.range_histogram(data, drawn, spec, title=title, **options), theme="streamlit")


with ui.guard("Drawing the histogram"):
    histogram(
        entry.values, chosen, entry.spec, f"{entry.layer} · {entry.tensor} ({entry.spec.dtype}, {entry.spec.strategy})"
    )
    st.caption("Each observer's lines mark where its format clips: the ends of the values it can represent.")
    ui.metrics_note(entry)
    if tail:
        st.caption("Tail zoom: only the outer 0.1 % of values, re-binned.")
st.dataframe(ranges.range_table(chosen, entry.spec), hide_index=True)

gptq = analysis.config.gptq
if entry.tensor == "weight" and gptq is not None and entry.hessian_source is not None:
    st.subheader("Under GPTQ")
    usable = [r.name for r in chosen if r.qparams is not None]
    if not usable:
        st.caption("Pick an observer that gave qparams above to see its weights under GPTQ.")
    else:
        if view.get("gptq_observer") not in usable:
            view["gptq_observer"] = usable[0]
        name = view["gptq_observer"] = ui.bound(
            st.selectbox, "Observer under GPTQ", "ranges_gptq_observer", view["gptq_observer"], options=usable
        )
        with ui.guard("Running GPTQ on this layer"):
            done = entry_gptq(entry, name, gptq)
            swept = replace(entry.result(name), qparams=done.qparams)
            histogram(done.updated, [swept], entry.spec, f"{entry.layer} · weight as GPTQ's sweep updated it")
        st.caption(
            f"Each weight as GPTQ's sweep ({gptq.scales} scales) found it just before rounding: the original plus the "
            f"error fed forward from the columns before it, against {name}'s range"
            + (" (refit per group as the sweep reached it)" if gptq.scales == "refit" else " (fixed before the sweep)")
            + f". {done.clip_ratio:.2%} of them lie outside it and clip, against "
            f"{entry.result(name).metrics.get('clip_ratio', 0.0):.2%} of the original weight."
        )

searched = awq_session.state_of(ws).shown_with(analysis)
mapping = searched.mapping_of(entry.layer) if searched is not None and entry.tensor == "weight" else None
if mapping is not None:
    st.subheader("Under AWQ")
    observers, variants = list(searched.run.observers), [str(v) for v in Variant]
    if view.get("awq_observer") not in observers:
        view["awq_observer"] = observers[0]
    left, right = st.columns(2)
    with left:
        name = view["awq_observer"] = ui.bound(
            st.selectbox, "Observer under AWQ", "ranges_awq_observer", view["awq_observer"], options=observers
        )
    with right:
        view["awq_variant"] = ui.bound(
            st.radio,
            "AWQ variant",
            "ranges_awq_variant",
            view.get("awq_variant", str(Variant.LLM_COMPRESSOR)),
            options=variants,
            horizontal=True,
        )
    variant = Variant(view["awq_variant"])
    with ui.guard("Drawing the smoothed weight"):
        smoothed, drawn = searched.smoothed(ui.open_request(searched.request), mapping, entry.layer, variant, name)
        if drawn.qparams is None:
            st.caption(ui.plain(f"{name} has no {variant} figures here: {drawn.error}"))
        else:
            title = f"{entry.layer} · weight as {variant} smooths it for {name}"
            histogram(smoothed, [drawn], searched.run.spec, title)
            row = mapping.row(variant, name)
            how = (
                "as it is (round-to-nearest does not smooth)"
                if row.ratio is None
                else f"times AWQ's scale per input column, W·diag(s), strength r = {row.ratio:.2f}"
                + ("" if row.duo else " from the activations alone")
            )
            st.caption(
                ui.plain(
                    f"The weight {how}, against {name}'s range on it ({variant}): "
                    f"{drawn.metrics['clip_ratio']:.2%} of it lies outside and clips."
                )
            )

if entry.tool_results:
    st.subheader("As each tool would run it")
    st.caption(
        "Each tool's default observer with its own conventions (scale rule, MX rounding, eps, narrow range) "
        "on the same tensor: what it would actually produce. Shown for comparison, never exported."
    )
    by_tool = [run.result for run in entry.tool_results if run.result.qparams is not None]
    tool_specs = {run.result.name: run.profile.spec for run in entry.tool_results if run.profile is not None}
    for run in entry.tool_results:
        if run.result.qparams is None:
            st.caption(f"{run.tool}: {run.result.error}")
        elif run.profile.notes:
            st.caption(f"{run.result.name}: {'; '.join(run.profile.notes)}")
    if by_tool:
        with ui.guard("Drawing the tools' ranges"):
            title = f"{entry.layer} · {entry.tensor} as each tool would quantize it"
            histogram(entry.values, by_tool, entry.spec, title, specs=tool_specs)
        st.dataframe(ranges.range_table(by_tool, entry.spec, tool_specs), hide_index=True)


def another_view(other, heading: str, note: str, title: str) -> None:
    """The same tensor as another run saw it: its histogram with the shown observers' ranges."""
    st.subheader(heading)
    st.caption(note)
    other_results = [r for r in other.results if r.name in shown]
    with ui.guard(f"Drawing the histogram ({heading.lower()})"):
        histogram(other.values, other_results, other.spec, f"{entry.layer} · {entry.tensor} {title}")
    st.dataframe(ranges.range_table(other_results, other.spec), hide_index=True)


seen = ws.transformed_entry(entry)
if seen is not None:
    label = ws.transformed.config.transform.label()
    another_view(
        seen,
        f"Through a {label}",
        "The same tensor as the transformed model's layer sees it (its float output is unchanged): "
        "where the outliers and every observer's range move.",
        f"through a {label}",
    )
floating = ws.unpropagated_entry(entry)
if floating is not None:
    another_view(
        floating,
        "Calibrated on the float model",
        "Above: this tensor as the blocks before it, quantized with their choices, feed it (propagation). "
        "Here: as the float model feeds it. The difference is what a deployed model's activations add.",
        "with float calibration",
    )

if entry.tensor == "weight":
    st.subheader("Per-channel ranges")
    with ui.guard("Drawing per-channel ranges"):
        st.plotly_chart(
            plots.channel_range_figure(entry.data, 0, title="min/max per output channel"), theme="streamlit"
        )
elif entry.tensor in ("k", "v") and entry.num_tokens > 0:
    st.subheader("Per-head ranges")
    with ui.guard("Drawing per-head ranges"):
        st.plotly_chart(plots.head_range_figure(entry.extremes), theme="streamlit")
        per_token = plots.per_token_view(entry.data)
        figure = plots.token_channel_figure(per_token, channels=plots.per_token_view(entry.extremes))
        st.plotly_chart(figure, theme="streamlit")
elif entry.num_tokens > 0:
    st.subheader("Per-token vs per-channel abs-max")
    with ui.guard("Drawing activation outliers"):
        st.plotly_chart(plots.token_channel_figure(entry.data, channels=entry.extremes), theme="streamlit")
        st.plotly_chart(
            plots.channel_range_figure(entry.extremes, -1, title="min/max per hidden channel"), theme="streamlit"
        )
else:
    st.warning(f"{entry.layer} · {entry.tensor} observed no tokens.")

if dynamic.dynamic_applies(entry):
    st.subheader("Dynamic scales over the calibration tokens")
    with ui.guard("Drawing the dynamic scales"):
        st.plotly_chart(plots.dynamic_scale_figure(entry, chosen, order=order), theme="streamlit")
        st.dataframe(dynamic.dynamic_summary(entry, chosen), hide_index=True)
        st.caption(
            "This spec is dynamic: at run time each token (or token group) gets its own scale from its own "
            "min/max, so the static range lines above only summarize calibration. The histogram shows the "
            "scales a runtime would compute on the calibration tokens; the table compares them with each "
            "observer's static scales (p50 ratio, share of run-time scales above the static one, SQNR)."
        )
