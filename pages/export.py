"""Choose & export: one observer per layer and tensor (best by a metric, overridable), the summary,
exports (JSON, compressed-tensors, HTML report) and import of an earlier export."""

import hashlib

import streamlit as st

from lab import plots, ui
from lab.export import uncalibrated
from lab.pipeline import choose

st.title("Choose & export")
analysis = ui.require_analysis()
model = None
with ui.guard("Opening the model"):
    model = ui.current_model()
metric = ui.metric_select("Default choice: best by", "metric")

with st.expander("Import a previous export"):
    upload = st.file_uploader("Observer Lab JSON", type=["json"], key="import_file")
    if upload is not None:
        data = upload.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        if st.session_state.get("imported_digest") != digest:
            with ui.guard(f"Importing {upload.name}"):
                restored, notes = ui.import_choices(data, model, analysis)
                st.session_state[ui.CHOICES] = restored
                st.session_state["imported_digest"] = digest
                st.session_state["import_notes"] = notes
        if st.session_state.get("imported_digest") == digest:
            st.success(f"Restored {len(st.session_state[ui.CHOICES])} choice(s) from {upload.name}.")
            for note in st.session_state.get("import_notes", []):
                st.warning(f"Not restored: {note}")

base = {**choose(analysis, metric), **st.session_state.get(ui.CHOICES, {})}
editor_rows = ui.choices_frame(analysis, base, metric)[["layer", "tensor", "observer", "best"]]
observers = list(analysis.config.observer_names)
edited = st.data_editor(
    editor_rows,
    hide_index=True,
    disabled=["layer", "tensor", "best"],
    column_config={
        "observer": st.column_config.SelectboxColumn("observer (click to change)", options=observers, required=True),
        "best": st.column_config.TextColumn(f"best by {plots.METRIC_LABELS.get(metric, metric)}"),
    },
    key=f"choices_editor:{metric}",
)
choices = ui.choices_from_frame(edited)
st.session_state["final_choices"] = choices

st.subheader("Summary")
summary = ui.choices_frame(analysis, choices, metric)
st.dataframe(summary, hide_index=True)
overridden = int((summary["observer"] != summary["best"]).sum())
st.caption(f"{len(choices)} tensor(s) chosen, {overridden} differ from the best by {metric}.")

st.subheader("Export")
never_calibrated = uncalibrated(analysis)
allow_uncalibrated = False
if never_calibrated:
    st.warning(
        "These activation tensors saw no calibration tokens, so they have no qparams: "
        + ", ".join(f"{e.layer} {e.tensor}" for e in never_calibrated)
        + ". Export refuses them unless you record them as uncalibrated (or calibrate with other text)."
    )
    allow_uncalibrated = st.checkbox("Record them as uncalibrated (no qparams) and export the rest")
c1, c2, c3 = st.columns(3)
with c1, ui.guard("JSON export"):
    st.download_button(
        "Observer Lab JSON",
        ui.json_export(analysis, choices, metric, model, allow_uncalibrated),
        file_name="observer_lab.json",
        mime="application/json",
        icon=":material/download:",
    )
with c2, ui.guard("compressed-tensors export"):
    archive, notes = ui.compressed_tensors_zip(analysis, choices, model, allow_uncalibrated)
    st.download_button(
        "compressed-tensors (zip)",
        archive,
        file_name="compressed_tensors_qparams.zip",
        mime="application/zip",
        icon=":material/deployed_code:",
    )
    with st.expander(f"{len(notes)} note(s) on the compressed-tensors export"):
        for note in notes:
            st.write(f"- {note}")
with c3:
    if st.button("Build HTML report", icon=":material/description:"):
        with ui.guard("HTML report"), st.spinner("Drawing the report…"):
            st.session_state["report_html"] = ui.html_report(analysis, choices, metric)
    if "report_html" in st.session_state:
        st.download_button(
            "Download HTML report",
            st.session_state["report_html"],
            file_name="observer_lab_report.html",
            mime="text/html",
        )
