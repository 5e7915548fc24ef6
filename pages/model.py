"""Model: choose the source, device and dtype, the layers, what to analyse and the calibration text."""

import streamlit as st

from lab import ui

SOURCES = {
    "minilm": "MiniLM sample (real encoder, offline)",
    "tiny-llama": "tiny-llama (built-in decoder sample)",
    "tiny-moe": "tiny-moe (built-in MoE sample)",
    "dir": "Local directory",
    "upload": "Upload a .safetensors file",
    "hub": "Hugging Face Hub id",
}

st.title("Model")
left, right = st.columns([2, 1])
with left:
    choice = ui.widget(st.radio, "Source", "source_kind", "minilm", options=list(SOURCES), format_func=SOURCES.get)
    source = choice
    if choice == "dir":
        source = ui.widget(st.text_input, "Directory (config.json + weights)", "source_dir", "").strip()
    elif choice == "hub":
        source = ui.widget(st.text_input, "Hub id (e.g. org/model)", "source_hub", "").strip()
    elif choice == "upload":
        upload = st.file_uploader("Weights file", type=["safetensors"], key="source_upload")
        source = ""
        if upload is not None:
            with ui.guard("Reading the upload"):
                source = str(ui.save_upload(upload.name, upload.getvalue()))
with right:
    gpu = ui.gpu_name()
    device = ui.widget(st.selectbox, "Device", "device", "auto", options=["auto", "cpu", "cuda"])
    st.caption(f"GPU: {gpu}" if gpu else "No GPU found: 'auto' runs on the CPU.")
    dtype = ui.widget(st.selectbox, "Weights dtype", "dtype", "fp32", options=["fp32", "bf16", "fp16"])

model = None
if source:
    request = ui.ModelRequest(source, device, dtype)
    with ui.guard(f"Opening {source!r}"):
        model = ui.open_shared_model(request.source, request.device, request.dtype)
        if st.session_state.get("model_request") != request:
            st.session_state["model_request"] = request
            ui.set_value("layers", ui.default_layer_names(model.layers()))
else:
    st.info("Enter a source to open.")
if model is None:
    st.stop()

st.caption(f"**{model.name}** on {model.device} in {str(model.dtype).removeprefix('torch.')}: {model.description}")

st.subheader("Layers")
text = ui.widget(st.text_input, "Filter (glob like `*.dense`, `re:` for a regex, or a word)", "layer_filter", "")
shown = []
with ui.guard("Filtering layers"):
    shown = model.layers(ui.layer_pattern(text))
    if not shown:
        st.error(f"No layer matches {text!r}. Try a shorter word, a glob like `*mlp*`, or clear the filter.")
all_names = {i.name for i in model.layers()}
st.dataframe(ui.layer_frame(shown), hide_index=True, height=240 if len(shown) > 6 else "auto")
pick_all, clear = st.columns([1, 1])
if pick_all.button(f"Select all {len(shown)} shown", disabled=not shown):
    ui.set_value("layers", list(dict.fromkeys(ui.current("layers", []) + [i.name for i in shown])))
if clear.button("Clear selection"):
    ui.set_value("layers", [])
selected = [n for n in ui.current("layers", []) if n in all_names]
ui.set_value("layers", selected)
options = list(dict.fromkeys([i.name for i in shown] + selected))
layers = ui.widget(st.multiselect, "Layers to analyse", "layers", selected, options=options)
st.caption(f"{len(layers)} layer(s) selected.")

st.subheader("What to analyse")
labels = {
    "weight": "Weights",
    "input": "Input activations",
    "output": "Output activations",
    "kv": "Key/value states (KV cache)",
}
for col, (kind, label) in zip(st.columns(len(labels)), labels.items(), strict=True):
    with col:
        disabled = kind != "weight" and not model.supports_activations
        ui.widget(st.checkbox, label, f"want_{kind}", kind in ("weight", "input"), disabled=disabled)
wants = ui.wanted_tensors(model)
if not model.supports_activations:
    st.info("This source has weights only (no architecture or tokenizer): activations cannot be captured.")
if wants["kv"]:
    blocks = []
    with ui.guard("Listing attention blocks"):
        blocks = model.attention_blocks()
    chosen_blocks = [n for n in ui.current("attention", blocks[:2]) if n in blocks]
    ui.set_value("attention", chosen_blocks)
    ui.widget(
        st.multiselect,
        "Attention blocks (keys and values per head, as the KV cache holds them)",
        "attention",
        chosen_blocks,
        options=blocks,
    )

if model.supports_activations and (wants["input"] or wants["output"] or wants["kv"]):
    st.subheader("Calibration")
    texts = ui.widget(st.radio, "Text", "calib_kind", "built-in", options=["built-in", "pasted"], horizontal=True)
    if texts == "pasted":
        ui.widget(st.text_area, "Calibration text", "calib_text", "", height=150)
    c1, c2 = st.columns(2)
    with c1:
        ui.widget(st.number_input, "Samples", "samples", 32, min_value=1, max_value=4096, step=1)
    with c2:
        ui.widget(st.number_input, "Sequence length (tokens)", "seq_len", 128, min_value=8, max_value=8192, step=8)

st.page_link("pages/run.py", label="Next: Run", icon=":material/play_arrow:")
