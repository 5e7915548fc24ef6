"""Observer Lab: the Streamlit app. Run with ``streamlit run app.py``.

This file sets up the page, the session's one ``Workspace`` (``lab.ui.workspace``) and the
navigation; each page lives in ``pages/`` and reads and writes that workspace.
"""

import streamlit as st

from lab import ui

st.set_page_config(page_title="Observer Lab", page_icon="🔭", layout="wide")
ui.workspace()

PAGES = [
    st.Page("pages/overview.py", title="Overview", icon=":material/grid_view:", default=True),
    st.Page("pages/model.py", title="Model", icon=":material/deployed_code:"),
    st.Page("pages/run.py", title="Run", icon=":material/play_arrow:"),
    st.Page("pages/ranges.py", title="Ranges", icon=":material/straighten:"),
    st.Page("pages/scales.py", title="Scales", icon=":material/grid_on:"),
    st.Page("pages/error.py", title="Error", icon=":material/query_stats:"),
    st.Page("pages/export.py", title="Choose & export", icon=":material/download:"),
    st.Page("pages/effect.py", title="Model effect", icon=":material/model_training:"),
]

st.navigation(PAGES).run()
