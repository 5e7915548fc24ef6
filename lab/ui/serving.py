"""Serving a team, as the app draws it: the server's declared settings, shared runs and run
history (one per process), the heavy-run slot, the roots a page names, and the end of a session
(its workspace released once the browser is gone past Streamlit's reconnect window). The rules
live in ``lab.serve`` and ``lab.history``; this module binds them to Streamlit's process and
sessions."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import streamlit as st
from streamlit import runtime

from lab.history.store import HISTORY_DIR, History
from lab.serve import roots
from lab.serve.config import ServeConfig
from lab.serve.session_runs import Keep
from lab.serve.shared_runs import SharedRuns
from lab.workspace import Workspace


@st.cache_resource(show_spinner=False)
def served() -> ServeConfig:
    """The server's declared roots and limits (``lab.serve.config``): ``app.py``'s flags after ``--``."""
    config, _ = ServeConfig.parse(sys.argv[1:])
    return config


@st.cache_resource(show_spinner=False)
def shared_runs() -> SharedRuns:
    """The server's one queue and cache of runs, shared by every session (``lab.serve.shared_runs``)."""
    config = served()
    return SharedRuns(config.shared_cache_bytes, config.heavy_runs)


@st.cache_resource(show_spinner=False)
def history() -> History:
    """The server's run history: ``<output root>/runs``, the newest ``--history-size`` runs within
    ``--history-bytes``."""
    config = served()
    return History(config.output_root / HISTORY_DIR, config.history_size, config.history_bytes)


def keeper(ws: Workspace) -> Keep | None:
    """How a run the session computes is kept in the history: as asked for by ``ws.who``. None for
    a model opened from the session's own upload: that upload is the session's alone, and so are
    its results."""
    if ws.request is None or ws.uploads.owns(ws.request.source):
        return None
    return partial(history().record, who=ws.who)


@contextmanager
def heavy_slot(bar: Any = None) -> Iterator[None]:
    """Hold one of the server's heavy-run slots (an evaluation, a checkpoint write) while the block
    runs; while it waits, ``bar`` (an ``st.progress``) or a caption says for how many runs."""
    shown = st.empty() if bar is None else bar
    say = shown.caption if bar is None else partial(bar.progress, 0.0)
    with shared_runs().slot(lambda line: say(f"{line[:1].upper()}{line[1:]}…")):
        if bar is None:
            shown.empty()  # the wait is over
        yield


def roots_caption(*kinds: str) -> None:
    """A caption naming the roots of ``kinds`` (``data``, ``models``, ``output``) this server serves."""
    shown = served().describe()
    labels = {"data": "Data roots", "models": "Model roots", "output": "Output root"}
    st.caption(" · ".join(f"{labels[kind]}: `{shown[kind]}`" for kind in kinds) + " (set when the server starts).")


def checkpoint_request(key: str, placeholder: str) -> tuple[str, bool] | None:
    """The Save checkpoint form: a directory (under the output root) and whether to replace a
    checkpoint the lab wrote there; ``(directory, overwrite)`` when Save is pressed."""
    directory = st.text_input("Checkpoint directory", placeholder=placeholder, key=f"{key}_dir")
    roots_caption("output")
    overwrite = st.checkbox(
        "Replace it if it is not empty",
        key=f"{key}_overwrite",
        help="Replaces only a checkpoint this lab wrote there before; any other directory is left alone.",
    )
    pressed = st.button("Save checkpoint", icon=":material/save:", disabled=not directory.strip())
    return (directory, overwrite) if pressed else None


def save_checkpoint(directory: str, overwrite: bool, write: Callable[[Path, Callable], Any]) -> None:
    """Write a checkpoint where a browser asked, only inside the output root and replacing only what
    the lab wrote (``roots.checkpoint_dir``): ``write(target, progress)`` returns what
    ``lab.export.checkpoint.write`` does; it runs in the heavy-run slot with a progress bar."""
    target = roots.checkpoint_dir(directory, served(), overwrite)
    bar = st.progress(0.0, text="Writing the weight files…")
    with heavy_slot(bar):
        saved = write(target, lambda done, total, key: bar.progress(done / total, text=f"{key} ({done}/{total})"))
    st.success(f"Saved {len(saved.packed_layers)} packed layer(s) to {saved.path}.")
    with st.expander(f"{len(saved.notes)} note(s) on the checkpoint"):
        for note in saved.notes:
            st.write(f"- {note}")


def _session_left(watched: tuple[str, Workspace]) -> None:
    """When a browser disconnects: past Streamlit's reconnect window, release the session's
    workspace (uploads, analyses, memory) unless it came back."""

    def release_if_gone() -> None:
        if not (runtime.exists() and runtime.get_instance().is_active_session(watched[0])):
            watched[1].release()

    timer = threading.Timer(float(st.get_option("server.disconnectedSessionTTL")) + 1.0, release_if_gone)
    timer.daemon = True
    timer.start()


@st.cache_resource(scope="session", on_release=_session_left, show_spinner=False)
def watch_session(session_id: str, _ws: Workspace) -> tuple[str, Workspace]:
    """A session-scoped resource whose release (Streamlit's, on disconnect) starts ``_session_left``."""
    return session_id, _ws
