"""One browser session's uploads: a private folder, made on first use and removed with the session.

An upload's name never forms a path: a calibration file is stored as ``calibration<suffix>`` (only
its suffix kept), a weights file under ``models/`` with its name cleaned to letters, digits, ``.``,
``-`` and ``_``. Folders of sessions gone for a day (a server that was killed) are removed when a
session makes its folder.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import time
import weakref
from pathlib import Path

from lab.serve import config

UPLOAD_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
STALE_UPLOAD_SECONDS = 24 * 3600
"""Session folders untouched this long are removed when a session makes one."""


class UploadError(ValueError):
    """An upload the lab does not take (a wrong suffix, an empty file)."""


class SessionUploads:
    """The files one session uploaded (see the module docstring). ``folder`` is None until the
    first upload; the folder is removed when this object is dropped (with its session)."""

    def __init__(self) -> None:
        self.folder: Path | None = None

    def save_calibration(self, name: str, data: bytes, digest_before: str = "") -> tuple[Path, str]:
        """Store a calibration file as ``calibration<suffix>`` and return its path and sha256. The
        same bytes as ``digest_before`` are not written again (the file's time stamp keys the
        caches); the folder's other calibration files are removed."""
        suffix = Path(name).suffix.lower()
        if suffix not in UPLOAD_SUFFIXES:
            raise UploadError(f"{name!r} is not a calibration file: upload {', '.join(UPLOAD_SUFFIXES)}")
        if not data:
            raise UploadError(f"{name!r} is empty")
        folder = self._folder()
        target = folder / f"calibration{suffix}"
        digest = hashlib.sha256(data).hexdigest()
        if digest != digest_before or not target.is_file():
            for old in folder.glob("calibration.*"):
                old.unlink(missing_ok=True)
            target.write_bytes(data)
        return target, digest

    def save_model(self, name: str, data: bytes) -> Path:
        """Store a weights file under ``models/`` by its cleaned name (errors and the model's name
        then say what the person uploaded); the same bytes again are not written again."""
        if not name.endswith(".safetensors"):
            raise UploadError(f"{name!r} is not a .safetensors file")
        if not data:
            raise UploadError(f"{name!r} is empty")
        folder = self._folder() / "models"
        folder.mkdir(exist_ok=True)
        cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("\\", "/").rsplit("/", 1)[-1]).lstrip(".")
        path = folder / (cleaned or "model.safetensors")
        if path.resolve().parent != folder.resolve():
            raise UploadError(f"{name!r} is not a file name")
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
        return path

    def owns(self, source: str) -> bool:
        """Whether ``source`` is a file in this session's folder."""
        return self.folder is not None and Path(source).resolve().is_relative_to(self.folder.resolve())

    def remove(self) -> None:
        """Remove the folder and everything in it now (the session ended)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def _folder(self) -> Path:
        """The folder, made on first use (private to the server's user)."""
        if self.folder is not None and self.folder.is_dir():
            self.folder.touch()
            return self.folder
        root = config.UPLOADS_ROOT
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            try:
                if old.is_dir() and time.time() - old.stat().st_mtime > STALE_UPLOAD_SECONDS:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                continue
        self.folder = Path(tempfile.mkdtemp(prefix="session-", dir=root))
        weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        return self.folder
