"""The facts the kernel build and the loader share: which code object versions each target gets, what
the files are called, how the manifest lists them, and the hash of the sources they were built from.

kernels/build.py and the local rebuild write manifests with these names, the runtime reads them, and
install.py and CI check them. Standard library only, and no import of the package: install.py loads
this file by its path, without torch (under ZLUDA the host's install step cannot even reach the GPU).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MANIFEST_FILE = "manifest.json"
PREBUILT_TARGETS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1200", "gfx1201")
# Code object version 5 is what HIP 6.0 and newer emit and load by default; version 4 is built beside it
# for the targets HIP 5.x knows (gfx1100-gfx1103), whose runtimes had it as their default. The machine
# code is the same: the kernels read no implicit (hidden) kernel argument, so only the ELF ABI version and
# the metadata differ (see docs/hip_runtimes.md).
CODE_OBJECT_VERSION = 5
LEGACY_CODE_OBJECT_VERSION = 4
CODE_OBJECT_VERSIONS = (CODE_OBJECT_VERSION, LEGACY_CODE_OBJECT_VERSION)  # default first
LEGACY_TARGETS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103")
# The "RDNA 4m" APUs (gfx1170, gfx1171) run gfx12-style WMMA under gfx11 numbers: a gfx11 code object's
# matrix instructions mean something else there, and neither clang-19 nor clang-22 builds for them.
RDNA4M_PREFIX = "gfx117"
MAIN_SOURCE = "attention.hip"
INSTANCES_HEADER = "instances.inc"
# -cuid: clang otherwise names a symbol after a hash of paths and options, and the code objects would
# differ between checkouts.
CLANG_FLAGS = "-x hip --cuda-device-only --no-gpu-bundle-output -nogpulib -nogpuinc -O3 -std=c++17 -cuid=rdna_flash_attn"


def rdna4m_refusal(target: str) -> str | None:
    """Why no code object may ever be loaded or built for an RDNA 4m target, or None for any other."""
    if not target.startswith(RDNA4M_PREFIX):
        return None
    return (f"{target} is an RDNA 4m APU: it runs gfx12-style WMMA under a gfx11 number, so the gfx11 code "
            "objects cannot run there, and no compiler this project uses (clang-19, clang-22) builds for it")


def clang_flags(code_object_version: int = CODE_OBJECT_VERSION) -> list[str]:
    return [*CLANG_FLAGS.split(), f"-mcode-object-version={code_object_version}"]


def artifact_name(target: str, code_object_version: int = CODE_OBJECT_VERSION) -> str:
    """rdna_fa_gfx1100.hsaco for the default version, rdna_fa_gfx1100.cov4.hsaco for version 4."""
    suffix = "" if code_object_version == CODE_OBJECT_VERSION else f".cov{code_object_version}"
    return f"rdna_fa_{target}{suffix}.hsaco"


def code_object_versions(target: str) -> tuple[int, ...]:
    """The code object versions built for a target: the default one, and version 4 where HIP 5.x knows it."""
    return CODE_OBJECT_VERSIONS if target in LEGACY_TARGETS else (CODE_OBJECT_VERSION,)


def manifest_table(code_object_version: int) -> str:
    """The manifest's table of one code object version: "targets" for the default, "targets_cov4"."""
    return "targets" if code_object_version == CODE_OBJECT_VERSION else f"targets_cov{code_object_version}"


def listed_code_objects(manifest: dict) -> list[tuple[str, int, object]]:
    """(target, code object version, entry) for every code object a manifest lists, default version
    first; an entry is whatever the table holds (a reader checks its form)."""
    return [(target, version, entry) for version in CODE_OBJECT_VERSIONS
            for target, entry in manifest.get(manifest_table(version), {}).items()]


def _code_object_problem(directory: Path, entry: object) -> str | None:
    """What is wrong with the code object a manifest entry names in `directory`, in a few words, or
    None when the file is there and matches the entry's sha256."""
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)):
        return "its manifest entry is malformed"
    try:
        data = (directory / entry["file"]).read_bytes()
    except FileNotFoundError:
        return f"{entry['file']} is missing"
    except OSError as error:
        return f"{entry['file']} is unreadable ({error.strerror or error})"
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        return f"{entry['file']} does not match the sha256 in its manifest (damaged or replaced)"
    return None


def verify_code_objects(directory: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(targets whose every code object is there and matches its sha256, "target: problem" for each code
    object that does not), judged target by target: a bad entry or file costs its own target only, as
    the runtime then refuses that target's code object and no other."""
    problems, damaged = [], set()
    for target, version, entry in listed_code_objects(manifest):
        problem = _code_object_problem(directory, entry)
        if problem is not None:
            where = "" if version == CODE_OBJECT_VERSION else f" (code object v{version})"
            problems.append(f"{target}{where}: {problem}")
            damaged.add(target)
    listed = dict.fromkeys(target for target, _, _ in listed_code_objects(manifest))
    return [target for target in listed if target not in damaged], problems


def source_files(kernels: Path) -> list[Path]:
    """The kernel sources; with the flags and the variant list they decide the code objects."""
    return sorted(p for p in kernels.rglob("*") if p.suffix in (".h", ".hip"))


def source_hash(kernels: Path, variant_lines: str) -> str:
    """Hash of the sources (named as kernels/..., wherever they lie), the clang flags and the generated
    variant list (`variant_lines`, variants.instantiation_lines()): a change to anything else leaves
    the code objects as they are. Equal for a git checkout and the wheel's copy of the same sources."""
    digest = hashlib.sha256()
    for version in CODE_OBJECT_VERSIONS:
        digest.update(f"clang flags: {' '.join(clang_flags(version))}\n".encode())
    digest.update(f"version 4 for: {' '.join(LEGACY_TARGETS)}\n".encode())
    digest.update(f"variants:\n{variant_lines}".encode())
    for path in source_files(kernels):
        digest.update(f"kernels/{path.relative_to(kernels).as_posix()}".encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return digest.hexdigest()
