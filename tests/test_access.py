"""Who may use a served lab (issue 40): sign-in on every route, in each mode (``lab.serve.access``).

The rules are checked on their own first; then the real server (``python -m lab.serve``) on
loopback: with its token (HTTP routes, the websocket, uploads, media, static files, components
refused without it; a wrong token and a forged cookie refused; Chromium signs in with the printed
address), over TLS with a self-signed certificate made here, and with an OpenID Connect provider
run here (``oidc-provider-mock`` on 127.0.0.1): one person on the allow-list, one not."""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.client
import os
import secrets
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, wait_healthy

from lab.serve import __main__ as launcher
from lab.serve import access
from lab.serve.access import NEXT_COOKIE, SESSION_COOKIE, Gate, allowed, is_loopback, session_cookie
from lab.serve.config import Auth, ServeConfig, ServeConfigError
from lab.serve.tokens import UNNAMED, Person, TokenFileError, parse_people

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "access-tests-token-0123456789abcdef"

# ---------------------------------------------------------------- the rules


def test_a_token_server_answers_only_the_sign_in_page_until_the_token_comes():
    gate = Gate(Auth.TOKEN, TOKEN)
    nothing = gate.verdict("/", "", {}, None, secure=False)
    assert nothing.status == 401 and "asks for its token" in nothing.body and "That token" not in nothing.body
    wrong = gate.verdict("/", "token=guess", {}, None, secure=False)
    assert wrong.status == 401 and "That token is not this server's" in wrong.body
    given = gate.verdict("/", f"run=7&token={TOKEN}", {}, None, secure=False)
    assert given.status == 303 and given.location == "/?run=7"  # the token leaves the address bar
    assert given.cookie.startswith(f"{SESSION_COOKIE}={session_cookie(TOKEN)};")
    assert "HttpOnly" in given.cookie and "SameSite=Lax" in given.cookie and "Secure" not in given.cookie
    assert "Secure" in gate.verdict("/", f"token={TOKEN}", {}, None, secure=True).cookie
    assert gate.verdict("/static/x.js", "", {SESSION_COOKIE: session_cookie(TOKEN)}, None, False).passes
    assert gate.verdict("/_stcore/stream", "", {SESSION_COOKIE: "00" * 32}, None, False).status == 401  # forged
    assert gate.verdict("/_stcore/health", "", {}, None, False).passes
    assert session_cookie(TOKEN) != session_cookie(TOKEN + "x") and TOKEN not in session_cookie(TOKEN)


def test_an_oidc_server_lets_in_only_signed_in_people_on_its_list():
    gate = Gate(Auth.OIDC, allow=("alice@team.example", "*@lab.example"))
    login = "/auth/login?provider=abc"
    out = gate.verdict("/", "", {}, None, False, login)
    assert out.status == 401 and f'href="{login}"' in out.body
    assert gate.verdict("/oauth2callback", "code=1", {}, None, False).passes  # Streamlit's sign-in route
    assert gate.verdict("/", "", {}, {"is_logged_in": True, "email": "ALICE@team.example"}, False).passes
    assert gate.verdict("/", "", {}, {"is_logged_in": True, "email": "carol@lab.example"}, False).passes
    refused = gate.verdict("/", "", {}, {"is_logged_in": True, "email": "bob@team.example"}, False)
    assert refused.status == 403 and "bob@team.example may not use this server" in refused.body
    assert gate.verdict("/", "", {}, {"is_logged_in": False, "email": "alice@team.example"}, False).status == 401


def test_an_oidc_sign_in_goes_on_to_the_link_the_person_followed():
    """Streamlit's sign-in comes back to ``/``: the page asked for before it (a run's link) is
    remembered in a cookie and the person is sent on to it, once."""
    gate = Gate(Auth.OIDC, allow=("alice@team.example",))
    alice = {"is_logged_in": True, "email": "alice@team.example"}
    asked = gate.verdict("/runs", "run=20261127-070905-a1b2c3", {}, None, False, "/auth/login", page=True)
    assert asked.status == 401 and asked.cookie.startswith(f"{NEXT_COOKIE}=/runs%3Frun%3D20261127-070905-a1b2c3;")
    assert "HttpOnly" in asked.cookie and "SameSite=Lax" in asked.cookie
    assert gate.verdict("/static/app.js", "", {}, None, False).cookie == ""  # a page's parts are not where to go back
    remembered = {NEXT_COOKIE: asked.cookie.split(";")[0].split("=", 1)[1]}
    back = gate.verdict("/", "", remembered, alice, False, page=True)
    assert back.status == 303 and back.location == "/runs?run=20261127-070905-a1b2c3"
    assert back.cookie == f"{NEXT_COOKIE}=; Path=/; Max-Age=0"
    assert gate.verdict("/", "", remembered, alice, False, page=False).passes
    assert gate.verdict("/", "", {NEXT_COOKIE: "%2F%2Fevil.example%2F"}, alice, False, page=True).passes  # not off-site


@pytest.mark.parametrize(
    ("email", "expected"),
    [("a@x.org", True), ("A@X.ORG", True), ("b@x.org", False), ("c@team.org", True), ("c@sub.team.org", False),
     ("", False), (None, False), ("not-an-email", False)],
)  # fmt: skip
def test_the_allow_list_takes_emails_and_whole_domains(email, expected):
    assert allowed(email, ("a@x.org", "*@team.org")) is expected


def test_loopback_addresses():
    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "", "10.1.2.3", "example.org")))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--allow", "a@x.org"], "--allow goes with --auth oidc"),
        (["--auth", "oidc"], "--auth oidc needs --allow"),
        (["--auth", "oidc", "--allow", "nobody"], "'nobody' is neither an email nor"),
        (["--auth", "none", "--token-file", "t"], "--token-file goes with --auth token"),
        (["--token-file", "missing-token"], "cannot be read"),
        (["--token-file", "short"], "at least 16 characters"),
    ],
)
def test_what_a_server_cannot_start_with_is_one_line(tmp_path, argv, words):
    (tmp_path / "short").write_text("abc")
    (tmp_path / "t").write_text(TOKEN)
    base = ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]
    with pytest.raises(ServeConfigError, match=words) as caught:
        ServeConfig.parse([*base, *argv], cwd=tmp_path)
    assert "\n" not in str(caught.value)


ALICE, BOB, CAROL = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef", "carol-token-0123456789abcd"
TEAM = f"# the team\nalice {ALICE}\n\n   # bob joined in May\nbob.smith@lab.example   {BOB}\ncarol {CAROL}\n"


def _roots(tmp_path: Path) -> list[str]:
    return ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]


def test_a_token_file_holding_one_token_still_signs_in_everyone_as_token(tmp_path):
    """The file as it always was (one token, maybe a newline after it; or one token under comments):
    the server's one token, whoever holds it ``token``, printed at start."""
    for text in (TOKEN, f"{TOKEN}\n", f"  {TOKEN}  \n\n", f"# the lab's token\n\n{TOKEN}\n"):
        assert parse_people(text, "f") == (Person(UNNAMED, TOKEN),)
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    config, _ = ServeConfig.parse([*_roots(tmp_path), "--token-file", "token"], cwd=tmp_path)
    gate = Gate.of(config)
    assert gate.token == TOKEN and gate.people == () and [p.name for p in gate.holders] == [UNNAMED]
    signed_in = gate.verdict("/", f"token={TOKEN}", {}, None, secure=False)
    assert signed_in.status == 303 and signed_in.cookie.startswith(f"{SESSION_COOKIE}={session_cookie(TOKEN)};")
    assert gate.signed_in_as({SESSION_COOKIE: session_cookie(TOKEN)}) == "token"


def test_a_token_file_of_named_people_signs_each_in_as_themselves(tmp_path):
    people = parse_people(TEAM, "f")
    assert [p.name for p in people] == ["alice", "bob.smith@lab.example", "carol"]
    assert [p.token for p in people] == [ALICE, BOB, CAROL]
    assert ALICE not in repr(people)  # a token stays out of a log or a traceback
    (tmp_path / "team").write_text(TEAM)
    config, _ = ServeConfig.parse([*_roots(tmp_path), "--token-file", "team"], cwd=tmp_path)
    gate = Gate.of(config)
    assert gate.token == "" and gate.people == people
    for name, token in (("alice", ALICE), ("bob.smith@lab.example", BOB), ("carol", CAROL)):
        given = gate.verdict("/", f"run=7&token={token}", {}, None, secure=False)
        assert given.status == 303 and given.location == "/?run=7"
        cookie = given.cookie.split(";")[0].split("=", 1)[1]
        assert cookie == session_cookie(token) and token not in cookie
        assert gate.verdict("/_stcore/stream", "", {SESSION_COOKIE: cookie}, None, False).passes
        assert gate.signed_in_as({SESSION_COOKIE: cookie}) == name
    assert gate.verdict("/", f"token={TOKEN}", {}, None, False).status == 401  # no one's
    assert gate.verdict("/", "", {SESSION_COOKIE: session_cookie(TOKEN)}, None, False).status == 401
    assert gate.signed_in_as({SESSION_COOKIE: session_cookie(TOKEN)}) is None and gate.signed_in_as({}) is None


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        (f"alice {ALICE}\nbob {BOB} extra-field-here\n", 2, "expected 'name token' (two fields), found 3"),
        (f"alice {ALICE}\n# nobody\n{BOB}\n", 3, "expected 'name token' (two fields), found 1"),
        (f"alice {ALICE}\n<b>bob</b> {BOB}\n", 2, "the name is not a plain name"),
        (f"alice {ALICE}\n-bob {BOB}\n", 2, "the name is not a plain name"),
        (f"\n\nalice {ALICE}\nbob short-secret\n", 4, "the token is shorter than 16 characters"),
        (f"{ALICE} alice\nbob {BOB}\n", 1, "the token is shorter than 16 characters"),  # the columns swapped
        (f"alice {ALICE}\nbob {BOB}\nalice {CAROL}\n", 3, "the same name as line 1"),
        (f"alice {ALICE}\nbob {BOB}\n\ncarol {BOB}\n", 4, "the same token as line 2"),
    ],
)
def test_a_token_file_line_that_does_not_hold_is_refused_by_its_number_never_shown(tmp_path, text, line, words):
    (tmp_path / "team").write_text(text)
    with pytest.raises(ServeConfigError) as caught:
        ServeConfig.parse([*_roots(tmp_path), "--token-file", "team"], cwd=tmp_path)
    message = str(caught.value)
    assert message.startswith(f"--token-file 'team' line {line}: ") and words in message, message
    assert "\n" not in message
    for secret in (ALICE, BOB, CAROL, "short-secret", "<b>bob</b>", "extra-field-here"):
        assert secret not in message, (secret, message)
    with pytest.raises(TokenFileError, match=f"line {line}: "):
        parse_people(text, "f")


def test_a_token_file_of_nothing_but_comments_is_refused(tmp_path):
    (tmp_path / "team").write_text("# nobody yet\n\n")
    with pytest.raises(ServeConfigError, match="'team' holds no token"):
        ServeConfig.parse([*_roots(tmp_path), "--token-file", "team"], cwd=tmp_path)


def test_every_persons_token_is_compared_in_constant_time(monkeypatch):
    """The token and the cookie go through ``hmac.compare_digest`` against every person's, even
    when the first one matches: which one matched takes the same comparisons."""
    gate = Gate(Auth.TOKEN, people=parse_people(TEAM, "f"))
    compared: list[bytes] = []
    real = access.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", recording)
    for token, status in ((ALICE, 303), (CAROL, 303), ("not-anyones-token-0123456789", 401)):
        compared.clear()
        assert gate.verdict("/", f"token={token}", {}, None, False).status == status
        assert compared == [ALICE.encode(), BOB.encode(), CAROL.encode()]  # no cookie came: the token, with all
    cookies = [session_cookie(t).encode() for t in (ALICE, BOB, CAROL)]
    for cookie, name in ((session_cookie(ALICE), "alice"), (session_cookie(CAROL), "carol"), ("00" * 32, None)):
        compared.clear()
        assert gate.signed_in_as({SESSION_COOKIE: cookie}) == name
        assert compared == cookies


def test_the_launcher_refuses_no_sign_in_where_others_reach_and_oidc_without_secrets(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    executed = []
    monkeypatch.setattr(os, "execv", lambda *a: executed.append(a))
    roots = ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]
    assert launcher.main([*roots, "--server.address", "0.0.0.0", "--auth", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--auth none serves anyone who reaches the port" in err
    assert launcher.main([*roots, "--server.address=10.0.0.7", "--auth", "none"]) == 2
    (tmp_path / "secrets.toml").write_text('[auth]\nredirect_uri = "http://127.0.0.1:1/oauth2callback"\n')
    oidc = ["--auth", "oidc", "--allow", "*@x.org", "--secrets.files", str(tmp_path / "secrets.toml")]
    assert launcher.main([*roots, *oidc]) == 2 and "lacks cookie_secret" in capsys.readouterr().err
    assert executed == []
    assert launcher.main([*roots, "--auth", "none"]) == 0 and len(executed) == 1  # loopback, by the project config
    assert executed[0][1][4].endswith("app_server.py")


# ---------------------------------------------------------------- the real server


@contextlib.contextmanager
def _server(tmp_path: Path, *flags: str, scheme: str = "http", port: int | None = None) -> Iterator[tuple[int, Path]]:
    """``python -m lab.serve`` on a loopback port (a free one unless given: an OIDC redirect address
    names it) with ``flags``: its port and its log."""
    port = free_port() if port is None else port
    roots = ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port), *roots]
    log_path = tmp_path / f"server-{port}.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [*command, *flags],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(f"{scheme}://127.0.0.1:{port}", server)
            yield port, log_path
        finally:
            server.terminate()
            server.wait(timeout=20)


def _get(port: int, path: str, method: str = "GET", cookie: str = "", tls: bool = False) -> tuple[int, str]:
    """One request from this process, straight to the server (no browser): status and body."""
    if tls:
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=ssl._create_unverified_context())
    else:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(
        method, path, body=b"x" if method != "GET" else None, headers={"Cookie": cookie} if cookie else {}
    )
    response = connection.getresponse()
    body = response.read().decode("utf-8", "replace")
    connection.close()
    return response.status, body


def _handshake(port: int, cookie: str = "") -> bytes:
    """The status line the server answers a websocket upgrade of Streamlit's stream with."""
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET /_stcore/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
        + (f"Cookie: {cookie}\r\n" if cookie else "")
        + "\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request.encode())
        return connection.recv(1024).split(b"\r\n", 1)[0]


@pytest.mark.slow
@pytest.mark.browser
def test_a_token_server_refuses_every_route_without_it_and_signs_in_with_it(tmp_path, browser):
    (tmp_path / "token").write_text(TOKEN)
    with _server(tmp_path, "--token-file", str(tmp_path / "token")) as (port, log):
        assert f"Observer Lab: open http://127.0.0.1:{port}/?token={TOKEN}\n" in log.read_text()
        for method, path in [
            ("GET", "/"),
            ("GET", "/static/js/index.js"),
            ("PUT", "/_stcore/upload_file/session/file"),
            ("GET", "/media/picture.png"),
            ("GET", "/component/observer.component/index.html"),
            ("GET", "/_stcore/host-config"),
            ("GET", "/?token=not-the-token"),
        ]:
            status, body = _get(port, path, method)
            assert status == 401 and "Observer Lab" in body and "<script" not in body, (method, path)
        forged = f"{SESSION_COOKIE}={session_cookie('another-token-0123456789')}"
        assert _get(port, "/", cookie=forged)[0] == 401
        assert b" 403 " in _handshake(port) and b" 403 " in _handshake(port, forged)
        signed_in = f"{SESSION_COOKIE}={session_cookie(TOKEN)}"
        assert b" 101 " in _handshake(port, signed_in)
        assert _get(port, "/_stcore/health")[0] == 200
        tab = browser.new_page()
        tab.goto(f"http://127.0.0.1:{port}/")
        assert tab.locator('[data-testid="stApp"]').count() == 0 and "asks for its token" in tab.content()
        tab.goto(f"http://127.0.0.1:{port}/?token={TOKEN}")
        tab.get_by_text("Run the demo").wait_for(timeout=120_000)
        assert tab.url == f"http://127.0.0.1:{port}/"
        (cookie,) = [c for c in tab.context.cookies() if c["name"] == SESSION_COOKIE]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Lax" and cookie["value"] != TOKEN
        tab.close()


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key, made here (cryptography)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert, private = folder / "cert.pem", folder / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert, private


@pytest.mark.slow
@pytest.mark.browser
def test_tls_serves_the_sign_in_and_the_app_over_https(tmp_path, browser):
    cert, key = _self_signed(tmp_path)
    (tmp_path / "token").write_text(TOKEN)
    flags = [
        "--token-file",
        str(tmp_path / "token"),
        "--server.sslCertFile",
        str(cert),
        "--server.sslKeyFile",
        str(key),
    ]
    with _server(tmp_path, *flags, scheme="https") as (port, log):
        assert f"Observer Lab: open https://127.0.0.1:{port}/?token=" in log.read_text()
        assert _get(port, "/", tls=True)[0] == 401
        context = browser.new_context(ignore_https_errors=True)
        tab = context.new_page()
        tab.goto(f"https://127.0.0.1:{port}/?token={TOKEN}")
        tab.get_by_text("Run the demo").wait_for(timeout=120_000)
        (cookie,) = [c for c in context.cookies() if c["name"] == SESSION_COOKIE]
        assert cookie["secure"] and cookie["httpOnly"]
        context.close()


@pytest.mark.slow
@pytest.mark.browser
def test_oidc_signs_in_the_people_on_the_list_and_refuses_the_rest(tmp_path, browser):
    import oidc_provider_mock

    with oidc_provider_mock.run_server_in_thread() as provider:
        port = free_port()
        (tmp_path / "secrets.toml").write_text(
            "[auth]\n"
            f'redirect_uri = "http://127.0.0.1:{port}/oauth2callback"\n'
            f'cookie_secret = "{secrets.token_hex(16)}"\n'
            'client_id = "observer-lab"\nclient_secret = "any"\n'
            f'server_metadata_url = "http://127.0.0.1:{provider.server_port}/.well-known/openid-configuration"\n'
        )
        flags = ["--auth", "oidc", "--allow", "*@team.example", "--secrets.files", str(tmp_path / "secrets.toml")]
        with _server(tmp_path, *flags, port=port):
            assert b" 403 " in _handshake(port)
            for person, lets_in in (("alice@team.example", True), ("bob@other.example", False)):
                context = browser.new_context()
                tab = context.new_page()
                tab.goto(f"http://127.0.0.1:{port}/?run=20260101-000000-abcdef")  # a run's link, before signing in
                assert "asks you to sign in" in tab.content()
                tab.get_by_role("link", name="Sign in").click()
                tab.locator("input[name=sub]").fill(person)  # the provider's own sign-in form
                tab.locator("button[type=submit]").first.click()
                if lets_in:
                    tab.get_by_text("Run the demo").wait_for(timeout=120_000)
                    tab.get_by_text(f"Signed in as {person}").wait_for(timeout=60_000)
                    # back from the sign-in, the link's run is asked for (this server keeps none)
                    tab.get_by_text("Opening run 20260101-000000-abcdef failed: no kept run").wait_for(timeout=60_000)
                else:
                    tab.get_by_text(f"{person} may not use this server").wait_for(timeout=60_000)
                    assert tab.locator('[data-testid="stApp"]').count() == 0
                context.close()


def test_no_sign_in_on_every_interface_does_not_start(tmp_path):
    roots = ["--data-root", str(tmp_path), "--model-root", str(tmp_path), "--output-root", str(tmp_path)]
    command = [sys.executable, "-m", "lab.serve", "--server.address", "0.0.0.0", "--auth", "none", *roots]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: --auth none serves anyone")
