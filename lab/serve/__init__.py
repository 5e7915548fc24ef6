"""Serving the app to a team: what the person starting the server declares (``config``), where a
browser may read and write (``roots``), analyses shared between sessions (``shared_runs``) and the
launcher (``python -m lab.serve``, what ``scripts/app.sh`` runs).

Nothing here imports streamlit: the app (``lab.ui``, ``pages/``) calls these rules, and tests check
them without a browser. The CLI does not go through them: the person at the shell owns the machine.
"""
