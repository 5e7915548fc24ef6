"""Runs: every run this server computed (who asked, when, what it ran), kept across restarts; open
one as if it had just run, share its link, download its Observer Lab JSON, delete your own, and
compare two runs side by side on the same layer."""

import pandas as pd
import streamlit as st

from lab import ui
from lab.history import compare
from lab.history.store import HistoryError
from lab.results import plots
from lab.ui import history as runs
from lab.ui import serving

st.title("Runs")
ws = ui.workspace()
history = serving.history()
kept = history.runs()
st.caption(
    f"Every run this server computed, newest first, kept in `{serving.served().describe()['output']}/runs` "
    f"across restarts: {history.bounds} (`--history-size`, `--history-bytes`), older ones removed first; "
    f"{sum(r.size for r in kept) / 1e6:,.0f} MB on disk. Runs this session asks for are recorded as asked for "
    f"by **{ui.plain(ws.who)}**."
)
if history.pruned_note():
    st.info(f"Since this server started, {history.pruned_note()}.")
if not kept:
    st.info("No runs yet: a run made on the Run page (or the Overview's demo) appears here for the whole team.")
    st.page_link("pages/run.py", label="Go to Run", icon=":material/play_arrow:")
    st.stop()

by_id = {record.id: record for record in kept}
st.dataframe(
    pd.DataFrame(
        {
            "when (UTC)": [r.when.replace("T", " ").removesuffix("+00:00") for r in kept],
            "who": [r.who for r in kept],
            "model": [r.model for r in kept],
            "layers": [f"{len(r.layers)}: {', '.join(r.layers[:3])}{' …' if len(r.layers) > 3 else ''}" for r in kept],
            "formats": [r.formats for r in kept],
            "observers": [", ".join(r.observers) for r in kept],
            "calibration set": [r.calibration for r in kept],
            "GPTQ": [r.gptq for r in kept],
            "duration (s)": [round(r.seconds, 1) for r in kept],
            "on disk (MB)": [round(r.size / 1e6, 1) for r in kept],
            "run": [r.id for r in kept],
        }
    ),
    hide_index=True,
)


def kept_choice(name: str, default: str) -> str:
    """The run the session last picked in ``name``, while the history still has it."""
    return ws.view[name] if ws.view.get(name) in by_id else default


def label(run_id: str) -> str:
    record = by_id[run_id]
    return f"{record.when[:16].replace('T', ' ')} · {record.who} · {record.model} · {record.formats}"


st.subheader("Open a run")
picked = ui.bound(
    st.selectbox, "Run", "runs_open", kept_choice("runs_open", kept[0].id), options=list(by_id), format_func=label
)
ws.view["runs_open"] = picked
record = by_id[picked]
st.caption(f"Its link, for a colleague signed in to this server: `{runs.run_link(record.id)}`")
c1, c2, c3 = st.columns(3)
if c1.button("Open", type="primary", icon=":material/open_in_browser:"):
    with ui.guard(f"Opening run {record.id}"):
        runs.open_run(ws, record.id)
        st.rerun()  # every widget shows the opened run's settings
with c2, ui.guard("Reading its Observer Lab JSON"):
    lab_file = history.lab_file(record.id)
    if lab_file is not None:
        st.download_button(
            "Observer Lab JSON",
            lab_file,
            file_name=f"observer_lab_{record.id}.json",
            mime="application/json",
            icon=":material/download:",
        )
mine = record.who == ws.who
if c3.button(
    "Delete",
    icon=":material/delete:",
    disabled=not mine,
    help=None if mine else f"Only {record.who} may delete this run.",
):
    with ui.guard(f"Deleting run {record.id}"):
        history.delete(record.id, ws.who)
        runs.kept_run.clear()
        st.rerun()
if ws.last_run is not None and ws.last_run.kept is not None and ws.last_run.kept.id == record.id:
    st.success(f"Every page shows this run ({ui.run_summary(ws.last_run)}).")
    cols = st.columns(4)
    cols[0].page_link("pages/overview.py", label="Overview", icon=":material/grid_view:")
    cols[1].page_link("pages/ranges.py", label="Ranges", icon=":material/straighten:")
    cols[2].page_link("pages/error.py", label="Error", icon=":material/query_stats:")
    cols[3].page_link("pages/export.py", label="Choose & export", icon=":material/download:")

st.subheader("Compare two runs")
if len(kept) < 2:
    st.info("Two kept runs are needed: run the same layers again with another format or calibration set.")
    st.stop()
left, right = st.columns(2)
with left:
    first_id = ws.view["compare_a"] = ui.bound(
        st.selectbox, "Run A", "compare_a", kept_choice("compare_a", kept[1].id), options=list(by_id), format_func=label
    )
with right:
    second_id = ws.view["compare_b"] = ui.bound(
        st.selectbox, "Run B", "compare_b", kept_choice("compare_b", kept[0].id), options=list(by_id), format_func=label
    )
try:
    first, second = runs.kept_run(first_id).analysis, runs.kept_run(second_id).analysis
except (HistoryError, ValueError) as err:
    st.error(f"Reading the runs failed: {err}")
    st.stop()
differs = compare.differences(by_id[first_id], by_id[second_id])
st.caption(f"They differ in {', '.join(differs)}." if differs else "They ran the same model, formats and calibration.")
shared = compare.common_tensors(first, second)
if shared:
    key = ws.view.get("compare_tensor") if ws.view.get("compare_tensor") in shared else shared[0]
    key = ws.view["compare_tensor"] = ui.bound(
        st.selectbox,
        "Layer · tensor (analysed in both)",
        "compare_tensor",
        key,
        options=shared,
        format_func=" · ".join,
    )
    entries = first.entry(*key), second.entry(*key)
else:
    st.caption("The two runs analysed no layer in common: pick one of each.")
    a, b = st.columns(2)
    entries = (
        first.entry(*a.selectbox("Layer · tensor of A", first.keys(), format_func=" · ".join, key="compare_ta")),
        second.entry(*b.selectbox("Layer · tensor of B", second.keys(), format_func=" · ".join, key="compare_tb")),
    )
st.dataframe(compare.side_by_side(*entries), hide_index=True)
figure = st.selectbox(
    "Draw",
    compare.FIGURES,
    index=compare.FIGURES.index("sqnr_db"),
    format_func=lambda name: plots.METRIC_LABELS.get(name, name),
    key="compare_figure",
)
with ui.guard("Drawing the comparison"):
    frame = compare.bars(*entries)
    if frame[figure].notna().any():
        st.plotly_chart(plots.metric_bars(frame, figure), theme="streamlit")
    else:
        st.caption(f"Neither run has a {figure}.")
st.caption("Each run's value histogram with every observer's range (where its format clips):")
for entry, name in zip(entries, ("A", "B"), strict=True):
    with ui.guard(f"Drawing run {name}'s ranges"):
        drawn = [r for r in entry.results if r.qparams is not None]
        title = f"{name}: {entry.layer} · {entry.tensor} ({entry.spec.dtype}, {entry.spec.strategy})"
        st.plotly_chart(plots.range_histogram(entry.values, drawn, entry.spec, title=title), theme="streamlit")
