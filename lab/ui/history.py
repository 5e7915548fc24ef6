"""The team's run history as the app draws it (``lab.history`` holds the rules): opening a kept run
into the session, as if it had just run, from the Runs page or from a link (``?run=ID``), and the
link itself."""

from __future__ import annotations

from typing import Any

import streamlit as st
import torch

from lab import provenance, ui
from lab.history.run_file import KeptRun, WeightOf
from lab.serve import roots
from lab.ui import serving
from lab.workspace import ModelRequest, RunOutcome, Workspace

RUN_PARAM = "run"
"""The query parameter of a run's link: ``/?run=20261127-070905-a1b2c3``."""


def weight_reader(request: dict[str, Any]) -> WeightOf:
    """Reads a layer's weight from a kept run's model when a page asks for it: the model is opened
    then (once per process, shared), so a run opens at once and a page that needs no weight never
    opens it. Its source is held to the server's roots as one typed on the Model page is."""
    asked = ModelRequest(**request)

    def weight_of(layer: str) -> torch.Tensor:
        source = roots.model_source(asked.source, serving.served())
        return ui.open_shared_model(source, asked.device, asked.dtype).weight(layer)

    return weight_of


@st.cache_resource(show_spinner="Reading the kept run…", max_entries=4)
def kept_run(run_id: str) -> KeptRun:
    """The kept run ``run_id`` read from disk once per process and shared read-only, as a run
    another session computed is (a link followed by a team opens it once)."""
    history = serving.history()
    return history.open(run_id, weight_reader(history.get(run_id).request))


def open_run(ws: Workspace, run_id: str) -> RunOutcome:
    """Show the kept run ``run_id`` in this session, every page as if it had just run; the widgets
    then show its settings."""
    record = serving.history().get(run_id)
    outcome = ws.open_kept(kept_run(run_id), record)
    ui.reseed_all()
    return outcome


def open_link(ws: Workspace) -> None:
    """Open the run a link names (``?run=ID``) once per link a session follows; a run the history
    no longer has, or never had, is said in one line."""
    run_id = st.query_params.get(RUN_PARAM)
    if not run_id or ws.view.get("link") == run_id:
        return
    ws.view["link"] = run_id
    with ui.guard(f"Opening run {run_id}"):
        record = open_run(ws, run_id).kept
        st.toast(f"Opened run {record.id}, asked for by {record.who}.", icon=":material/history:")


def run_link(run_id: str) -> str:
    """The address that opens run ``run_id`` for whoever follows it (once signed in)."""
    base = str(st.context.url or "").split("?")[0].rstrip("/")
    page = base.rsplit("/", 1)[0] if base.endswith("/runs") else base
    return f"{page}/?{RUN_PARAM}={run_id}"


def made_by(ws: Workspace) -> dict[str, Any]:
    """The ``provenance`` of a file this session exports now: who asks, and the kept run its
    results came from (``lab.provenance.made_by``)."""
    kept = ws.last_run.kept if ws.last_run is not None else None
    return provenance.made_by(ws.who, None if kept is None else kept.provenance())


def run_by(ws: Workspace) -> str:
    """``Run asked for by alice@example.com on 2026-11-27T07:09:05+00:00 (run 20261127-070905-a1b2c3).``,
    or that the results are in no history."""
    kept = ws.last_run.kept if ws.last_run is not None else None
    if kept is None:
        return "These results are this session's only: they are not in the team's run history."
    return f"Run asked for by {kept.who} on {kept.when} (run {kept.id})."
