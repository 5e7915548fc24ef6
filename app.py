"""Observer Lab: the Streamlit app. Run with ``bash scripts/app.sh`` (``python -m lab.serve``, which
checks what the server is started with and runs ``streamlit run app_server.py -- <the app's flags>``:
this app behind the sign-in, ``app_server.py``).

This file sets up the page, the server's declared settings (``lab.ui.served``), the session's one
``Workspace`` (``lab.ui.workspace``), who it is signed in as (``lab.ui.access``), the kept run a
link names (``?run=ID``, ``lab.ui.history``) and the navigation; each page lives in ``pages/`` and
reads and writes that workspace.
"""

import streamlit as st

from lab import ui
from lab.serve.config import ServeConfigError
from lab.ui import access, history, serving

st.set_page_config(page_title="Observer Lab", page_icon="🔭", layout="wide")
try:
    served = serving.served()
except ServeConfigError as err:
    st.error(f"This server cannot serve the app: {err}.")
    st.stop()
ws = ui.workspace()
ws.who = access.who(served)
access.sidebar(served.auth, ws.who)
history.open_link(ws)

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/grid_view:", default=True),
    st.Page("pages/model.py", title="Model", icon=":material/deployed_code:"),
    st.Page("pages/run.py", title="Run", icon=":material/play_arrow:"),
    st.Page("pages/ranges.py", title="Ranges", icon=":material/straighten:"),
    st.Page("pages/scales.py", title="Scales", icon=":material/grid_on:"),
    st.Page("pages/error.py", title="Error", icon=":material/query_stats:"),
    st.Page("pages/export.py", title="Choose & export", icon=":material/download:"),
    st.Page("pages/effect.py", title="Model effect", icon=":material/model_training:"),
    st.Page("pages/allocate.py", title="Allocate", icon=":material/tune:"),
    st.Page("pages/runs.py", title="Runs", icon=":material/history:"),
]

st.navigation(PAGES).run()
