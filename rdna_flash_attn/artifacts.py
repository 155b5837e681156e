"""Where the code objects are and whether they are the ones the manifest names.

AMD code objects ship in prebuilt/ (inside the package in a wheel, beside it in a git checkout) with
a manifest of sha256s; the NVIDIA emulation builds are made locally by kernels/build.py --emulate.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import variants

PACKAGE_DIR = Path(__file__).resolve().parent
EMULATED_LAYERS = ("gfx11", "gfx12")


class ArtifactError(RuntimeError):
    """A code object or the manifest is missing, unreadable or not what the manifest says."""


@dataclass(frozen=True)
class Artifact:
    target: str  # "gfx1100", or "emulated-gfx11" for an NVIDIA build
    path: Path
    sha256: str
    emulated: bool

    def read_verified(self) -> bytes:
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ArtifactError(f"{self.path.name} does not match the sha256 in its manifest (damaged or replaced)")
        return data


def prebuilt_dir() -> Path:
    inside_package = PACKAGE_DIR / "prebuilt"
    return inside_package if inside_package.is_dir() else PACKAGE_DIR.parent / "prebuilt"


def emulation_dir() -> Path:
    return Path(os.environ.get("RDNA_FA_EMU_DIR") or PACKAGE_DIR.parent / "build" / "emu")


@lru_cache(maxsize=None)
def load_manifest(directory: Path | None = None) -> dict:
    path = (directory or prebuilt_dir()) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"no kernel manifest at {path}") from None
    except (OSError, ValueError) as error:
        raise ArtifactError(f"kernel manifest {path} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("targets"), dict):
        raise ArtifactError(f"kernel manifest {path} has no targets table")
    if manifest.get("abi_version") != variants.ABI_VERSION:
        raise ArtifactError(f"kernel manifest ABI {manifest.get('abi_version')} != {variants.ABI_VERSION} of this package")
    return manifest


def amd_artifact(target: str) -> Artifact:
    directory = prebuilt_dir()
    entry = load_manifest(directory)["targets"].get(target)
    if entry is None:
        raise ArtifactError(f"no prebuilt code object for {target}")
    path = directory / entry["file"]
    if not path.is_file():
        raise ArtifactError(f"{path.name} listed in the manifest is missing")
    return Artifact(target, path, entry["sha256"], emulated=False)


def emulated_artifact(layer: str) -> Artifact:
    if layer not in EMULATED_LAYERS:
        raise ArtifactError(f"unknown emulated layer {layer!r}; expected one of {', '.join(EMULATED_LAYERS)}")
    path = emulation_dir() / f"rdna_fa_emu_{layer}.fatbin"
    if not path.is_file():
        raise ArtifactError(f"no emulation build at {path}: run python kernels/build.py --no-amd --emulate")
    # Built locally, not shipped: its own bytes are the reference.
    return Artifact(f"emulated-{layer}", path, hashlib.sha256(path.read_bytes()).hexdigest(), emulated=True)
