"""The files a command will write, checked when its flags are read: a run of minutes must not fail
at its end, its results lost, because ``--out`` names a folder that does not exist."""

from __future__ import annotations

import argparse
from pathlib import Path


def destination(path: str) -> str:
    """``path`` as given, once its folder is known to exist (argparse's ``type=``: a missing folder
    is the flag's one-line error, before any model is opened)."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: the folder {folder} does not exist (make it first)")
    return path
