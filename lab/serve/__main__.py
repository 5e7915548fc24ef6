"""``python -m lab.serve [--data-root DIR ...] [Streamlit flags]``: what ``scripts/app.sh`` runs.

It checks the declared roots first (a root that does not exist: one line, exit 2, no server), then
runs ``streamlit run app.py`` with the Streamlit flags given and hands the declared settings to the
app after ``--``, where ``app.py`` reads them with the same parser.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lab.serve.config import ServeConfig, ServeConfigError

APP = Path(__file__).resolve().parents[2] / "app.py"


def command(argv: list[str]) -> list[str]:
    """The ``streamlit run`` command line for ``argv`` (raises ``ServeConfigError``)."""
    config, streamlit_flags = ServeConfig.parse(argv)
    if "--" in streamlit_flags:
        raise ServeConfigError("put the app's flags (--data-root, ...) before or among Streamlit's, without '--'")
    return [sys.executable, "-m", "streamlit", "run", str(APP), *streamlit_flags, "--", *config.to_argv()]


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
