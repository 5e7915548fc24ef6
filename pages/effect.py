"""Model effect: what the chosen observers do to the model's output on held-out text (not the
calibration text): per-layer sensitivity (one tensor quantized at a time, each observer), choosing
by a model-level metric, and end-to-end evaluation of choice sets with the SQNR after each block."""

from dataclasses import replace

import pandas as pd
import streamlit as st

import observers as ob
from lab import results, ui
from lab.effect import evaluate
from lab.effect.sensitivity import BY_MODEL, sensitivity
from lab.results.plots import METRIC_LABELS
from lab.results.plots import effect as effect_plots
from lab.ui import serving
from lab.vocab import DEFAULT_METRIC, MODEL_METRIC_PREFIX, model_metric

st.title("Model effect")
ws = ui.workspace()
analysis = ui.require_analysis(ws)
state = ws.effect_for(analysis)
st.caption(
    f"What the choices on **{analysis.facts.name}** do to the model's output, measured on held-out text that is "
    "not the calibration text. Decoders: KL of next-token distributions, top-1 agreement, perplexity. Encoders: "
    "cosine of sentence embeddings and how well the ranking of pairwise similarities is kept (Spearman)."
)
model = ui.open_request(ws.last_request)
if model is None or not model.supports_activations:
    st.info("Model-level effect runs the model: open a model with a runtime (not a bare weights file) and Run.")
    st.stop()

left, right = st.columns(2)
with left:
    state.samples = int(
        ui.bound(
            st.number_input,
            "Held-out windows (decoders) or sentences (encoders)",
            "effect_samples",
            state.samples,
            min_value=3,
            max_value=1024,
            step=1,
        )
    )
with right:
    state.seq_len = int(
        ui.bound(st.number_input, "Tokens per window or sentence", "effect_seq_len", state.seq_len, min_value=2, step=1)
    )
evaluator = None
with ui.guard("Running the float model on the held-out text"), st.spinner("Running the float model…"):
    evaluator = ws.effect_evaluator(model, serving.heavy_slot())
if evaluator is None:
    st.stop()
st.caption(
    f"{evaluator.kind} · {evaluator.runner.tokens} held-out tokens in {len(evaluator.runner.batches)} batch(es) · "
    f"{evaluator.runner.num_blocks} blocks · "
    + ("block by block (sequential)" if evaluator.runner.sequential else "whole model")
)
labels = effect_plots.MODEL_METRIC_LABELS

# ---------------------------------------------------------------- sensitivity
st.subheader("Per-layer sensitivity")
st.caption(
    "Each tensor is quantized alone with each observer, everything else float. The float hidden states at every "
    "block boundary are cached, so a tensor of block k re-runs the model from block k only."
)
kinds = list(dict.fromkeys(e.tensor for e in analysis.entries))
default_kinds = ["weight"] if "weight" in kinds else kinds[:1]
chosen_kinds = ui.bound(st.multiselect, "Tensors", "effect_kinds", default_kinds, options=kinds)
metric = ui.bound(
    st.selectbox,
    "Model-level metric",
    "effect_metric",
    evaluator.default_metric,
    options=list(evaluator.metric_names),
    format_func=lambda m: labels.get(m, m),
)
if st.button("Measure sensitivity", icon=":material/troubleshoot:", disabled=not chosen_kinds):
    with ui.guard("Measuring sensitivity"), st.status("Quantizing one tensor at a time…", expanded=True) as status:
        bar, timer = st.progress(0.0, text="starting"), ui.Timer()

        def progress(done: int, total: int, label: str) -> None:
            bar.progress(done / total if total else 1.0, text=f"{done}/{total} runs · {timer.elapsed:.1f} s · {label}")

        with serving.heavy_slot(bar):
            state.sensitivity = sensitivity(evaluator, analysis, tensors=chosen_kinds, metric=metric, progress=progress)
        state.choose_by = model_metric(metric)  # a fresh table: choose by what it measured
        ui.reseed("effect_choose_by")
        status.update(label=f"Done in {timer.elapsed:.1f} s", state="complete", expanded=False)
table = state.sensitivity
if table is not None:
    shown = metric if metric in table.frame.columns else table.metric
    baseline = table.baseline.get(shown)
    st.caption(
        f"{table.runs} one-tensor runs ({table.unique_runs} distinct: observers giving the same qparams share a run) "
        f"in {table.seconds:.1f} s."
    )
    with ui.guard("Drawing the sensitivity heatmap"):
        st.plotly_chart(effect_plots.sensitivity_heatmap(table.frame, shown, baseline), theme="streamlit")
    ranked = replace(table, metric=shown)
    st.markdown("**Most sensitive tensors** (damage with the observer that hurts least, and the one that hurts most)")
    st.dataframe(ranked.ranking(), hide_index=True)
    st.markdown(f"**Does the best observer by {METRIC_LABELS.get(table.local_metric)} give the best model output?**")
    agreement = ranked.best_per_layer(analysis)
    st.dataframe(agreement, hide_index=True)
    if not agreement.empty:
        st.caption(f"They agree on {int(agreement['same'].sum())} of {len(agreement)} tensor(s).")
    with ui.guard("Drawing local against model-level"):
        figure = effect_plots.local_vs_model(
            table.frame, f"local_{table.local_metric}", shown, baseline, order=results.observer_order(analysis)
        )
        st.plotly_chart(figure, theme="streamlit")

# ---------------------------------------------------------------- choose by, evaluate end to end
st.subheader("Choose by, then evaluate end to end")
local_options = list(ob.METRIC_KEYS)
model_options = [model_metric(m) for m in evaluator.metric_names] if table is not None else []
if table is None:
    st.caption("Measure sensitivity above to choose by a model-level metric too.")
if state.choose_by not in model_options + local_options:
    state.choose_by = model_options[0] if model_options else DEFAULT_METRIC
state.choose_by = choose_by = ui.bound(
    st.selectbox,
    "Choose by",
    "effect_choose_by",
    state.choose_by,
    options=model_options + local_options,
    format_func=lambda m: (
        f"model: {labels.get(m.removeprefix(MODEL_METRIC_PREFIX))}"
        if m.startswith(MODEL_METRIC_PREFIX)
        else f"local: {METRIC_LABELS.get(m, m)}"
    ),
)
by_model = choose_by.startswith(MODEL_METRIC_PREFIX)
effect = table.effect if table is not None else None
picked = results.choose(analysis, choose_by, effect)
keys = list(picked)
sets, notes = [], []
with ui.guard("Building the choice sets"):
    sets.append(evaluate.float_set())
    current, _ = ws.choices()
    current = {k: v for k, v in current.items() if k in picked}
    if current:
        sets.append(evaluate.from_analysis(analysis, current, "your choices"))
    if "minmax" in analysis.config.observer_names:
        sets.append(evaluate.all_observer(analysis, "minmax", evaluate.ALL_MINMAX, keys))
    else:
        notes.append("min-max was not among the observers of this run, so there is no “all min-max” set.")
    sets.append(evaluate.best_local(analysis, DEFAULT_METRIC, keys))
    name = f"{BY_MODEL} ({choose_by.removeprefix(MODEL_METRIC_PREFIX)})" if by_model else f"chosen by {choose_by}"
    if picked:
        sets.append(evaluate.from_analysis(analysis, picked, name))
for note in notes:
    st.caption(note)
st.caption(f"{len(keys)} tensor(s) in each set: " + ", ".join(s.name for s in sets[1:]) + ".")
if analysis.config.gptq is not None:
    st.caption(
        "This run put its weights through GPTQ: each set's weights run as their observer's GPTQ weights "
        "(what Save checkpoint packs), not rounded to nearest."
    )
go_left, go_right = st.columns(2)
with go_left:
    if st.button("Evaluate end to end", icon=":material/play_arrow:", disabled=not keys):
        with ui.guard("Evaluating the choice sets"), st.spinner("Running the model with each choice set…"):
            with serving.heavy_slot():
                state.evaluations = [evaluator.evaluate(s) for s in sets]
with go_right:
    if by_model and picked and st.button("Use these choices on Choose & export", icon=":material/done_all:"):
        kept, refused = results.valid_choices(analysis, picked)
        ws.overrides = {**ws.overrides, **kept}
        st.success(f"{len(kept)} choice(s) set; the Choose & export page now shows them.")
if state.evaluations:
    rows = pd.DataFrame(evaluate.summary_rows(state.evaluations))
    st.dataframe(rows, hide_index=True)
    names = [e.name for e in state.evaluations]
    shown = metric if metric in state.evaluations[0].metrics else evaluator.default_metric
    with ui.guard("Drawing the evaluations"):
        values = [e.metrics[shown] for e in state.evaluations]
        st.plotly_chart(effect_plots.choice_set_bars(names, values, shown), theme="streamlit")
        curves = [e.block_sqnr_db for e in state.evaluations]
        st.plotly_chart(effect_plots.block_sqnr_figure(names, curves), theme="streamlit")
