"""Run: format, granularity, presets, GPTQ and AWQ beside round-to-nearest, observers and their knobs;
the Run button with progress."""

import streamlit as st

import observers as ob
from lab import results, ui
from lab.awq import session as awq_session
from lab.awq.run import Step
from lab.settings import check_knobs
from lab.ui import history, serving
from observers.gptq import ACTORDER_ALIASES, SCALES

st.title("Run")
ws = ui.workspace()
run = ws.settings
awq = awq_session.state_of(ws)
model = None
with ui.guard("Opening the model"):
    model = ui.open_request(ws.request)
attention = []
with ui.guard("Listing attention blocks"):
    attention = ws.attention_for(model) if model is not None else []
if model is None or not (ws.layers or attention):
    st.info("Choose a model and at least one layer (or attention block) first.")
    st.page_link("pages/model.py", label="Go to Model", icon=":material/deployed_code:")
    st.stop()
scope = {"has_layers": bool(ws.layers), "has_attention": bool(attention), "can_capture": model.supports_activations}
kinds = run.kinds(**scope)
st.caption(
    f"**{model.name}** · {len(ws.layers)} layer(s), {len(attention)} attention block(s) · "
    f"analysing {', '.join(kinds) or 'nothing: tick what to analyse on the Model page'}"
)


GPTQ_DEFAULTS = ob.GPTQSpec()
ACTORDERS = list(dict.fromkeys(ACTORDER_ALIASES.values()))  # in our words; llm-compressor's are aliases


def _llm_compressor_word(order: str) -> str:
    aliases = [word for word, meaning in ACTORDER_ALIASES.items() if meaning == order and word != order]
    return f"{order} (llm-compressor: {aliases[0]})" if aliases else order


def _marked(label: str, is_default: bool) -> str:
    return f"{label} · default" if is_default else label


def gptq_knob_editor(knobs: ob.GPTQSpec) -> ob.GPTQSpec:
    """GPTQ's knobs (block size, dampening, activation order, scale semantics) as widgets; a
    choice that means what ``knobs`` already says keeps its spelling (``static`` stays ``static``)."""
    d = GPTQ_DEFAULTS
    st.caption(
        f"Defaults are llm-compressor 0.14's GPTQModifier: block {d.block_size}, dampening {d.dampening}, "
        f"activation order {d.actorder} (= {ACTORDER_ALIASES[d.actorder]}, its default even when the scheme says "
        f"none), {d.scales} scales."
    )
    left, right = st.columns(2)
    with left:
        block = ui.bound(
            st.number_input,
            "GPTQ block size (columns)",
            "gptq_block_size",
            knobs.block_size,
            min_value=1,
            step=1,
            help=f"Columns swept at once between the Hessian-wide updates (default {d.block_size}).",
        )
    with right:
        dampening = ui.bound(
            st.number_input,
            "Dampening (× mean of H's diagonal)",
            "gptq_dampening",
            float(knobs.dampening),
            min_value=0.0,
            step=0.005,
            format="%.4g",
            help=f"Added to the Hessian's diagonal before it is inverted (default {d.dampening}).",
        )
    order = ui.bound(
        st.radio,
        "GPTQ activation order",
        "gptq_actorder",
        ACTORDER_ALIASES[knobs.actorder],
        options=ACTORDERS,
        format_func=lambda o: _marked(_llm_compressor_word(o), o == ACTORDER_ALIASES[d.actorder]),
        horizontal=True,
        help="Sweep the columns by decreasing H diagonal. weight keeps each column's group scale; group forms "
        "groups of consecutive swept columns (GPTQModel's desc_act); none sweeps in column order.",
    )
    scales = ui.bound(
        st.radio,
        "Scale semantics",
        "gptq_scales",
        knobs.scales,
        options=list(SCALES),
        format_func=lambda s: _marked(s, s == d.scales),
        horizontal=True,
        help="fixed: llm-compressor 0.14, each group's scale from the original weight before the sweep (updated "
        "weights pushed past a shrunk range clip). refit: the GPTQ paper, AutoGPTQ and GPTQModel, each group's "
        "scale from the error-updated weights as the sweep reaches it.",
    )
    actorder = knobs.actorder if ACTORDER_ALIASES[knobs.actorder] == order else order
    return ob.GPTQSpec(block_size=int(block), dampening=float(dampening), actorder=actorder, scales=scales)


def gptq_refusal(gptq: ob.GPTQSpec | None) -> str | None:
    """Why GPTQ cannot run with these settings (None: it can, or it is off)."""
    if gptq is None:
        return None
    if "weight" not in kinds:
        return "GPTQ quantizes weights: tick Weights on the Model page."
    if not model.supports_activations:
        return f"GPTQ needs each layer's calibration inputs for its Hessian, and {model.name} holds weights only."
    try:
        spec = run.weight.spec()
    except ValueError:
        return None  # the weight format's own problem: the run says it
    try:
        ob.check_gptq_spec(spec, gptq.scales, ACTORDER_ALIASES[gptq.actorder])
    except ValueError as err:
        return f"{err}."
    return None


def awq_knob_editor(values: dict) -> None:
    """AWQ's knobs as widgets (``values`` updated in place), each one's default, bounds and help
    declared once, in the library (``ob.AWQ_KNOBS``)."""
    d = ob.AWQSpec()
    st.caption(
        f"Defaults are llm-compressor 0.14's AWQModifier ({d.n_grid} strengths, duo scaling {d.duo_scaling}) and "
        f"ModelOpt's awq_clip (each group's range shrunk to {d.clip_min} and up by {d.clip_step})."
    )
    ui.knob_widgets(ob.AWQ_KNOBS, values, "awq")


def awq_walk(config) -> tuple[awq_session.AWQWalk | None, str | None]:
    """AWQ's walk for the analysis's calibration pass to carry, with a progress bar of its own
    (the mapping being searched and its candidates judged, seconds), made inside the server's heavy-run
    slot (it records the held-out text's block calls); or, when AWQ refuses, the one line saying why."""
    bar, timer = st.progress(0.0, text="AWQ: recording the held-out text"), ui.Timer()

    def progress(step: Step) -> None:
        share = (step.number - 1 + step.done / max(step.total, 1)) / step.mappings
        where = f"mapping {step.number}/{step.mappings}, {step.done}/{step.total} candidates"
        bar.progress(share, text=f"AWQ: {where} · {timer.elapsed:.1f} s · {step.name}")

    try:
        with serving.heavy_slot(bar):
            return awq.walk(model, list(ws.layers), config, progress), None
    except ValueError as refused:
        bar.empty()
        return None, str(refused)


def awq_with_status(walk) -> None:
    """AWQ's results beside the analysis just made, in a status box: the walk rode the analysis's
    pass, or (a run read from another session or the server's recent results) walks a pass of its own."""
    with st.status("Searching AWQ's scales for each weight observer…", expanded=True) as status:
        try:
            with serving.heavy_slot():
                searched = awq.finish(model, ws.request, ws.analysis, walk)
        except Exception:
            status.update(label="AWQ did not run", state="error", expanded=False)
            raise
        status.update(label=f"AWQ done in {searched.seconds:.1f} s", state="complete", expanded=False)


def _apply_preset() -> None:
    run.apply_preset(st.session_state["w:preset"])
    ui.reseed_spec_editors()


run.preset = ui.bound(
    st.selectbox,
    "Preset",
    "preset",
    run.preset,
    options=["custom", *ob.PRESET_NAMES],
    on_change=_apply_preset,
    help="compressed-tensors schemes; choosing one fills in the formats below.",
)
weight_tab, act_tab, kv_tab = st.tabs(["Weights", "Activations (inputs and outputs)", "KV cache (keys, values)"])
with weight_tab:
    ui.spec_editor("weight", run.weight)
    run.actorder = ui.bound(
        st.checkbox,
        "Activation order for round-to-nearest (group columns by input importance, as GPTQ's actorder does)",
        "actorder",
        run.actorder,
        disabled=not run.actorder_applies,
    )
    gptq_on = ui.bound(
        st.toggle,
        "Also run GPTQ with each weight observer",
        "gptq",
        run.gptq is not None,
        help="Each weight observer's qparams go through GPTQ on its layer, with the Hessian of the layer's "
        "calibration inputs (captured even when only weights are analysed). The Error page shows every "
        "observer's layer-output error and clipped share under round-to-nearest and under GPTQ, and the "
        "ranking under each: most 4-bit models are made with GPTQ, where the ranking can turn over.",
    )
    if gptq_on:
        run.gptq_knobs = gptq_knob_editor(run.gptq_knobs)
    run.gptq = run.gptq_knobs if gptq_on else None
    gptq_problem = gptq_refusal(run.gptq)
    if gptq_problem:
        st.error(gptq_problem)
    awq.on = ui.bound(
        st.toggle,
        "Also run AWQ with each weight observer",
        "awq",
        awq.on,
        help="A decoder's smoothing scales searched four ways for each weight observer: round-to-nearest, "
        "llm-compressor's AWQ (memoryless min-max in the search, then the observer on the smoothed weights), the "
        "observer inside the search, and the joint clip search. The Error page compares the observers under each "
        "way on every balance layer's mapping; the Ranges page draws the smoothed weight with each one's range.",
    )
    if awq.on:
        awq_knob_editor(awq.knobs)
with act_tab:
    ui.spec_editor("act", run.act)
with kv_tab:
    if not attention:
        st.caption("Tick 'Key/value states' and choose attention blocks on the Model page to analyse them.")
    kv_labels = {"tensor": "tensor (one k_scale, one v_scale)", "channel": "per head (attn_head)"}
    ui.spec_editor("kv", run.kv, strategy_labels=kv_labels)

TRANSFORMS = {
    "none": "none: the model as it is",
    "hadamard": "Hadamard rotation (QuaRot / SpinQuant style)",
    "smoothquant": "SmoothQuant migration (needs captured inputs)",
}
picked = ui.bound(
    st.selectbox,
    "Also look through a transform",
    "transform",
    run.transform or "none",
    options=list(TRANSFORMS),
    format_func=TRANSFORMS.get,
    help="Runs the observers a second time on the tensors a rotated or smoothed model's layers see (the float "
    "layer output is the same); the Ranges page shows both. Exports keep the untransformed qparams.",
)
run.transform = None if picked == "none" else picked
if run.transform == "hadamard":
    run.transform_seed = ui.bound(st.number_input, "Rotation seed", "transform_seed", run.transform_seed, min_value=0)
elif run.transform == "smoothquant":
    run.smooth_alpha = ui.bound(
        st.slider, "SmoothQuant alpha", "smooth_alpha", run.smooth_alpha, min_value=0.0, max_value=1.0, step=0.05
    )
awq_problem = awq.refusal(run, kinds, model)  # after the transform, which it is judged with
if awq_problem:
    st.error(awq_problem)

run.propagate = ui.bound(
    st.checkbox,
    "Calibrate each block behind the quantized blocks before it (propagation)",
    "propagate",
    run.propagate,
    help="llm-compressor's sequential pipeline default: block i+1 sees block i's outputs with its chosen "
    "tensors fake-quantized, as a deployed model feeds it. Runs layer by layer; the Ranges page shows each "
    "activation range both ways, and exports take the propagated choice.",
)

TOOLS = ["llm-compressor", "modelopt", "quark", "torch.ao"]
run.tools = tuple(
    ui.bound(
        st.multiselect,
        "Also show what each tool would produce by default",
        "as_tools",
        list(run.tools),
        options=TOOLS,
        help="Each tool's default observer, knobs and conventions (scale rule, MX rounding, eps, narrow range) "
        "for these formats, run beside the observers; the Ranges page draws them. Shown, never exported.",
    )
)

st.subheader("Observers")
names = list(ob.available())
applicable = run.default_observers(**scope)
chosen = ui.bound(
    st.multiselect,
    "Observers to run",
    "observers",
    list(run.observers or applicable),
    options=names,
    help="By default every observer that applies to each tensor's format runs; observers tuned for another "
    "format (the NVFP4 expanded searches) and those that do not take it run only when chosen here.",
)
run.observers = None if chosen == applicable else tuple(chosen)
for name in chosen:
    with st.expander(f"{name}: {ob.available()[name]}"):
        ui.knob_editor(name, run.knobs.setdefault(name, {}))
problems = check_knobs({name: run.knobs.get(name, {}) for name in chosen})
for problem in problems:
    st.error(f"Knob {problem}")

blocked = (
    "tick what to analyse on the Model page" if not kinds else "choose at least one observer" if not chosen else ""
)
if problems:
    blocked = "fix the knob values above"
if gptq_problem:
    blocked = "GPTQ cannot run with these settings (the Weights tab says why)"
if awq_problem:
    blocked = "AWQ cannot run with these settings (said above)"
if ws.calibration.problem and (run.calibrates(**scope) or run.gptq is not None or awq.on):
    blocked = f"the calibration set on the Model page cannot be used ({ws.calibration.problem})"
if st.button("Run", type="primary", disabled=bool(blocked), help=blocked or None):
    awq.result = None
    with ui.guard("The run"):
        config = run.config(**scope)
        walk, refused = awq_walk(config) if awq.on else (None, None)
        ui.run_with_status(ws, model, config, attention, walk)
        if walk is not None:
            awq_with_status(walk)
        if refused:
            st.error(ui.plain(f"{refused}."))
elif blocked:
    st.caption(f"Run is off: {blocked}.")

outcome = ws.last_run
if outcome is not None:
    analysis = outcome.analysis
    st.success(
        f"Results for {len(analysis.entries)} tensors × {len(analysis.config.observer_names)} observers "
        f"in {analysis.seconds:.1f} s ({ui.run_summary(outcome)})."
    )
    st.caption(ui.plain(history.run_by(ws)) + (" The Runs page lists it for the team." if outcome.kept else ""))
    calibrated = ws.calibration_line(analysis)
    if calibrated:
        st.caption(ui.plain(calibrated))
    shortfall = ws.calibration_shortfall(analysis)
    if shortfall:
        st.warning(f"{shortfall[:1].upper()}{shortfall[1:]}.")
    for note in dict.fromkeys(outcome.warnings + results.token_warnings(analysis)):
        if note != shortfall:
            st.warning(note)
    searched = awq.shown_with(analysis)
    if searched is not None:
        st.success(f"AWQ: {searched.summary()}. The Error and Ranges pages show each balance layer's mapping.")
        for line in searched.run.left_out:
            st.caption(ui.plain(f"Left out of AWQ: {line}"))
    failed = results.error_table(analysis).dropna(subset=["error"])
    if not failed.empty:
        st.warning(
            f"{len(failed)} observer result(s) are not available for this format or tensor: "
            f"{', '.join(sorted(set(failed['observer'])))}. The table below says why."
        )
        with st.expander("Why each is missing"):
            st.dataframe(failed[["layer", "tensor", "observer", "error"]], hide_index=True)
    cols = st.columns(4)
    cols[0].page_link("pages/overview.py", label="Overview", icon=":material/grid_view:")
    cols[1].page_link("pages/ranges.py", label="Ranges", icon=":material/straighten:")
    cols[2].page_link("pages/scales.py", label="Scales", icon=":material/grid_on:")
    cols[3].page_link("pages/error.py", label="Error", icon=":material/query_stats:")
