"""Where the code objects are and whether they are the ones the manifest names.

AMD code objects ship in prebuilt/ (inside the package in a wheel, beside it in a git checkout) with
a manifest of sha256s. A local rebuild (`python -m rdna_flash_attn rebuild`) puts code objects and
their own manifest in the user cache, in a folder named after the kernel sources' hash, so an upgraded
package never picks up code objects built from other sources; a target built there is preferred to
the prebuilt one (the user asked for it, or there is no prebuilt one). The NVIDIA emulation builds are
made locally by kernels/build.py --emulate.

A target can have code objects of two versions (build_facts.code_object_versions): the manifest lists
the default version 5 under "targets" and version 4 under "targets_cov4"; the runtime picks one by the
HIP runtime's version (loader.code_object_preference).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .. import environment
from ..config import LOGGER_NAME, settings
from . import variants
from .build_facts import (CODE_OBJECT_VERSION, CODE_OBJECT_VERSIONS, LEGACY_CODE_OBJECT_VERSION, MAIN_SOURCE,
                          MANIFEST_FILE, listed_code_objects, manifest_table, rdna4m_refusal, verify_code_objects)
from .build_facts import source_hash as sources_and_variants_hash

log = logging.getLogger(LOGGER_NAME)

PACKAGE_DIR = Path(__file__).resolve().parent.parent
ON_WINDOWS = os.name == "nt"
EMULATED_LAYERS = ("gfx11", "gfx12")
RDNA_PREFIXES = ("gfx11", "gfx12")
LOCAL_BUILDS = "kernels"  # subfolder of the user cache
REINSTALL_HINT = "reinstall rdna_flash_attn to repair it"
REBUILD_HINT = "python -m rdna_flash_attn rebuild makes it again"


class ArtifactError(RuntimeError):
    """A code object or the manifest is missing, unreadable or not what the manifest says."""


@dataclass(frozen=True)
class Artifact:
    target: str  # "gfx1100", or "emulated-gfx11" for an NVIDIA build
    path: Path
    sha256: str
    emulated: bool
    local: bool = False  # built on this machine by `python -m rdna_flash_attn rebuild`
    code_object_version: int | None = CODE_OBJECT_VERSION  # None for an NVIDIA build

    def read_verified(self) -> bytes:
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            repair = REBUILD_HINT if self.local else REINSTALL_HINT
            raise ArtifactError(
                f"{self.path.name} does not match the sha256 in its manifest (damaged or replaced): {repair}")
        return data


def prebuilt_dir() -> Path:
    inside_package = PACKAGE_DIR / "prebuilt"
    return inside_package if inside_package.is_dir() else PACKAGE_DIR.parent / "prebuilt"


def kernels_dir() -> Path:
    """The kernel sources: inside the package in a wheel, beside it in a git checkout."""
    inside_package = PACKAGE_DIR / "kernels"
    return inside_package if (inside_package / MAIN_SOURCE).is_file() else PACKAGE_DIR.parent / "kernels"


@lru_cache(maxsize=None)
def source_hash(kernels: Path | None = None) -> str:
    """The hash of these kernel sources (build_facts.source_hash), the name of their local builds' folder."""
    return sources_and_variants_hash(kernels or kernels_dir(), variants.instantiation_lines())


def emulation_dir() -> Path:
    return environment.read(os.environ, "RDNA_FA_EMU_DIR", Path, PACKAGE_DIR.parent / "build" / "emu")


def _read_manifest(path: Path, repair: str = REINSTALL_HINT) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"no kernel manifest at {path}: {repair}") from None
    except (OSError, ValueError) as error:
        raise ArtifactError(f"kernel manifest {path} is unreadable ({error}): {repair}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("targets"), dict):
        raise ArtifactError(f"kernel manifest {path} has no targets table: {repair}")
    if not isinstance(manifest.get(manifest_table(LEGACY_CODE_OBJECT_VERSION), {}), dict):
        raise ArtifactError(f"kernel manifest {path} has a malformed {manifest_table(LEGACY_CODE_OBJECT_VERSION)} "
                            f"table: {repair}")
    if manifest.get("abi_version") != variants.ABI_VERSION:
        raise ArtifactError(f"kernel manifest ABI {manifest.get('abi_version')} != {variants.ABI_VERSION} of this package")
    return manifest


@lru_cache(maxsize=None)
def load_manifest(directory: Path | None = None) -> dict:
    return _read_manifest((directory or prebuilt_dir()) / MANIFEST_FILE)


def user_cache_dir() -> Path:
    """settings.cache_dir, else the user cache folder (%LOCALAPPDATA%, $XDG_CACHE_HOME or ~/.cache)."""
    if settings.cache_dir:
        return Path(settings.cache_dir)
    if ON_WINDOWS:
        base = os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local"
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rdna_flash_attn"


def local_builds_root() -> Path:
    return user_cache_dir() / LOCAL_BUILDS


def local_build_dir() -> Path:
    """Where local builds of this package's kernel sources go: named after their hash."""
    return local_builds_root() / source_hash()[:16]


def local_build_targets() -> list[str]:
    """Targets built locally from these sources ([] when none, or when their manifest is unreadable)."""
    try:
        return sorted(_read_manifest(local_build_dir() / MANIFEST_FILE, REBUILD_HINT)["targets"])
    except ArtifactError:
        return []


def _entry(manifest: dict, target: str, manifest_path: Path, repair: str = REINSTALL_HINT,
           code_object_version: int = CODE_OBJECT_VERSION) -> dict | None:
    entry = manifest.get(manifest_table(code_object_version), {}).get(target)
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
        version = "" if code_object_version == CODE_OBJECT_VERSION else f" (code object v{code_object_version})"
        raise ArtifactError(f"kernel manifest {manifest_path} has a malformed entry for {target}{version}: {repair}")
    return entry


def _local_artifacts(target: str) -> list[Artifact]:
    """The local builds of `target` for these sources (default version first), or []. An unreadable
    local manifest or a missing local file is logged and skipped, so the prebuilt code objects (if any)
    serve instead."""
    directory = local_build_dir()
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return []
    try:
        manifest = _read_manifest(manifest_path, REBUILD_HINT)
        entries = [(version, _entry(manifest, target, manifest_path, REBUILD_HINT, version))
                   for version in CODE_OBJECT_VERSIONS]
    except ArtifactError as error:
        log.warning("ignoring the local kernel builds: %s", error)
        return []
    found = []
    for version, entry in entries:
        if entry is None:
            continue
        path = directory / entry["file"]
        if not path.is_file():
            log.warning("ignoring the local build of %s: %s is missing (python -m rdna_flash_attn rebuild --target %s)",
                        target, path, target)
            return []
        found.append(Artifact(target, path, entry["sha256"], emulated=False, local=True, code_object_version=version))
    return found


def _prebuilt_artifacts(target: str) -> list[Artifact]:
    directory = prebuilt_dir()
    manifest = load_manifest(directory)
    found = []
    for version in CODE_OBJECT_VERSIONS:
        entry = _entry(manifest, target, directory / MANIFEST_FILE, code_object_version=version)
        if entry is None:
            continue
        path = directory / entry["file"]
        if not path.is_file():
            raise ArtifactError(f"{path.name} listed in the manifest is missing from {directory}: {REINSTALL_HINT}")
        found.append(Artifact(target, path, entry["sha256"], emulated=False, code_object_version=version))
    if not found:
        raise ArtifactError(_no_code_object(target, manifest))
    return found


def _no_code_object(target: str, manifest: dict) -> str:
    shipped = ", ".join(manifest["targets"])
    if not target.startswith(RDNA_PREFIXES):
        return f"no code object for {target}: the kernels run on RDNA3/RDNA4 GPUs (prebuilt: {shipped})"
    return (f"no prebuilt code object for {target} (prebuilt: {shipped}); build one with "
            f"'python -m rdna_flash_attn rebuild --target {target}' (needs clang >= 19)")


def amd_artifacts(target: str) -> list[Artifact]:
    """The code objects of a GPU target, default version first: the local build of these sources if
    there is one, else the prebuilt ones. ArtifactError for an RDNA 4m target, whatever lies in the folders."""
    refusal = rdna4m_refusal(target)
    if refusal:
        raise ArtifactError(refusal)
    return _local_artifacts(target) or _prebuilt_artifacts(target)


def amd_artifact(target: str) -> Artifact:
    """The code object for a GPU target in the default version: a local build first, else the prebuilt one."""
    return amd_artifacts(target)[0]


def prebuilt_artifact(target: str, code_object_version: int = CODE_OBJECT_VERSION) -> Artifact:
    """The shipped code object of `target` in `code_object_version`, never a local build: what the
    CPU interpreter and its tests check. Raises ArtifactError when prebuilt/ has none."""
    for artifact in _prebuilt_artifacts(target):
        if artifact.code_object_version == code_object_version:
            return artifact
    raise ArtifactError(f"no prebuilt code object v{code_object_version} for {target}")


def verify_prebuilt(directory: Path | None = None) -> tuple[list[str], list[str]]:
    """(targets whose code objects all match their sha256, one-line problems), for doctor; judged target
    by target by build_facts.verify_code_objects, which install.py runs too."""
    directory = directory or prebuilt_dir()
    try:
        manifest = _read_manifest(directory / MANIFEST_FILE)
    except ArtifactError as error:
        return [], [str(error)]
    return verify_code_objects(directory, manifest)


def prebuilt_code_object_versions(directory: Path | None = None) -> dict[int, list[str]]:
    """{code object version: targets} of the prebuilt manifest ({} when it is unreadable), for doctor."""
    try:
        manifest = _read_manifest((directory or prebuilt_dir()) / MANIFEST_FILE)
    except ArtifactError:
        return {}
    versions: dict[int, list[str]] = {}
    for target, version, _ in listed_code_objects(manifest):
        versions.setdefault(version, []).append(target)
    return versions


def emulated_artifact(layer: str) -> Artifact:
    if layer not in EMULATED_LAYERS:
        raise ArtifactError(f"unknown emulated layer {layer!r}; expected one of {', '.join(EMULATED_LAYERS)}")
    path = emulation_dir() / f"rdna_fa_emu_{layer}.fatbin"
    if not path.is_file():
        raise ArtifactError(f"no emulation build at {path}: run python kernels/build.py --no-amd --emulate")
    # Built locally, not shipped: its own bytes are the reference.
    return Artifact(f"emulated-{layer}", path, hashlib.sha256(path.read_bytes()).hexdigest(), emulated=True,
                    code_object_version=None)
