"""Choose & export: one observer per layer and tensor (best by a metric, overridable), the summary,
exports (JSON, compressed-tensors, HTML report), deployment (an llm-compressor recipe, a compressed
checkpoint) and import of an earlier export."""

import hashlib

import pandas as pd
import streamlit as st

from lab import results, ui
from lab.export import checkpoint, compressed_tensors, lab_apply, lab_json, recipe
from lab.gptq import hessians
from lab.results import plots, report
from lab.ui import history, serving
from lab.workspace import ImportState

st.title("Choose & export")
ws = ui.workspace()
analysis = ui.require_analysis(ws)
metric = ui.metric_select("Default choice: best by", ws)
st.caption(
    f"Results of **{analysis.facts.name}**; every export below describes that model. {ui.plain(history.run_by(ws))} "
    f"The files below say so, and that {ui.plain(ws.who)} asked for them."
)

with st.expander("Import a previous export", expanded=bool(ws.imported.digest)):
    upload = st.file_uploader("Observer Lab JSON", type=["json"], key="import_file")
    if upload is not None:
        data = upload.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        if ws.imported.digest != digest:
            with ui.guard(f"Importing {upload.name}"):
                restored = lab_apply.restore(data, analysis, upload.name)
                ws.overrides = dict(restored.choices)
                ws.imported = ImportState(digest, upload.name, len(restored.choices), restored.notes)
    if ws.imported.digest:
        st.success(f"Restored {ws.imported.restored} choice(s) from {ws.imported.name}.")
        if ws.imported.notes:
            st.warning(f"{len(ws.imported.notes)} note(s) on this import: what was not restored, or differs.")
            st.dataframe(
                pd.DataFrame({"note": ws.imported.notes}),
                hide_index=True,
                height=min(400, 38 + 35 * len(ws.imported.notes)),
            )

never_calibrated = results.uncalibrated(analysis)
skipped = {(e.layer, e.tensor) for e in never_calibrated}
choices, stale_overrides = ws.choices()
for note in stale_overrides:
    st.warning(f"Choice ignored: {note}")
best = results.choose(analysis, metric)
editor_rows = results.choices_frame(analysis, choices, metric)
editor_rows = editor_rows[
    [(layer, tensor) not in skipped for layer, tensor in zip(editor_rows["layer"], editor_rows["tensor"], strict=True)]
]
choosable = [  # observers that produced qparams on at least one tensor of the table
    name
    for name in analysis.config.observer_names
    if any(name in results.usable_observers(e) for e in analysis.entries if (e.layer, e.tensor) not in skipped)
]
edited = st.data_editor(
    editor_rows[["layer", "tensor", "observer", "best"]],
    hide_index=True,
    disabled=["layer", "tensor", "best"],
    column_config={
        "observer": st.column_config.SelectboxColumn("observer (click to change)", options=choosable, required=True),
        "best": st.column_config.TextColumn(f"best by {plots.METRIC_LABELS.get(metric, metric)}"),
    },
    key=f"choices_editor:{metric}:{ws.imported.digest}",
)
picked = {
    (row.layer, row.tensor): row.observer
    for row in edited.itertuples()
    if isinstance(row.observer, str) and row.observer != best.get((row.layer, row.tensor))
}
kept, refused = results.valid_choices(analysis, picked)
ws.overrides = kept
for note in refused:
    st.warning(f"Not applied: {note}. Pick an observer that produced qparams for this tensor.")
choices, _ = ws.choices()

st.subheader("Summary")
summary = results.choices_frame(analysis, choices, metric)
st.dataframe(summary, hide_index=True)
overridden = int((summary["observer"] != summary["best"]).sum())
st.caption(f"{len(choices)} tensor(s) chosen, {overridden} differ from the best by {metric}.")

st.subheader("Export")
allow_uncalibrated = False
if never_calibrated:
    st.warning(
        "These activation tensors saw no calibration tokens, so they have no qparams: "
        + ", ".join(f"{e.layer} {e.tensor}" for e in never_calibrated)
        + ". Export refuses them unless you record them as uncalibrated (or calibrate with other text)."
    )
    allow_uncalibrated = st.checkbox("Record them as uncalibrated (no qparams) and export the rest")
    if not allow_uncalibrated:
        st.stop()
c1, c2, c3 = st.columns(3)
with c1, ui.guard("JSON export"):
    st.download_button(
        "Observer Lab JSON",
        lab_json.save(analysis, choices, metric, allow_uncalibrated, history.made_by(ws)),
        file_name="observer_lab.json",
        mime="application/json",
        icon=":material/download:",
    )
with c2, ui.guard("compressed-tensors export"):
    built = compressed_tensors.build(analysis, choices, allow_uncalibrated, history.made_by(ws))
    st.download_button(
        "compressed-tensors (zip)",
        built.to_zip(),
        file_name="compressed_tensors_qparams.zip",
        mime="application/zip",
        icon=":material/deployed_code:",
    )
    with st.expander(f"{len(built.notes)} note(s) on the compressed-tensors export"):
        for note in built.notes:
            st.write(f"- {note}")
with c3:
    if st.button("Build HTML report", icon=":material/description:"):
        with ui.guard("HTML report"), st.spinner("Drawing the report…"):
            state = ws.effect  # the Model effect page's sensitivity and evaluations, when measured on this analysis
            done = state.analysis is analysis and state.sensitivity is not None and state.evaluations
            effect = (state.sensitivity, state.evaluations) if done else None
            ws.report_html = report.render(analysis, choices, metric, effect, history.made_by(ws)).encode("utf-8")
    if ws.report_html is not None:
        st.download_button(
            "Download HTML report", ws.report_html, file_name="observer_lab_report.html", mime="text/html"
        )

st.subheader("Deploy")
st.caption(
    "An llm-compressor recipe that calibrates each layer with the observer chosen here, and a checkpoint "
    "with these qparams packed by compressed-tensors, which transformers and vLLM load."
)
d1, d2 = st.columns(2)
with d1, ui.guard("Recipe"):
    built_recipe = recipe.build(analysis, choices, allow_uncalibrated, history.made_by(ws))
    st.download_button(
        "Recipe (YAML)",
        built_recipe.to_bytes(),
        file_name="recipe.yaml",
        mime="application/yaml",
        icon=":material/receipt_long:",
    )
    if built_recipe.notes:
        with st.expander(f"{len(built_recipe.notes)} note(s) on the recipe"):
            for note in built_recipe.notes:
                st.write(f"- {note}")
with d2:
    asked = serving.checkpoint_request("checkpoint", "my-checkpoint")
    if asked is not None:
        with ui.guard("Saving the checkpoint"):
            model = ui.open_request(ws.last_request)
            if model is None:
                raise ValueError("open the model this analysis was made on first (Model page)")
            serving.save_checkpoint(
                *asked,
                lambda target, progress: checkpoint.write(
                    lab_json.as_lab_file(analysis, choices, metric, allow_uncalibrated, history.made_by(ws)),
                    model,
                    target,
                    overwrite=asked[1],
                    hessians=hessians.of_analysis(analysis.entries),
                    progress=progress,
                ),
            )
