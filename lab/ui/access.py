"""The sign-in of a served lab bound to Streamlit (``lab.serve.access`` holds the rules): reading the
person Streamlit's OIDC sign-in cookie names, the address of its sign-in route, the line the server
prints when it starts (with its token), and who the session is, for the run records: under a token
file of named people, the person whose token the session's cookie was made from.

Streamlit's own machinery does the OIDC work: ``st.login``'s routes (``/auth/login``,
``/oauth2callback``) sign a person in with the provider of ``.streamlit/secrets.toml`` ``[auth]``
and leave a cookie signed with its ``cookie_secret``; the middleware reads it here, with the same
functions Streamlit reads it with for ``st.user``.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any

import streamlit as st

from lab.serve.access import TOKEN_PARAM, Gate, is_loopback
from lab.serve.config import Auth, ServeConfig
from lab.serve.tokens import UNNAMED


def signed_in_user(cookies: Mapping[str, str], headers: Mapping[str, str]) -> dict[str, Any] | None:
    """The claims in Streamlit's signed user cookie (``is_logged_in``, ``email``, ...), checked as
    Streamlit checks it (its signature with the ``cookie_secret``, its origin with the configured
    ``redirect_uri``'s); None when there is none or it does not hold."""
    from streamlit.auth_util import get_cookie_with_chunks, get_origin_from_redirect_uri
    from streamlit.web.server.server_util import get_cookie_secret
    from streamlit.web.server.starlette.starlette_app_utils import decode_signed_value
    from streamlit.web.server.starlette.starlette_server_config import USER_COOKIE_NAME

    secret = get_cookie_secret()

    def single(name: str) -> bytes | None:
        value = cookies.get(name)
        return None if value is None else decode_signed_value(secret, name, value.encode("latin-1"))

    raw = get_cookie_with_chunks(single, USER_COOKIE_NAME)
    if raw is None:
        return None
    try:
        claims = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(claims, dict) or claims.get("origin") != get_origin_from_redirect_uri():
        return None
    return claims


def login_url() -> str:
    """Where the sign-in page sends a person: Streamlit's login route for the ``[auth]`` provider."""
    from streamlit.auth_util import encode_provider_token

    return f"/auth/login?provider={encode_provider_token('default')}"


def announcer(gate: Gate) -> Callable[[Any], Any]:
    """``st.App``'s lifespan: once the server listens, one line with the address to open (with the
    token, as Jupyter prints it), so ``scripts/app.sh`` says where to go."""

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        print(start_line(gate), flush=True)
        yield

    return lifespan


def start_line(gate: Gate) -> str:
    """``Observer Lab: open http://127.0.0.1:8501/?token=...`` for the server's address and port."""
    from streamlit import config

    address = (config.get_option("server.address") or "").strip()
    port = config.get_option("server.port")
    scheme = "https" if config.get_option("server.sslCertFile") else "http"
    if address in ("", "0.0.0.0", "::"):  # every interface: the machine's name, and this machine
        hosts = [socket.gethostname(), "127.0.0.1"]
    else:
        hosts = ["127.0.0.1"] if is_loopback(address) else [address]
    query = f"/?{TOKEN_PARAM}={gate.token}" if gate.auth == Auth.TOKEN else "/"
    how = {Auth.TOKEN: "", Auth.OIDC: " (sign in with your provider)", Auth.NONE: " (no sign-in: loopback only)"}
    if gate.auth == Auth.TOKEN and not gate.token:  # one token a person: none of them in a log
        query = f"/?{TOKEN_PARAM}=YOUR-TOKEN"
        how[Auth.TOKEN] = f" (each of the {len(gate.people)} people of the token file with their own token)"
    return "Observer Lab: open " + " or ".join(f"{scheme}://{host}:{port}{query}" for host in hosts) + how[gate.auth]


@lru_cache(maxsize=8)
def _gate(config: ServeConfig) -> Gate:
    """The gate of ``config``, read once per process (as the server's middleware reads it once)."""
    return Gate.of(config)


def who(config: ServeConfig) -> str:
    """Who this session is, for the run records: the signed-in email under OIDC, the person whose
    token signed the session in under a token file of named people, else how the server let it in
    (``token``, ``none``)."""
    if config.auth == Auth.OIDC and st.user.is_logged_in:
        return str(st.user.get("email") or "signed in")
    if config.auth == Auth.TOKEN and config.token_file is not None:
        return _gate(config).signed_in_as(st.context.cookies) or config.auth.value
    return config.auth.value


def sidebar(auth: Auth, name: str = UNNAMED) -> None:
    """The sidebar's line on who this session is signed in as (``name``, from ``who``), and, under
    OIDC, the way out."""
    if auth == Auth.OIDC and st.user.is_logged_in:
        st.sidebar.caption(f"Signed in as {name}")
        st.sidebar.button("Log out", on_click=st.logout, icon=":material/logout:")
    elif auth == Auth.TOKEN and name != UNNAMED:
        st.sidebar.caption(f"Signed in as {name}, with their token")
    elif auth == Auth.TOKEN:
        st.sidebar.caption("Signed in with this server's token")
    else:
        st.sidebar.caption("No sign-in: this server listens on this machine only")


def refuse_startup(message: str) -> None:
    """One line on stderr and exit 2: the server does not start."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
