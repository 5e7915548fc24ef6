"""Model: choose the source, device and dtype, the layers, what to analyse and the calibration text."""

import streamlit as st

from lab import ui
from lab.settings import default_layer_names, layer_frame, layer_pattern, parse_bytes
from lab.workspace import ModelRequest

SOURCES = {
    "minilm": "MiniLM sample (real encoder, offline)",
    "tiny-llama": "tiny-llama (built-in decoder sample)",
    "tiny-moe": "tiny-moe (built-in MoE sample)",
    "dir": "Local directory",
    "upload": "Upload a .safetensors file",
    "hub": "Hugging Face Hub id",
}
BELOW_SOURCE = (
    "layer_filter",
    "layers",
    *(f"want_{kind}" for kind in ("weight", "input", "output", "kv")),
    "attention",
    "calib_kind",
    "calib_text",
    "samples",
    "seq_len",
    "capture_mode",
    "memory_budget",
)
CAPTURE_MODES = {"automatic": None, "whole model": False, "layer by layer": True}
CAPTURE_MODES_BY_VALUE = {value: name for name, value in CAPTURE_MODES.items()}
WHAT = {
    "weight": "Weights",
    "input": "Input activations",
    "output": "Output activations",
    "kv": "Key/value states (KV cache)",
}

st.title("Model")
ws = ui.workspace()
form, run = ws.form, ws.settings
left, right = st.columns([2, 1])
with left:
    form.kind = ui.bound(st.radio, "Source", "source_kind", form.kind, options=list(SOURCES), format_func=SOURCES.get)
    source = form.kind
    if form.kind == "dir":
        form.directory = ui.bound(st.text_input, "Directory (config.json + weights)", "source_dir", form.directory)
        source = form.directory.strip()
    elif form.kind == "hub":
        form.hub_id = ui.bound(st.text_input, "Hub id (e.g. org/model)", "source_hub", form.hub_id)
        source = form.hub_id.strip()
    elif form.kind == "upload":
        upload = st.file_uploader("Weights file", type=["safetensors"], key="source_upload")
        source = ""
        if upload is not None:
            with ui.guard(f"Reading {upload.name}"):
                source = str(ui.save_upload(upload.name, upload.getvalue()))
with right:
    gpu = ui.gpu_name()
    form.device = ui.bound(st.selectbox, "Device", "device", form.device, options=["auto", "cpu", "cuda"])
    st.caption(f"GPU: {gpu}" if gpu else "No GPU found: 'auto' runs on the CPU.")
    form.dtype = ui.bound(st.selectbox, "Weights dtype", "dtype", form.dtype, options=["fp32", "bf16", "fp16"])

model = None
if source:
    request = ModelRequest(source, form.device, form.dtype)
    with ui.guard(f"Opening {source!r}"):
        model = ui.open_request(request)
        if ws.choose_model(request, default_layer_names(model.layers())):
            ui.reseed("layers", "attention")
else:
    st.info("Enter a source to open.")
if model is None:
    # The widgets below are not drawn in this run: forget them, so that when a model opens they
    # show the workspace's values, not what the browser kept of them.
    ui.reseed(*BELOW_SOURCE)
    st.stop()

st.caption(f"**{model.name}** on {model.device} in {str(model.dtype).removeprefix('torch.')}: {model.description}")
stale = ws.stale_reason()
if stale:
    st.warning(stale)

st.subheader("Layers")
form.layer_filter = ui.bound(
    st.text_input, "Filter (glob like `*.dense`, `re:` for a regex, or a word)", "layer_filter", form.layer_filter
)
shown = []
with ui.guard("Filtering layers"):
    shown = model.layers(layer_pattern(form.layer_filter))
    if not shown:
        st.error(f"No layer matches {form.layer_filter!r}. Try a shorter word, a glob like `*mlp*`, or clear it.")
all_names = {i.name for i in model.layers()}
st.dataframe(layer_frame(shown), hide_index=True, height=240 if len(shown) > 6 else "auto")
pick_all, clear = st.columns([1, 1])
if pick_all.button(f"Select all {len(shown)} shown", disabled=not shown):
    ws.layers = list(dict.fromkeys(ws.layers + [i.name for i in shown]))
    ui.reseed("layers")
if clear.button("Clear selection"):
    ws.layers = []
    ui.reseed("layers")
ws.layers = [n for n in ws.layers if n in all_names]
options = list(dict.fromkeys([i.name for i in shown] + ws.layers))
ws.layers = ui.bound(st.multiselect, "Layers to analyse", "layers", ws.layers, options=options)
st.caption(f"{len(ws.layers)} layer(s) selected.")

st.subheader("What to analyse")
for col, (kind, label) in zip(st.columns(len(WHAT)), WHAT.items(), strict=True):
    with col:
        runs = kind == "weight" or model.supports_activations
        ticked = ui.bound(st.checkbox, label, f"want_{kind}", run.wants[kind], disabled=not runs)
        if runs:
            run.wants[kind] = ticked
if not model.supports_activations:
    st.info(model.weights_only_reason)
wants = ws.wants_for(model)
if wants["kv"]:
    with ui.guard("Listing attention blocks"):
        ws.attention = ui.bound(
            st.multiselect,
            "Attention blocks (keys and values per head, as the KV cache holds them)",
            "attention",
            ws.attention_for(model),
            options=model.attention_blocks(),
        )

if wants["input"] or wants["output"] or wants["kv"]:
    st.subheader("Calibration")
    texts = "built-in" if run.texts is None else "pasted"
    pasted = (
        ui.bound(st.radio, "Text", "calib_kind", texts, options=["built-in", "pasted"], horizontal=True) == "pasted"
    )
    if pasted:
        ws.pasted_text = ui.bound(st.text_area, "Calibration text", "calib_text", ws.pasted_text, height=150)
    run.texts = (ws.pasted_text,) if pasted else None
    c1, c2 = st.columns(2)
    with c1:
        run.samples = ui.bound(st.number_input, "Samples", "samples", run.samples, min_value=1, max_value=4096, step=1)
    with c2:
        run.seq_len = ui.bound(
            st.number_input, "Sequence length (tokens)", "seq_len", run.seq_len, min_value=8, max_value=8192, step=8
        )

    c3, c4 = st.columns(2)
    with c3:
        mode = ui.bound(
            st.radio,
            "Capture",
            "capture_mode",
            CAPTURE_MODES_BY_VALUE[run.sequential],
            options=list(CAPTURE_MODES),
            help="Layer by layer loads one block at a time (for models larger than memory); same activations.",
        )
        run.sequential = CAPTURE_MODES[mode]
    with c4:
        ws.view["memory_budget"] = ui.bound(
            st.text_input,
            "Memory budget (e.g. 8GB; empty: half of the free memory)",
            "memory_budget",
            ws.view.get("memory_budget", ""),
        )
        run.max_memory = None
        if ws.view["memory_budget"].strip():
            with ui.guard("Reading the memory budget"):
                run.max_memory = parse_bytes(ws.view["memory_budget"])

st.page_link("pages/run.py", label="Next: Run", icon=":material/play_arrow:")
