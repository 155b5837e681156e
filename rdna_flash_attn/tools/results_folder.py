"""Where the CLI's results go: one folder per run, named on the first line of output and checked
writable before any work starts.

The default is `rdna_fa_results/<date>-<time>` in the current folder: where a ComfyUI user runs the
command (the ComfyUI or portable folder), beside ComfyUI's own `output/`, easy to open and to attach to
an issue, one folder per run so nothing is overwritten. A hidden cache folder would keep the PNG from
the person who asked for it. (The repository's .gitignore lists `rdna_fa_results/`, so a run inside a
checkout of this repository leaves no untracked files.)"""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

DEFAULT_PARENT = "rdna_fa_results"


class FolderError(Exception):
    """The results folder cannot be made or written: the message is one line for the user."""


def default_folder(now: datetime.datetime | None = None) -> Path:
    """./rdna_fa_results/YYYYmmdd-HHMMSS (local time) in the current folder."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / DEFAULT_PARENT / stamp


def prepare(folder: str | os.PathLike | None) -> Path:
    """The results folder (`folder`, or default_folder()) made and proven writable by writing and
    removing a file in it; its absolute path. Raises FolderError."""
    path = Path(folder).expanduser() if folder else default_folder()
    path = path.absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rdna_fa_write_test_"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise FolderError(f"cannot write results to {path}: {reason}") from error
    return path
