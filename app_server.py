"""The server ``python -m lab.serve`` (``bash scripts/app.sh``) runs: ``app.py`` as Streamlit's ASGI
``st.App``, every request first through the sign-in of the server's ``--auth``
(``lab.serve.access``: a token, an OIDC sign-in with an allow-list, or none on loopback). When it
listens it prints the address to open. Streamlit's own flags (address, port, TLS certificate) apply
as to ``streamlit run app.py``; the app's flags come after ``--``.
"""

import sys

import streamlit as st
from starlette.middleware import Middleware

from lab.serve.access import AccessMiddleware, Gate
from lab.serve.config import ServeConfig, ServeConfigError
from lab.ui import access

try:
    config, _ = ServeConfig.parse(sys.argv[1:])
    gate = Gate.of(config)
except ServeConfigError as err:
    access.refuse_startup(str(err))
gated = Middleware(AccessMiddleware, gate=gate, user_of=access.signed_in_user, login_url=access.login_url)
app = st.App("app.py", middleware=[gated], lifespan=access.announcer(gate))
