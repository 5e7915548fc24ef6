"""Run: format, granularity, presets, observers and their knobs; the Run button with progress."""

import streamlit as st

import observers as ob
from lab import ui
from lab.pipeline import RunConfig

st.title("Run")
model = None
with ui.guard("Opening the model"):
    model = ui.current_model()
layers = st.session_state.get("layers", [])
attention = [] if model is None else ui.attention_choice(model)
if model is None or not (layers or attention):
    st.info("Choose a model and at least one layer (or attention block) first.")
    st.page_link("pages/model.py", label="Go to Model", icon=":material/deployed_code:")
    st.stop()
wants = ui.wanted_tensors(model)
wants["kv"] = bool(attention)
if not layers:
    wants["weight"] = wants["input"] = wants["output"] = False
kinds = [kind for kind, wanted in wants.items() if wanted]
st.caption(
    f"**{model.name}** · {len(layers)} layer(s), {len(attention)} attention block(s) · "
    f"analysing {', '.join(kinds) or 'nothing'}"
)

ui.widget(
    st.selectbox,
    "Preset",
    "preset",
    "custom",
    options=["custom", *ob.PRESET_NAMES],
    on_change=ui.apply_preset,
    help="compressed-tensors schemes; choosing one fills in the formats below.",
)
weight_tab, act_tab, kv_tab = st.tabs(["Weights", "Activations (inputs and outputs)", "KV cache (keys, values)"])
with weight_tab:
    weight_settings = ui.spec_editor("weight", ui.WEIGHT_STRATEGIES, ui.SpecSettings())
    actorder = ui.widget(
        st.checkbox,
        "Activation order (group columns by input importance, GPTQ actorder)",
        "actorder",
        False,
        disabled=weight_settings.strategy != "group" or not wants["input"],
    )
with act_tab:
    act_settings = ui.spec_editor("act", ui.ACTIVATION_STRATEGIES, ui.SpecSettings())
with kv_tab:
    if not attention:
        st.caption("Tick 'Key/value states' and choose attention blocks on the Model page to analyse them.")
    kv_settings = ui.spec_editor(
        "kv",
        ui.KV_STRATEGIES,
        ui.SpecSettings(dtype="fp8_e4m3"),
        dtypes=ui.kv_dtype_options(),
        strategy_labels={"tensor": "tensor (one k_scale, one v_scale)", "channel": "per head (attn_head)"},
    )

st.subheader("Observers")
names = list(ob.available())
chosen = ui.widget(st.multiselect, "Observers to run", "observers", names, options=names)
knob_values = {}
for name in chosen:
    with st.expander(f"{name}: {ob.available()[name]}"):
        knob_values[name] = ui.knob_editor(name)

if st.button("Run", type="primary", disabled=not kinds or not chosen):
    with ui.guard("The run"):
        specs = {}
        if wants["weight"]:
            specs["weight"] = weight_settings.spec()
        for kind in ("input", "output"):
            if wants[kind]:
                specs[kind] = act_settings.spec()
        if wants["kv"]:
            specs["kv"] = kv_settings.spec()
        config = RunConfig(
            specs=specs,
            observers=tuple(chosen),
            knobs=ui.knob_overrides(knob_values),
            samples=int(st.session_state.get("samples", 32)),
            seq_len=int(st.session_state.get("seq_len", 128)),
            texts=ui.calibration_texts(),
            actorder=bool(actorder and wants["input"] and weight_settings.strategy == "group"),
        )
        outcome = ui.run_with_status(model, layers, config, attention)
        st.session_state[ui.ANALYSIS] = outcome.analysis
        st.session_state[ui.LAST_RUN] = outcome
        st.session_state.pop(ui.CHOICES, None)

outcome = st.session_state.get(ui.LAST_RUN)
if outcome is not None:
    analysis = outcome.analysis
    st.success(
        f"Results for {len(analysis.entries)} tensors × {len(analysis.config.observer_names)} observers "
        f"in {analysis.seconds:.1f} s ({outcome.misses} computed, {outcome.hits} reused)."
    )
    for note in outcome.warnings + ui.token_warnings(analysis):
        st.warning(note)
    failed = ui.error_table(analysis).dropna(subset=["error"])
    if not failed.empty:
        with st.expander(f"{len(failed)} observer result(s) not available for this format or tensor"):
            st.dataframe(failed[["layer", "tensor", "observer", "error"]], hide_index=True)
    cols = st.columns(4)
    cols[0].page_link("pages/overview.py", label="Overview", icon=":material/grid_view:")
    cols[1].page_link("pages/ranges.py", label="Ranges", icon=":material/straighten:")
    cols[2].page_link("pages/scales.py", label="Scales", icon=":material/grid_on:")
    cols[3].page_link("pages/error.py", label="Error", icon=":material/query_stats:")
