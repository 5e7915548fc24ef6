"""Model: choose the source, device and dtype, the layers, what to analyse and the calibration text."""

import streamlit as st

from lab import ui
from lab.serve import roots
from lab.serve.config import MAX_UPLOAD_MB
from lab.settings import CALIBRATION_KINDS, default_layer_names, layer_frame, layer_pattern, parse_bytes
from lab.ui import serving
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
    "calib_path",
    "calib_hub",
    "calib_split",
    "calib_column",
    "calib_seed",
    "samples",
    "seq_len",
    "batch_size",
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

PREVIEW_CHARS = 2000


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def show_calibration_set(check) -> None:
    """What the chosen calibration set holds and what the run will take of it: usable records and
    rows, the column read, the samples and tokens, the shortfall, and its first records."""
    found = check.preview
    st.markdown("**Preview**")
    cols = st.columns(4)
    cols[0].metric("Usable records", f"{found['records']:,}")
    cols[1].metric("Rows", f"{found['rows']:,}")
    cols[2].metric("Samples used", "–" if check.error else f"{check.samples:,}")
    cols[3].metric("Tokens", "–" if check.error else f"{check.tokens:,}")
    read = f"`{found['column']}`"
    if found["chat"]:
        read = f"the chat column {read} (rendered with the model's chat template)"
    order = "in file order" if found["order"] == "file" else found["order"]
    st.caption(
        f"Columns: {', '.join(f'`{c}`' for c in found['columns'])} · reading {read}, {order} · "
        "each record is one sample, truncated to the sequence length."
    )
    if check.error:
        st.error(f"Calibration set: {check.error}")
    if check.shortfall:
        st.warning(f"{sentence(check.shortfall)}.")
    for number, text in enumerate(found["texts"], 1):
        head = " ".join(text.split())
        with st.expander(f"Record {number}: {ui.plain(head[:80])}{'…' if len(head) > 80 else ''}"):
            st.text(text[:PREVIEW_CHARS] + ("…" if len(text) > PREVIEW_CHARS else ""))


st.title("Model")
ws = ui.workspace()
served = serving.served()
form, run = ws.form, ws.settings
left, right = st.columns([2, 1])
with left:
    form.kind = ui.bound(st.radio, "Source", "source_kind", form.kind, options=list(SOURCES), format_func=SOURCES.get)
    source = form.kind
    if form.kind == "dir":
        form.directory = ui.bound(st.text_input, "Directory (config.json + weights)", "source_dir", form.directory)
        serving.roots_caption("models")
        source = ""
        if form.directory.strip():
            with ui.guard("Opening the directory"):
                source = str(roots.model_path(form.directory, served))
    elif form.kind == "hub":
        form.hub_id = ui.bound(st.text_input, "Hub id (e.g. org/model)", "source_hub", form.hub_id)
        if not served.hub_allowed:
            st.caption("This server runs offline (HF_HUB_OFFLINE=1): hub ids are refused.")
        source = ""
        if form.hub_id.strip():
            with ui.guard("Opening the hub id"):
                source = roots.hub_id(form.hub_id, served)
    elif form.kind == "upload":
        upload = st.file_uploader(f"Weights file (up to {MAX_UPLOAD_MB} MB)", type=["safetensors"], key="source_upload")
        source = ""
        if upload is not None:
            with ui.guard(f"Reading {upload.name}"):
                source = str(ws.save_model_upload(upload.name, upload.getvalue()))
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
    calib = ws.calibration
    calib.kind = ui.bound(
        st.radio, "Calibration set", "calib_kind", calib.kind, options=list(CALIBRATION_KINDS), horizontal=True
    )
    if calib.kind == "pasted":
        ws.pasted_text = ui.bound(st.text_area, "Calibration text", "calib_text", ws.pasted_text, height=150)
    elif calib.kind == "uploaded file":
        ui.calibration_upload(ws)
    elif calib.kind in ("local path", "hub id"):
        c1, c2 = st.columns([3, 1])
        with c1:
            if calib.kind == "local path":
                label = "File (.txt, .jsonl, .json, .csv, .parquet) or save_to_disk directory"
                calib.path = ui.bound(st.text_input, label, "calib_path", calib.path)
                serving.roots_caption("data")
            else:
                calib.hub_id = ui.bound(st.text_input, "Hub dataset id (e.g. org/dataset)", "calib_hub", calib.hub_id)
        with c2:
            split_help = "The split to read: of a hub dataset, or of a directory holding several (a DatasetDict)."
            calib.split = ui.bound(st.text_input, "Split", "calib_split", calib.split, help=split_help)
        if calib.kind == "hub id" and served.hub_allowed:
            st.caption("Read from the Hugging Face Hub: this needs the network (datasets keeps a copy in its cache).")
        elif calib.kind == "hub id":
            st.caption("This server runs offline (HF_HUB_OFFLINE=1): hub dataset ids are refused.")
    if calib.reads_dataset:
        c1, c2 = st.columns(2)
        with c1:
            calib.text_column = ui.bound(
                st.text_input,
                "Text column",
                "calib_column",
                calib.text_column,
                help="The column holding each record's text. When the data has no such column, a chat "
                "`messages` column (a list of {role, content}) is rendered with the model's chat template.",
            )
        with c2:
            calib.shuffle_seed = ui.bound(
                st.text_input,
                "Shuffle seed (empty: file order)",
                "calib_seed",
                calib.shuffle_seed,
                help="Shuffle the records with this seed before the first samples are taken, as "
                "llm-compressor's examples do (`dataset.shuffle(seed=...)`).",
            )
    run.texts = (ws.pasted_text,) if calib.kind == "pasted" else None

    c1, c2, c3 = st.columns(3)
    with c1:
        run.samples = ui.bound(st.number_input, "Samples", "samples", run.samples, min_value=1, max_value=4096, step=1)
    with c2:
        run.seq_len = ui.bound(
            st.number_input, "Sequence length (tokens)", "seq_len", run.seq_len, min_value=8, max_value=8192, step=8
        )
    with c3:
        run.batch_size = ui.bound(
            st.number_input,
            "Batch size",
            "batch_size",
            run.batch_size,
            min_value=1,
            max_value=256,
            step=1,
            help="Samples per forward pass: the batches the observers see one by one (a moving average "
            "updates once per batch). llm-compressor calibrates with batches of 1.",
        )

    run.dataset = None
    calib.problem = None
    if calib.reads_dataset:
        with st.spinner("Reading the calibration set…"):
            check = ws.check_calibration(model, int(run.samples), int(run.seq_len), served)
        run.dataset = check.source if check.error is None else None
        if check.preview is not None:
            with st.container(border=True):
                show_calibration_set(check)
        elif calib.location():
            st.error(f"Calibration set: {check.error}")
        else:
            st.info(f"{sentence(check.error)}.")

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
