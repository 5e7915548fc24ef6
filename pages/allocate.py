"""Allocate: each chosen layer's scheme and observer under a size budget, chosen by the model's own
loss on held-out text (issue 34): the layers, the candidate schemes and the budgets; Score and
allocate, with progress; the frontier, measured on one part of the held-out text beside predicted
from the other (and measured in sample there); one budget's allocation layer by
layer, with the fusions it assumed; its exports (Observer Lab JSON, recipe, packed checkpoint)."""

import streamlit as st

import observers as ob
from lab import provenance, ui
from lab.allocate import plots
from lab.allocate import session as allocating
from lab.allocate.frontier import scheme_counts, score_name
from lab.allocate.schemes import describe
from lab.export import checkpoint
from lab.results.plots import effect as effect_plots
from lab.ui import serving

st.title("Allocate")
ws = ui.workspace()
state = allocating.state_of(ws)
form = state.form
st.caption(
    "Which scheme each layer takes under a size budget, chosen by the model's own loss: every layer is scored "
    "alone under every candidate scheme and observer on one part of the held-out text (the scoring part), the least "
    "total damage within each budget is solved exactly, and every allocation is then measured with all its layers "
    "quantized together on the other part (the measuring part, out of sample) and on the scoring part (in sample)."
)
model = None
with ui.guard("Opening the model"):
    model = ui.open_request(ws.request)
if model is None or not model.supports_activations:
    st.info("Allocation runs the model on held-out text: open a model with a runtime (not a bare weights file).")
    st.page_link("pages/model.py", label="Go to Model", icon=":material/deployed_code:")
    st.stop()

# ---------------------------------------------------------------- what to allocate
st.subheader("Layers, schemes, budgets")
names = [i.name for i in model.layers() if len(i.shape) >= 2]
layers = form.layers_among(names, ws.layers)
form.layers = ui.bound(
    st.multiselect,
    "Layers",
    "alloc_layers",
    layers,
    options=names,
    help="The layers whose schemes are chosen; the rest of the model stays as it is. The Model page's selection "
    "until you change it here.",
)
left, right = st.columns(2)
with left:
    form.schemes = ui.bound(
        st.multiselect,
        "Candidate schemes",
        "alloc_schemes",
        form.schemes,
        options=list(allocating.SCHEME_OPTIONS),
        help="compressed-tensors presets (weights, and inputs where the preset has them); 'none' keeps a layer dense.",
    )
with right:
    form.specs = ui.bound(
        st.text_input,
        "More schemes (weight specs, comma-separated)",
        "alloc_specs",
        form.specs,
        placeholder="int4:group:64, int8:channel",
        help="DTYPE[:STRATEGY[:SIZE]]: a weight-only scheme, e.g. int4:group:64 or fp8_e4m3:block:128x128.",
    )
form.weights_only = ui.bound(
    st.checkbox, "Weights only (every scheme leaves the inputs in their dtype)", "alloc_weights_only", form.weights_only
)
left, right = st.columns(2)
with left:
    form.budget = ui.bound(
        st.text_input,
        "Budget the exports take",
        "alloc_budget",
        form.budget,
        help="Average bits per weight over the chosen layers (5, 4.8bits) or the whole checkpoint's size (80MB). "
        "Empty: the largest frontier budget.",
    )
with right:
    form.budgets = ui.bound(
        st.text_input,
        "Frontier budgets (comma-separated, same unit; optional)",
        "alloc_budgets",
        form.budgets,
        help="Each is solved and measured, so the frontier shows what a bit more or less buys.",
    )

scoring = st.expander("Scoring: observers, held-out text, metric, calibration")
with scoring:
    form.observers = ui.bound(
        st.multiselect,
        "Weight observers to score",
        "alloc_observers",
        form.observers,
        options=list(ob.available()),
        placeholder="every observer that applies to each scheme",
    )
    left, right = st.columns(2)
    with left:
        form.samples = int(
            ui.bound(
                st.number_input,
                "Held-out windows (decoders) or sentences (encoders), per part",
                "alloc_samples",
                form.samples,
                min_value=3,
                max_value=1024,
                step=1,
            )
        )
    with right:
        form.seq_len = int(
            ui.bound(
                st.number_input, "Tokens per window or sentence", "alloc_seq_len", form.seq_len, min_value=2, step=1
            )
        )
held_out = None
with ui.guard("Running the float model on the held-out text"), st.spinner("Running the float model…"):
    held_out = state.held_out_for(model, ws.request, ws.settings, serving.heavy_slot())
with scoring:
    if held_out is not None:
        evaluator = held_out.scoring
        metrics = list(evaluator.metric_names)
        form.metric = ui.bound(
            st.selectbox,
            "Model-level metric that scores",
            "alloc_metric",
            form.metric if form.metric in metrics else evaluator.default_metric,
            options=metrics,
            format_func=lambda m: effect_plots.MODEL_METRIC_LABELS.get(m, m),
        )
        st.caption(
            f"{evaluator.kind} · held-out text {held_out.summary()} · the score is {score_name(form.metric)}, "
            "lower is better."
        )
    run = ws.settings
    source = "a dataset" if run.dataset else "the pasted text" if run.texts else "the built-in texts"
    st.caption(
        f"Calibration as on the Model page: {run.samples} sample(s) of {run.seq_len} tokens from {source}, "
        f"batches of {run.batch_size}; observer knobs as on the Run page."
    )

asked, problem = None, None
try:
    asked = state.check(model, ws.request, form.layers, ws.calibration.problem)
except ValueError as err:
    problem = str(err)
if problem:
    st.error(f"Cannot allocate: {problem}.")
if st.button("Score and allocate", type="primary", icon=":material/tune:", disabled=asked is None or held_out is None):
    with ui.guard("Allocating"), st.status("Scoring each layer under each scheme…", expanded=True) as status:
        bar, timer = st.progress(0.0, text="starting"), ui.Timer()

        def progress(fraction: float, line: str) -> None:
            bar.progress(fraction, text=f"{timer.elapsed:.1f} s · {line}")

        try:
            with serving.heavy_slot(bar):
                state.run(model, ws.request, asked, ws.settings, ws.result_cache, ws.capture_memo, progress)
        except Exception:
            status.update(label="Allocation failed", state="error")
            raise
        ui.reseed("alloc_view")
        scores = state.result.scores
        status.update(
            label=f"Done in {timer.elapsed:.1f} s: {scores.runs} scores ({scores.unique_runs} distinct runs), "
            f"{len(state.result.frontier.points)} allocations measured",
            state="complete",
            expanded=False,
        )

result = state.result
if result is None:
    st.stop()

# ---------------------------------------------------------------- the frontier
st.subheader("Frontier")
if result.request != ws.request:
    st.warning(
        f"These allocations are of {result.request.source!r}; the Model page now has {ws.request.source!r}. "
        "Press Score and allocate to allocate it; the exports below describe the allocations' model."
    )
measured = result.frontier
name = score_name(measured.metric)
st.caption(
    f"**{result.model_name}** · {len(result.asked.layers)} layer(s) · {describe(result.asked.schemes)} · "
    f"damage in {name}. Held-out text {measured.held_out}. Predicted: the sum of the layers' own scores on the "
    "scoring part (it assumes their damages add); in sample: the model run with every layer of the allocation "
    "quantized at once, on the scoring part; measured: the same on the measuring part (out of sample)."
)
with ui.guard("Drawing the frontier"):
    st.plotly_chart(plots.frontier_figure(measured), theme="streamlit")
spearman = "n/a (under three points, or one side constant)" if measured.spearman is None else f"{measured.spearman:.3f}"
st.markdown(
    f"**Measured (measuring part) against predicted (scoring part)**: Spearman {spearman} over "
    f"{len(measured.points)} allocations."
)
damage = st.column_config.NumberColumn(format="%.3g")
st.dataframe(
    plots.points_frame(measured),
    hide_index=True,
    column_config={
        "bits per weight": st.column_config.NumberColumn(format="%.3f"),
        "checkpoint bytes": st.column_config.NumberColumn(format="localized"),
        f"predicted {name}": damage,
        f"in-sample {name}": damage,
        f"measured {name}": damage,
        "measured / predicted": st.column_config.NumberColumn(format="%.3f"),
    },
)
if measured.notes:
    st.markdown("**Where prediction and measurement part**")
    for note in measured.notes:
        st.write(f"- {note}")
else:
    st.caption("Prediction and measurement agree on every allocation (within 1.5× and in the same order).")
if result.notes:
    with st.expander(f"{len(result.notes)} note(s) from the calibration runs"):
        for note in result.notes:
            st.write(f"- {note}")

# ---------------------------------------------------------------- one allocation
st.subheader("One allocation")
if state.viewed not in result.names:
    state.viewed = result.chosen_name
state.viewed = ui.bound(
    st.selectbox,
    "Budget",
    "alloc_view",
    state.viewed,
    options=result.names,
    format_func=lambda n: f"{n} (the exports' budget)" if n == result.chosen_name else n,
)
point = result.point(state.viewed)
mix = ", ".join(f"{s} {share:.0%}" for s, share in scheme_counts(point, result.sizes).items())
measured_line, in_sample_line = (
    "n/a" if v is None else f"{v:.4g}" for v in (point.measured_score, point.in_sample_score)
)
st.caption(
    f"{point.bits_per_weight:.3f} bits per weight over the chosen layers, a {point.checkpoint_bytes:,}-byte "
    f"checkpoint · predicted {name} {point.predicted:.4g}, in sample {in_sample_line}, measured {measured_line} · "
    f"weights by scheme: {mix}"
    + (" · above what every layer's best option takes: each layer takes its best" if point.unconstrained else "")
)
with ui.guard("Drawing the allocation"):
    st.plotly_chart(plots.allocation_figure(point, result.options, measured.metric), theme="streamlit")
st.dataframe(
    result.choices_frame(point),
    hide_index=True,
    column_config={
        "bits per weight": st.column_config.NumberColumn(format="%.3f"),
        "bytes": st.column_config.NumberColumn(format="localized"),
        f"score ({name})": damage,
    },
)
fused = result.fused()
if fused:
    st.markdown("**Fusions assumed** (a server runs these layers as one kernel, so they share one scheme)")
    for group, members in fused:
        st.write(f"- {group}: {', '.join(members)}")
else:
    st.caption("No fusion assumed: no two of these layers run as one kernel on a server, so each has its own scheme.")

# ---------------------------------------------------------------- exports
st.subheader("Export")
exports = None
with ui.guard("Building the exports"):
    owner = ui.open_request(result.request)
    exports = result.exports_of(point, owner, provenance.made_by(ws.who))  # an allocation is no kept run
if exports is None:
    st.stop()
st.caption(
    "The allocation as a choice like any other: each quantized layer's scheme, observer and qparams (layers left at "
    "'none' stay dense and are not in it). The recipe and the checkpoint are made from that file."
)
e1, e2, e3 = st.columns(3)
with e1:
    st.download_button(
        "Observer Lab JSON",
        exports.json,
        file_name="allocation.json",
        mime="application/json",
        icon=":material/download:",
    )
if exports.refused:
    st.info(f"{exports.refused[:1].upper()}{exports.refused[1:]}.")
    st.stop()
with e2:
    if exports.recipe is not None:
        st.download_button(
            "Recipe (YAML)",
            exports.recipe.to_bytes(),
            file_name="recipe.yaml",
            mime="application/yaml",
            icon=":material/receipt_long:",
        )
        if exports.recipe.notes:
            with st.expander(f"{len(exports.recipe.notes)} note(s) on the recipe"):
                for note in exports.recipe.notes:
                    st.write(f"- {note}")
    else:
        st.caption(f"No recipe: {exports.recipe_problem}")
with e3:
    asked = serving.checkpoint_request("alloc_checkpoint", "my-allocation")
    if asked is not None:
        with ui.guard("Saving the checkpoint"):
            serving.save_checkpoint(
                *asked,
                lambda target, progress: checkpoint.write(
                    exports.lab_file, owner, target, overwrite=asked[1], facts=exports.facts, progress=progress
                ),
            )
