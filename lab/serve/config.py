"""What the person starting the server declares: who may use it (``--auth``: a token, an OpenID
Connect sign-in with an allow-list, or nobody asked on a loopback address), the roots a browser may
read from and write to, how many heavy runs compute at once, how many bytes of results are kept
for the next person, and how many runs (and bytes of them) the team's history keeps.

``ServeConfig.parse(argv)`` reads the flags ``python -m lab.serve`` (``scripts/app.sh``) takes beside
Streamlit's own, and which the launcher hands on to ``app.py`` after ``--``; the same parser runs in
both, so a knob is declared once. A declared root that does not exist is an error (the launcher
refuses to start); the default roots (``lab-data/`` and ``lab-outputs/`` under the directory the app
runs in, the Hugging Face cache for models) expose nothing private and are made when missing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from lab.history.store import DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_SIZE, HistoryError, parse_history_bytes
from lab.serve.tokens import TokenFileError, read_people
from lab.settings import parse_bytes

DEFAULT_DATA_ROOT = "lab-data"
DEFAULT_OUTPUT_ROOT = "lab-outputs"
DEFAULT_SHARED_CACHE = "1GB"
DEFAULT_HEAVY_RUNS = 1
MAX_UPLOAD_MB = 256
"""``server.maxUploadSize`` in ``.streamlit/config.toml``: the largest file a browser may upload
(a weights file or a calibration set), in MB. Stated here so the pages can say it."""
UPLOADS_ROOT = Path(tempfile.gettempdir()) / "observer_lab_sessions"
"""Where each browser session's uploads live, one private folder per session, removed with it."""


class ServeConfigError(ValueError):
    """A flag the server cannot start with (a declared root that does not exist, a bad size)."""


class Auth(StrEnum):
    """Who may use a served lab (``--auth``): whoever holds the server's token (the default), whoever
    signs in with the OpenID Connect provider of ``.streamlit/secrets.toml`` and is on the
    allow-list, or anyone who reaches the port (only on a loopback address, and only when said)."""

    TOKEN = "token"
    OIDC = "oidc"
    NONE = "none"


@dataclass(frozen=True)
class ServeConfig:
    """The server's declared settings (all paths resolved).

    ``data_roots``: where calibration files and ``save_to_disk`` directories typed in a browser may
    lie; ``model_roots``: local checkpoints; ``output_root``: where "Save checkpoint" writes;
    ``heavy_runs``: analyses of different settings computed at once (others queue);
    ``shared_cache_bytes``: results kept for the next session asking the same, least recently used
    dropped first; ``uploads_root``: the sessions' upload folders."""

    data_roots: tuple[Path, ...]
    model_roots: tuple[Path, ...]
    output_root: Path
    heavy_runs: int = DEFAULT_HEAVY_RUNS
    shared_cache_bytes: int = field(default_factory=lambda: parse_bytes(DEFAULT_SHARED_CACHE))
    uploads_root: Path = UPLOADS_ROOT
    auth: Auth = Auth.TOKEN
    token_file: Path | None = None
    """``--auth token``: the file holding the token, or one ``name token`` line per person
    (``lab.serve.tokens``; None: the server makes a random one at start)."""
    allow: tuple[str, ...] = ()
    """``--auth oidc``: who may sign in, each an email or ``*@domain`` (case-insensitive)."""
    history_size: int = DEFAULT_HISTORY_SIZE
    """Runs kept in the team's history (``<output root>/runs``)."""
    history_bytes: int = field(default_factory=lambda: parse_history_bytes(DEFAULT_HISTORY_BYTES))
    """Bytes the team's history's runs may take on disk, the oldest pruned first."""

    @property
    def hub_allowed(self) -> bool:
        """Whether hub ids typed in a browser are fetched: only when the server was started with
        network access (``scripts/app.sh`` sets ``HF_HUB_OFFLINE=1`` unless told otherwise)."""
        return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("1", "true", "yes", "on")

    @classmethod
    def parse(cls, argv: list[str], cwd: Path | None = None) -> tuple[ServeConfig, list[str]]:
        """The config from ``argv`` and the arguments it does not know (Streamlit's own flags).
        Raises ``ServeConfigError`` with one line for a declared root that does not exist."""
        args, rest = _parser().parse_known_args(argv)
        base = Path.cwd() if cwd is None else cwd
        data = _declared(args.data_root, "data root", base) or _default_roots(base, DEFAULT_DATA_ROOT)
        models = _declared(args.model_root, "model root", base) or (
            *_default_roots(base, DEFAULT_DATA_ROOT),
            *_hub_cache(),
        )
        output = _declared([args.output_root] if args.output_root else [], "output root", base)
        output_root = output[0] if output else _default_roots(base, DEFAULT_OUTPUT_ROOT)[0]
        if args.heavy_runs < 1:
            raise ServeConfigError(f"--heavy-runs must be at least 1, got {args.heavy_runs}")
        try:
            cache = parse_bytes(args.shared_cache)
        except ValueError as err:
            raise ServeConfigError(f"--shared-cache: {err}") from None
        auth = Auth(args.auth)
        token_file = _token_file(args.token_file, auth, base)
        allow = _allow_list(args.allow, auth)
        if args.history_size < 1:
            raise ServeConfigError(f"--history-size must be at least 1, got {args.history_size}")
        try:
            kept_bytes = parse_history_bytes(args.history_bytes)
        except HistoryError as err:
            raise ServeConfigError(str(err)) from None
        found = (data, models, output_root, args.heavy_runs, cache, UPLOADS_ROOT, auth, token_file, allow)
        return cls(*found, args.history_size, kept_bytes), rest

    def to_argv(self) -> list[str]:
        """Flags that ``parse`` reads back into this config (what the launcher hands to ``app.py``)."""
        argv = [arg for root in self.data_roots for arg in ("--data-root", str(root))]
        argv += [arg for root in self.model_roots for arg in ("--model-root", str(root))]
        argv += ["--output-root", str(self.output_root), "--heavy-runs", str(self.heavy_runs)]
        argv += ["--shared-cache", str(self.shared_cache_bytes), "--auth", self.auth.value]
        argv += ["--token-file", str(self.token_file)] if self.token_file is not None else []
        argv += [arg for pattern in self.allow for arg in ("--allow", pattern)]
        return argv + ["--history-size", str(self.history_size), "--history-bytes", str(self.history_bytes)]

    def describe(self) -> dict[str, str]:
        """The roots as the pages show them, by what they are for."""
        return {
            "data": ", ".join(map(str, self.data_roots)),
            "models": ", ".join(map(str, self.model_roots)),
            "output": str(self.output_root),
        }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/app.sh", add_help=False, allow_abbrev=False)
    parser.add_argument("--data-root", action="append", default=[], metavar="DIR")
    parser.add_argument("--model-root", action="append", default=[], metavar="DIR")
    parser.add_argument("--output-root", default=None, metavar="DIR")
    parser.add_argument("--heavy-runs", type=int, default=DEFAULT_HEAVY_RUNS, metavar="N")
    parser.add_argument("--shared-cache", default=DEFAULT_SHARED_CACHE, metavar="SIZE")
    parser.add_argument("--auth", choices=[mode.value for mode in Auth], default=Auth.TOKEN.value)
    parser.add_argument("--token-file", default=None, metavar="FILE")
    parser.add_argument("--allow", action="append", default=[], metavar="EMAIL")
    parser.add_argument("--history-size", type=int, default=DEFAULT_HISTORY_SIZE, metavar="N")
    parser.add_argument("--history-bytes", default=DEFAULT_HISTORY_BYTES, metavar="SIZE")
    return parser


def _token_file(text: str | None, auth: Auth, base: Path) -> Path | None:
    """``--token-file``, resolved: only with ``--auth token``, a readable file holding one token of
    at least ``lab.serve.tokens.MIN_TOKEN_CHARS`` characters, or one ``name token`` line per person
    (``lab.serve.tokens.parse_people``: a line that does not hold is refused by its number, never
    shown)."""
    if text is None:
        return None
    if auth != Auth.TOKEN:
        raise ServeConfigError(f"--token-file goes with --auth token, not --auth {auth.value}")
    path = (base / Path(text).expanduser()).resolve()
    try:
        read_people(path, shown=text)
    except TokenFileError as err:
        raise ServeConfigError(str(err)) from None
    return path


def _allow_list(patterns: list[str], auth: Auth) -> tuple[str, ...]:
    """``--allow``, lowercased: only with ``--auth oidc``, each an email or ``*@domain``; oidc needs one."""
    if patterns and auth != Auth.OIDC:
        raise ServeConfigError(f"--allow goes with --auth oidc, not --auth {auth.value}")
    if auth == Auth.OIDC and not patterns:
        raise ServeConfigError("--auth oidc needs --allow EMAIL or --allow '*@DOMAIN' (repeatable): who may sign in")
    found = []
    for pattern in patterns:
        local, at, domain = pattern.strip().lower().partition("@")
        if not at or not domain or "@" in domain or "." not in domain or (local != "*" and "*" in local) or not local:
            raise ServeConfigError(f"--allow {pattern!r} is neither an email nor '*@domain'")
        found.append(f"{local}@{domain}")
    return tuple(dict.fromkeys(found))


def _declared(paths: list[str], what: str, base: Path) -> tuple[Path, ...]:
    """Declared roots, resolved; each must be an existing directory."""
    roots = []
    for text in paths:
        path = (base / Path(text).expanduser()).resolve()
        if not path.is_dir():
            problem = "is not a directory" if path.exists() else "does not exist"
            raise ServeConfigError(f"the declared {what} {text!r} ({path}) {problem}: create it or leave the flag out")
        roots.append(path)
    return tuple(dict.fromkeys(roots))


def _default_roots(base: Path, name: str) -> tuple[Path, ...]:
    """A default root under ``base``, made when missing."""
    path = (base / name).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return (path,)


def _hub_cache() -> tuple[Path, ...]:
    """The Hugging Face hub cache, a model root by default when it exists (what the hub downloaded)."""
    from huggingface_hub import constants

    path = Path(constants.HF_HUB_CACHE).expanduser().resolve()
    return (path,) if path.is_dir() else ()
