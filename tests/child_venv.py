"""A throwaway virtual environment for tests that need a fresh site-packages (the .pth hooks), seeing
the packages of the environment running the tests (torch among them) whether that is the system's
Python or a virtual environment itself (dev/test.sh runs in ./.venv)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path


def venv_seeing_this_one(home: Path) -> tuple[Path, Path]:
    """Creates a virtual environment in `home`; returns (its python, its site-packages folder)."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(home)
    python = home / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    # "_" sorts before the hooks' names, so these paths are on sys.path when a hook runs.
    (purelib / "_tests_parent_site.pth").write_text("".join(f"{path}\n" for path in ours))
    return python, purelib
