"""Where a browser may read and write: every path it sends is resolved (``~``, ``..``, symlinks)
and must lie inside a root the person starting the server declared (``lab.serve.config``).

A refusal is one line (``OutsideRootsError``) that names the roots and the flag that adds one, and
it comes before anything of the file is read. "Save checkpoint" writes only under the output root,
and replaces only a directory the lab itself wrote there (``lab.export.model_dir.lab_written``).
Hub ids count as paths too when they name something on disk: ``open_model`` and ``datasets`` read
an existing local path before they look at the hub.
"""

from __future__ import annotations

import re
from pathlib import Path

from lab.serve.config import ServeConfig

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""An ``org/name`` id as the hub spells it: no leading dot or slash, no ``..``, two parts."""


class OutsideRootsError(ValueError):
    """A path from a browser that the server does not serve (outside every root, or the wrong kind)."""


def data_path(text: str, config: ServeConfig) -> Path:
    """A calibration file or ``save_to_disk`` directory typed in a browser, resolved inside a data root."""
    return _inside(text, config.data_roots, "data", "--data-root")


def model_path(text: str, config: ServeConfig) -> Path:
    """A local checkpoint directory or weights file typed in a browser, resolved inside a model root."""
    return _inside(text, config.model_roots, "model", "--model-root")


def model_source(source: str, config: ServeConfig) -> str:
    """A model source the server did not take from a browser's form (a kept run's, which the CLI
    may have added), held to the same rules: a built-in sample, a hub id, or a path in a model root."""
    from sample_models import BUILTIN_NAMES

    if source in BUILTIN_NAMES:
        return source
    if HUB_ID.fullmatch(source) and not Path(source).expanduser().exists():
        return hub_id(source, config)
    return str(model_path(source, config))


def checkpoint_dir(text: str, config: ServeConfig, replace: bool) -> Path:
    """Where "Save checkpoint" may write ``text``: a new or empty directory under the output root
    (outside the team's run history there), or, with ``replace``, a directory the lab wrote there
    before. Anything else is refused."""
    from lab.export.model_dir import lab_written
    from lab.history.store import HISTORY_DIR

    root = config.output_root
    path = _inside(text, (root,), "output", "--output-root")
    if path == root:
        raise OutsideRootsError(f"name a directory inside the output root {root}, not the root itself")
    if path.is_relative_to(root.resolve() / HISTORY_DIR):
        raise OutsideRootsError(f"{root / HISTORY_DIR} holds the team's run history: choose a name outside it")
    if path.exists() and not path.is_dir():
        raise OutsideRootsError(f"{path} is a file, not a checkpoint directory: choose another name")
    if path.is_dir() and any(path.iterdir()):
        if not replace:
            raise OutsideRootsError(f"{path} is not empty: choose a new name, or tick Replace to rewrite a checkpoint")
        if not lab_written(path):
            raise OutsideRootsError(
                f"{path} was not written by Observer Lab, so it is never replaced: choose a new name"
            )
    return path


def hub_id(text: str, config: ServeConfig, what: str = "hub id") -> str:
    """A hub model or dataset id typed in a browser: refused when the server runs offline, when it
    is not an ``org/name`` id, or when it names something on disk (which would be read as a path)."""
    text = text.strip()
    if not config.hub_allowed:
        raise OutsideRootsError(
            f"this server runs offline (HF_HUB_OFFLINE=1), so {what}s are not fetched: start it with "
            "`HF_HUB_OFFLINE=0 bash scripts/app.sh`, or put the files in a root and open them as a local path"
        )
    if not HUB_ID.fullmatch(text) or ".." in text:
        raise OutsideRootsError(f"{text!r} is not a {what} (org/name)")
    if Path(text).expanduser().exists():
        raise OutsideRootsError(f"{text!r} names a local path, not a {what}: open it as a local path inside a root")
    return text


def _inside(text: str, roots: tuple[Path, ...], kind: str, flag: str) -> Path:
    """``text`` resolved (a relative path is taken inside the first root); refused outside ``roots``."""
    text = text.strip()
    if not text:
        raise OutsideRootsError(f"enter a path inside the {kind} roots ({_names(roots)})")
    if "\x00" in text:
        raise OutsideRootsError(f"{text!r} is not a path")
    path = Path(text).expanduser()
    resolved = (path if path.is_absolute() else roots[0] / path).resolve()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise OutsideRootsError(
            f"{text!r} is outside the {kind} roots ({_names(roots)}): this server reads and writes only there; "
            f"move it into one, or start the app with `bash scripts/app.sh {flag} DIR` to add a root"
        )
    return resolved


def _names(roots: tuple[Path, ...]) -> str:
    return ", ".join(map(str, roots))
