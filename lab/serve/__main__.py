"""``python -m lab.serve [--auth MODE] [--data-root DIR ...] [Streamlit flags]``: what ``scripts/app.sh``
runs.

It checks what the server is started with first, each refusal one line and exit 2, no server: a
declared root that does not exist, a ``--token-file`` without a usable token, an ``--allow`` that is
no email, ``--auth oidc`` without an ``[auth]`` section in the secrets, and ``--auth none`` on an
address other machines reach. Then it runs ``streamlit run app_server.py`` (``app.py`` behind the
sign-in, ``lab.serve.access``) with the Streamlit flags given, and hands the declared settings to the
server after ``--``, where it reads them with the same parser.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from lab.serve.access import is_loopback
from lab.serve.config import Auth, ServeConfig, ServeConfigError

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "app_server.py"


def command(argv: list[str]) -> list[str]:
    """The ``streamlit run`` command line for ``argv`` (raises ``ServeConfigError``)."""
    config, streamlit_flags = ServeConfig.parse(argv)
    if "--" in streamlit_flags:
        raise ServeConfigError("put the app's flags (--data-root, ...) before or among Streamlit's, without '--'")
    address = _option(streamlit_flags, "server.address")
    if config.auth == Auth.NONE and not is_loopback(address or ""):
        shown = address or "every interface (no server.address set)"
        raise ServeConfigError(
            f"--auth none serves anyone who reaches the port, so only on a loopback address, not on {shown}: "
            "use --auth token (the default) or --auth oidc"
        )
    if config.auth == Auth.OIDC:
        _check_oidc_secrets(_option(streamlit_flags, "secrets.files"))
    return [sys.executable, "-m", "streamlit", "run", str(SERVER), *streamlit_flags, "--", *config.to_argv()]


def _option(flags: list[str], name: str) -> str | None:
    """A Streamlit option as the server will have it: from ``--name VALUE`` / ``--name=VALUE`` among
    ``flags``, else from the project's ``.streamlit/config.toml`` (run from the repository root)."""
    for index, flag in enumerate(flags):
        if flag == f"--{name}" and index + 1 < len(flags):
            return flags[index + 1]
        if flag.startswith(f"--{name}="):
            return flag.split("=", 1)[1]
    section, _, key = name.partition(".")
    try:
        found = tomllib.loads((Path.cwd() / ".streamlit" / "config.toml").read_text()).get(section, {}).get(key)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return None if found is None else str(found)


def _check_oidc_secrets(files: str | None) -> None:
    """``--auth oidc`` signs people in with the provider of the secrets' ``[auth]`` section, which
    Streamlit needs a ``redirect_uri`` and a ``cookie_secret`` in."""
    candidates = [Path(files)] if files else [Path.cwd() / ".streamlit" / "secrets.toml"]
    candidates += [] if files else [Path.home() / ".streamlit" / "secrets.toml"]
    for path in candidates:
        try:
            section = tomllib.loads(path.read_text()).get("auth")
        except (OSError, tomllib.TOMLDecodeError):
            continue
        missing = [key for key in ("redirect_uri", "cookie_secret") if not (section or {}).get(key)]
        if section is not None and not missing:
            return
        if section is not None:
            raise ServeConfigError(f"--auth oidc: the [auth] section of {path} lacks {', '.join(missing)}")
    where = " or ".join(str(path) for path in candidates)
    raise ServeConfigError(
        f"--auth oidc needs an [auth] section (redirect_uri, cookie_secret and the provider's client_id, "
        f"client_secret, server_metadata_url) in {where}"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        line = command(sys.argv[1:] if argv is None else argv)
    except ServeConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.execv(line[0], line)
    return 0  # not reached: execv replaces the process


if __name__ == "__main__":
    sys.exit(main())
