"""Who may use a served lab, decided on every request before Streamlit sees it (issue 40).

``Gate`` is the server's policy (``--auth``, ``lab.serve.config.Auth``) and ``AccessMiddleware`` the
Starlette middleware of Streamlit's ASGI ``st.App`` that applies it to every route: pages, static
files, the websocket, uploads, media and components; only the health endpoint stays open.

- ``token`` (the default, as Jupyter): the server's token, from ``--token-file`` or made at start,
  or one token per person (a ``--token-file`` of ``name token`` lines, ``lab.serve.tokens``).
  ``?token=...`` on any address is exchanged for an HttpOnly, SameSite cookie (an HMAC of the
  token, so it cannot be forged without it; Secure under TLS) and the address is given back
  without the token. Both are compared in constant time with every person's (``holder``), so
  the time an answer takes says neither whether a guess came close nor whose it came close to;
  the cookie names the person (``signed_in_as``) for the run history and the files.
- ``oidc``: Streamlit's own OpenID Connect sign-in (``st.login``'s routes and its signed user
  cookie, read by the app layer's ``user_of``), and the person's email on the allow-list.
- ``none``: nothing asked (the launcher allows it on a loopback address only).

Whoever may not pass gets the sign-in page (HTTP) or a refused handshake (websocket), never a
part of the app. No streamlit here: the app layer (``app_server.py``, ``lab.ui.access``) hands in
what only Streamlit can read.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

from lab.serve.config import Auth, ServeConfig, ServeConfigError
from lab.serve.tokens import UNNAMED, Person, TokenFileError, read_people

SESSION_COOKIE = "observer_lab_session"
SESSION_SECONDS = 30 * 24 * 3600
"""How long a signed-in browser keeps its cookie (as long as Streamlit keeps an OIDC sign-in)."""
OPEN_PATHS = frozenset({"/_stcore/health", "/healthz"})
"""What anyone may reach: the health check a supervisor (or a test) polls, which says nothing."""
OIDC_PATHS = frozenset({"/auth/login", "/auth/logout", "/oauth2callback"})
"""Streamlit's sign-in routes, which an OIDC sign-in passes through before there is a user."""
TOKEN_PARAM = "token"
NEXT_COOKIE = "observer_lab_next"
"""Under OIDC, the page a person asked for before signing in (a run's link): Streamlit's sign-in
comes back to ``/``, and the gate sends them on to it."""
NEXT_SECONDS = 600

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
UserOf = Callable[[Mapping[str, str], Mapping[str, str]], "dict[str, Any] | None"]
"""The app layer's reader of Streamlit's signed user cookie: ``(cookies, headers)`` -> the signed-in
person's claims (``email`` among them), or None."""


def make_token() -> str:
    """A new random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def session_cookie(token: str) -> str:
    """The cookie a browser gets for the token: an HMAC of it, so it says nothing of the token and
    nobody without the token can make one."""
    return hmac.new(token.encode("utf-8"), b"observer-lab signed in", hashlib.sha256).hexdigest()


def same(given: str | None, expected: str) -> bool:
    """``given == expected`` in constant time (a token or cookie compared byte by byte would tell
    how much of a guess was right by how long the answer took)."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def holder(given: str | None, candidates: Iterable[tuple[str, str]]) -> str | None:
    """The name of the ``(name, secret)`` pair whose secret ``given`` is, or None. Every secret is
    compared, in constant time, whichever matches: stopping at the match would tell by the time
    the answer took how far down the list the token was."""
    found = None
    for name, secret in candidates:
        if same(given, secret) and found is None:
            found = name
    return found


def allowed(email: str | None, patterns: tuple[str, ...]) -> bool:
    """Whether ``email`` is on the allow-list: equal to an entry, or of the domain of a ``*@domain``
    one (case-insensitive)."""
    if not email or "@" not in email:
        return False
    email = email.strip().lower()
    domain = email.rpartition("@")[2]
    return any(email == pattern or pattern == f"*@{domain}" for pattern in patterns)


def is_loopback(address: str) -> bool:
    """Whether a server listening on ``address`` is reachable from this machine only: ``localhost``
    or a loopback IP. An empty address (Streamlit's default) listens everywhere."""
    address = address.strip().strip("[]")
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Verdict:
    """What the gate does with a request: let it pass, send the browser on (with a cookie), or
    answer with a page of its own."""

    status: int = 0
    body: str = ""
    location: str = ""
    cookie: str = ""

    @property
    def passes(self) -> bool:
        return self.status == 0


PASS = Verdict()


@dataclass(frozen=True)
class Gate:
    """The server's access policy: its mode, its one token or its people (``token`` mode) and its
    allow-list (``oidc`` mode)."""

    auth: Auth
    token: str = ""
    """The server's one token (made at start or a file's token alone), whoever holds it ``token``;
    "" when each person has their own (``people``)."""
    allow: tuple[str, ...] = ()
    people: tuple[Person, ...] = ()
    """``--token-file``'s named people, each signing in with their own token."""

    @classmethod
    def of(cls, config: ServeConfig) -> Gate:
        """The gate of a server's declared settings; a token server without ``--token-file`` makes
        its token now. Raises ``ServeConfigError`` for a token file that no longer holds."""
        if config.auth != Auth.TOKEN:
            return cls(config.auth, allow=config.allow)
        if config.token_file is None:
            return cls(config.auth, make_token())
        try:
            people = read_people(config.token_file)
        except TokenFileError as err:
            raise ServeConfigError(str(err)) from None
        if len(people) == 1 and people[0].name == UNNAMED:
            return cls(config.auth, people[0].token)
        return cls(config.auth, people=people)

    @property
    def holders(self) -> tuple[Person, ...]:
        """Everyone who may sign in with a token: the named people, or ``token`` with the one token."""
        return self.people or ((Person(UNNAMED, self.token),) if self.token else ())

    @cached_property
    def _cookies(self) -> tuple[tuple[str, str], ...]:
        return tuple((person.name, session_cookie(person.token)) for person in self.holders)

    def signed_in_as(self, cookies: Mapping[str, str]) -> str | None:
        """Who the session cookie among ``cookies`` signs in (a name of ``holders``), or None: what
        the run history and the files say asked for a run."""
        return holder(cookies.get(SESSION_COOKIE), self._cookies)

    def verdict(
        self,
        path: str,
        query: str,
        cookies: Mapping[str, str],
        user: dict[str, Any] | None,
        secure: bool,
        login_url: str = "",
        page: bool = False,
    ) -> Verdict:
        """What becomes of a request for ``path`` (and ``query``) with ``cookies``; ``user`` is the
        person Streamlit's sign-in cookie names (``oidc``), ``secure`` whether it came over TLS,
        ``page`` whether a browser navigates to it (rather than fetching a part of a page)."""
        if self.auth == Auth.NONE or path in OPEN_PATHS:
            return PASS
        if self.auth == Auth.TOKEN:
            return self._by_token(path, query, cookies, secure)
        if path in OIDC_PATHS:
            return PASS
        if user is None or not user.get("is_logged_in"):
            asked = local_path(path) + (f"?{query}" if query else "")
            remember = f"{NEXT_COOKIE}={quote(asked)}; Path=/; Max-Age={NEXT_SECONDS}; HttpOnly; SameSite=Lax"
            return Verdict(HTTPStatus.UNAUTHORIZED, sign_in_page(self.auth, login_url), cookie=remember if page else "")
        email = user.get("email")
        if not allowed(email, self.allow):
            line = f"{email or 'This account'} may not use this server: it is not on its list."
            return Verdict(HTTPStatus.FORBIDDEN, _page("Not on this server's list", f"<p>{html.escape(line)}</p>"))
        asked = local_path(unquote(cookies.get(NEXT_COOKIE, "")))
        if page and path == "/" and not query and asked != "/":  # back from the sign-in: on to the link
            return Verdict(HTTPStatus.SEE_OTHER, location=asked, cookie=f"{NEXT_COOKIE}=; Path=/; Max-Age=0")
        return PASS

    def _by_token(self, path: str, query: str, cookies: Mapping[str, str], secure: bool) -> Verdict:
        if self.signed_in_as(cookies) is not None:
            return PASS
        params = parse_qsl(query, keep_blank_values=True)
        given = next((value for name, value in params if name == TOKEN_PARAM), None)
        rest = [(name, value) for name, value in params if name != TOKEN_PARAM]
        name = holder(given, ((person.name, person.token) for person in self.holders))
        if given is None or name is None:
            page = sign_in_page(self.auth, wrong=given is not None, path=path, params=rest)
            return Verdict(HTTPStatus.UNAUTHORIZED, page)
        expected = dict(self._cookies)[name]
        cookie = f"{SESSION_COOKIE}={expected}; Path=/; Max-Age={SESSION_SECONDS}; HttpOnly; SameSite=Lax"
        cookie += "; Secure" if secure else ""
        query = urlencode(rest)
        return Verdict(HTTPStatus.SEE_OTHER, location=local_path(path) + (f"?{query}" if query else ""), cookie=cookie)


def local_path(path: str) -> str:
    """``path`` when it names a page of this server; ``/`` otherwise (``//host/...`` would leave it)."""
    return path if path.startswith("/") and not path.startswith("//") and "\\" not in path else "/"


def sign_in_page(
    auth: Auth, login_url: str = "", wrong: bool = False, path: str = "/", params: Sequence[tuple[str, str]] = ()
) -> str:
    """The one page a person who has not signed in gets, whatever they asked for. The token form
    goes on to what they asked for (``path`` and its query ``params``, a run's link among them)."""
    if auth == Auth.OIDC:
        body = f'<p>This Observer Lab asks you to sign in.</p><p><a href="{html.escape(login_url)}">Sign in</a></p>'
        return _page("Sign in", body)
    warning = "<p><strong>That token is not this server's.</strong></p>" if wrong else ""
    kept = "".join(
        f'<input type="hidden" name="{html.escape(name)}" value="{html.escape(value)}">' for name, value in params
    )
    body = (
        f"{warning}<p>This Observer Lab asks for its token: open the address it printed when it started "
        "(it ends in <code>?token=…</code>), or paste the token here.</p>"
        f'<form method="get" action="{html.escape(local_path(path))}">{kept}<input name="{TOKEN_PARAM}" '
        'type="password" autocomplete="off" aria-label="Token" size="48"> <button type="submit">Sign in</button></form>'
    )
    return _page("Sign in", body)


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Observer Lab: "
        f"{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:40em;margin:4em auto;"
        f"padding:0 1em}}</style></head><body><h1>Observer Lab</h1>{body}</body></html>"
    )


class AccessMiddleware:
    """Starlette middleware (plain ASGI) applying a ``Gate`` to every HTTP request and websocket
    handshake before Streamlit's own routes. ``user_of`` reads Streamlit's OIDC user cookie and
    ``login_url`` gives its sign-in address (``oidc`` mode; the app layer's)."""

    def __init__(
        self, app: Any, gate: Gate, user_of: UserOf | None = None, login_url: Callable[[], str] | None = None
    ) -> None:
        self.app, self.gate, self.user_of, self.login_url = app, gate, user_of, login_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        from starlette.requests import HTTPConnection

        connection = HTTPConnection(scope)
        oidc = self.gate.auth == Auth.OIDC
        user = self.user_of(connection.cookies, connection.headers) if oidc and self.user_of else None
        verdict = self.gate.verdict(
            scope["path"],
            scope.get("query_string", b"").decode("latin-1"),
            connection.cookies,
            user,
            scope.get("scheme") in ("https", "wss"),
            self.login_url() if oidc and self.login_url else "",
            page="text/html" in connection.headers.get("accept", ""),
        )
        if verdict.passes:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await receive()  # the handshake; closing before accepting refuses it (HTTP 403)
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _answer(verdict, scope, receive, send)


async def _answer(verdict: Verdict, scope: Scope, receive: Receive, send: Send) -> None:
    from starlette.responses import HTMLResponse, RedirectResponse

    if verdict.location:
        response = RedirectResponse(verdict.location, status_code=verdict.status)
    else:
        response = HTMLResponse(verdict.body, status_code=verdict.status, headers={"cache-control": "no-store"})
    if verdict.cookie:
        response.headers.append("set-cookie", verdict.cookie)
    await response(scope, receive, send)
