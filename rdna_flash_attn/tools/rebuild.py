"""Builds AMD code objects from the kernel sources: kernels/build.py uses it for prebuilt/, and a user
runs it (`python -m rdna_flash_attn rebuild`) for a GPU target that has no prebuilt code object, or to
replace one, building into the user cache.

The compile is clang >= 19 with builtins only (no ROCm headers or device libraries) and a pinned
-cuid, so the same clang release gives the same bytes from any folder: Debian's clang-19 reproduces
prebuilt/ exactly. The flags, file names and manifest tables are runtime/build_facts.py's, which the
loader reads too; nothing compiles unless a user or a build script asks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dispatch import selftest
from ..runtime import artifacts, device as devices, loader, variants
from ..runtime.build_facts import (CODE_OBJECT_VERSION, CODE_OBJECT_VERSIONS, INSTANCES_HEADER, MAIN_SOURCE,
                                   MANIFEST_FILE, artifact_name, clang_flags, code_object_versions, manifest_table,
                                   rdna4m_refusal)

RDNA_TARGET = re.compile(r"gfx1[12][0-9a-f]{2}")  # the gfx11 and gfx12 matrix layers (isa/isa.h)
MIN_CLANG_MAJOR = 19
CACHE_DIR_VARIABLE = "RDNA_FA_CACHE_DIR"  # settings.cache_dir, which moves the user cache
VERSION_TIMEOUT_S = 30
PROGRESS_EVERY_S = 30

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """A local build cannot be done; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str  # clang's first --version line, recorded in the manifest
    major: int


def check_target(target: str) -> str:
    """The target name as clang wants it, or BuildError for anything that is not RDNA3/RDNA4."""
    name = target.strip().lower()
    if not RDNA_TARGET.fullmatch(name):
        raise BuildError(f"{target!r} is not an RDNA3/RDNA4 GPU target (gfx11xx or gfx12xx, e.g. gfx1100)")
    refusal = rdna4m_refusal(name)
    if refusal:
        raise BuildError(refusal)
    return name


# --- the compiler -----------------------------------------------------------------------------------

# Spelled out: before Python 3.12, shutil.which() adds no PATHEXT (.exe) to a name with a folder.
CLANG_FILE = "clang.exe" if os.name == "nt" else "clang"


def clang_candidates(explicit: str | None = None) -> list[str]:
    """Where to look, best first: what the user named; Debian/LLVM clang-19 (the release that built
    prebuilt/, so it reproduces them); ROCm's and the HIP SDK's clang; newer system clangs."""
    if explicit:
        return [explicit]
    names = ["clang-19"]
    for variable, default in (("ROCM_PATH", "/opt/rocm"), ("HIP_PATH", None)):
        root = os.environ.get(variable) or default
        if root:
            names += [str(Path(root) / "llvm" / "bin" / CLANG_FILE), str(Path(root) / "bin" / CLANG_FILE)]
    names += ["clang-20", "clang-21", "clang-22", "clang"]
    return list(dict.fromkeys(names))


def _version_line(path: str) -> str:
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                                check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(does not run: {error})"
    lines = result.stdout.splitlines()
    return lines[0].strip() if lines else "(printed no version)"


def find_clang(explicit: str | None = None) -> Compiler:
    """The first usable clang >= 19, or BuildError naming what was found and why it does not do.
    Older clangs fail on this code: clang-15 crashes on WMMA code above -O0, clang-16 lacks gfx1201,
    and LLVM before 2024 misses a gfx11 WMMA hazard (wrong results)."""
    rejected = []
    for name in clang_candidates(explicit):
        path = shutil.which(name)
        if path is None:
            continue
        version = _version_line(path)
        match = re.search(r"clang version (\d+)", version)
        if match and int(match.group(1)) >= MIN_CLANG_MAJOR:
            return Compiler(path, version, int(match.group(1)))
        rejected.append(f"{path}: {version}")
    if rejected:
        raise BuildError(f"no clang >= {MIN_CLANG_MAJOR} found; too old or unusable: {'; '.join(rejected)}. "
                         f"{_install_hint()}")
    if explicit:
        raise BuildError(f"clang {explicit!r} not found. {_install_hint()}")
    raise BuildError(f"no clang found (looked for clang-19, ROCm's and the HIP SDK's clang, clang). {_install_hint()}")


def _install_hint() -> str:
    if os.name == "nt":
        return "Install AMD's HIP SDK 6.2 or newer (its bin\\clang.exe is clang 19) and set HIP_PATH, or pass --clang."
    return "Install clang-19 (Debian/Ubuntu: apt-get install clang-19 lld-19) or ROCm 6.4+, or pass --clang."


# --- the build --------------------------------------------------------------------------------------


def clang_command(clang: str, target: str, include_dir: Path, output: Path, kernels: Path | None = None,
                  code_object_version: int = CODE_OBJECT_VERSION) -> list[str]:
    """One code object's compile, exactly as kernels/build.py's ninja rule runs it."""
    main = (kernels or artifacts.kernels_dir()) / MAIN_SOURCE
    return [clang, *clang_flags(code_object_version), f"--offload-arch={target}", f"-I{include_dir}", str(main),
            "-o", str(output)]


def write_instances(directory: Path) -> Path:
    """The generated variant list the main source includes; rewritten only when it changes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / INSTANCES_HEADER
    text = variants.instantiation_lines()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _clang_failure(compiler: Compiler, target: str, stderr: str) -> BuildError:
    if re.search(r"unsupported|unknown target|invalid target|not a recognized", stderr, re.IGNORECASE):
        return BuildError(f"{compiler.version} does not know {target}: a newer clang is needed")
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return BuildError(f"clang failed for {target}: {tail or 'no message'}")


def _compile_one(compiler: Compiler, target: str, version: int, include_dir: Path, out_dir: Path, step: str,
                 progress: Progress) -> None:
    output = out_dir / artifact_name(target, version)
    partial = out_dir / f".{output.name}.{os.getpid()}.part"
    started = time.monotonic()
    progress(f"{step} {target}: compiling code object v{version} ({len(variants.target_symbols(target))} kernels, "
             "usually a few minutes)")
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(clang_command(compiler.path, target, include_dir, partial,
                                                 code_object_version=version),
                                   stdout=subprocess.DEVNULL, stderr=errors)
        while True:
            try:
                process.wait(timeout=PROGRESS_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                progress(f"{step} {target}: still compiling ({time.monotonic() - started:.0f} s)")
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    if process.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise _clang_failure(compiler, target, stderr)
    os.replace(partial, output)  # atomic: a process loading it never sees half a file
    progress(f"{step} {target}: v{version} done in {time.monotonic() - started:.0f} s "
             f"({output.stat().st_size / 1e6:.1f} MB)")


def compile_targets(compiler: Compiler, targets: Iterable[str], out_dir: Path, jobs: int | None = None,
                    progress: Progress = print) -> None:
    """Compile each target's code objects into out_dir (one clang per code object, `jobs` at a time)."""
    builds = [(target, version) for target in targets for version in code_object_versions(target)]
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rdna_fa_gen_") as generated:
        write_instances(Path(generated))
        workers = max(1, min(jobs or os.cpu_count() or 1, len(builds)))
        with ThreadPoolExecutor(workers) as pool:
            steps = [pool.submit(_compile_one, compiler, target, version, Path(generated), out_dir,
                                 f"[{i}/{len(builds)}]", progress)
                     for i, (target, version) in enumerate(builds, 1)]
            for step in steps:
                step.result()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(out_dir: Path, built: Iterable[str], compiler_version: str, kernels: Path | None = None) -> Path:
    """Add the built targets' code objects to out_dir/manifest.json: the default version under "targets",
    version 4 under "targets_cov4"; entries built from other sources are dropped."""
    path = out_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        manifest = {}
    new_sources = artifacts.source_hash(kernels)
    keep = manifest.get("source_hash") == new_sources
    tables = {version: dict(manifest.get(manifest_table(version), {})) if keep else {}
              for version in CODE_OBJECT_VERSIONS}
    for target in built:
        for version in code_object_versions(target):
            file = out_dir / artifact_name(target, version)
            tables[version][target] = {
                "file": file.name,
                "sha256": sha256_file(file),
                "size": file.stat().st_size,
                "code_object_version": version,
                "kernels": list(variants.target_symbols(target)),
            }
    manifest = {
        "abi_version": variants.ABI_VERSION,
        "compiler": compiler_version,
        "code_object_version": CODE_OBJECT_VERSION,
        "source_hash": new_sources,
        **{manifest_table(version): dict(sorted(table.items())) for version, table in tables.items()},
    }
    partial = path.with_name(f".manifest.{os.getpid()}.part")
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, path)
    return path


def _writable_folder(folder: Path) -> Path:
    """The folder, created if needed, or BuildError naming it and the variable that moves the cache."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise BuildError(f"cannot write to the cache folder {folder} ({error.strerror or error}): "
                         f"set {CACHE_DIR_VARIABLE} to a writable folder") from None
    return folder


def build_local(targets: Iterable[str], clang: str | None = None, jobs: int | None = None,
                progress: Progress = print) -> Path:
    """Build targets into the user cache, where the runtime prefers them to prebuilt/; returns the folder."""
    targets = sorted({check_target(t) for t in targets})
    compiler = find_clang(clang)
    out_dir = _writable_folder(artifacts.local_build_dir())
    progress(f"building {', '.join(targets)} into {out_dir} with {compiler.path} ({compiler.version})")
    compile_targets(compiler, targets, out_dir, jobs, progress)
    write_manifest(out_dir, targets, compiler.version)
    return out_dir


# --- python -m rdna_flash_attn rebuild --------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="comma-separated GPU targets, e.g. gfx1100 (default: each AMD GPU torch sees)")
    parser.add_argument("--clang", help="clang executable (default: clang-19, ROCm's or the HIP SDK's clang, clang)")
    parser.add_argument("--jobs", type=int, help="targets compiled at once (default: one per CPU core)")
    parser.add_argument("--no-selftest", action="store_true", help="do not run the self-test on a matching GPU")
    parser.add_argument("--clear", action="store_true", help="delete every local build (the prebuilt ones apply again)")


def _amd_gpus() -> list[tuple[torch.device, str]]:
    """(torch device, gfx target) of every AMD GPU torch sees."""
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        info = devices.describe(torch.device("cuda", index))
        if info.is_amd and info.gfx_target:
            found.append((torch.device("cuda", index), info.gfx_target))
    return found


def _selftest_built(gpus: list[tuple[torch.device, str]], built: list[str]) -> int:
    """The self-test of the new code objects on each GPU of a built target; the code objects loaded
    before (and every verdict made on them) are dropped first."""
    loader.forget_libraries()
    failed = False
    for gpu, target in gpus:
        if target not in built:
            continue
        try:
            record = selftest.run(gpu, loader.loaded_library_for(gpu))
        except loader.KernelUnavailable as error:
            record = {"passed": False, "reason": str(error)}
        print(f"self-test on {gpu} ({target}): {'passed' if record['passed'] else record['reason']}")
        failed = failed or not record["passed"]
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """0 built (and self-tested where a GPU of the target is here) or cleared, 1 the build, self-test or
    clearing failed."""
    if args.clear:
        root = artifacts.local_builds_root()
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            print(f"rebuild: could not delete every local build under {root}; delete that folder by hand, "
                  f"or set {CACHE_DIR_VARIABLE} to another folder", file=sys.stderr)
            return 1
        print(f"removed local builds under {root}: prebuilt code objects apply again")
        return 0
    gpus = _amd_gpus()
    targets = args.target.split(",") if args.target else sorted({target for _, target in gpus})
    if not targets:
        print("rebuild: no AMD GPU visible to torch; name the target, e.g. --target gfx1100", file=sys.stderr)
        return 1
    try:
        out_dir = build_local(targets, args.clang, args.jobs)
    except BuildError as error:
        print(f"rebuild: {error}", file=sys.stderr)
        print("rebuild: nothing changed; attention keeps running where it did (prebuilt kernels or PyTorch SDPA)",
              file=sys.stderr)
        return 1
    built = sorted({check_target(t) for t in targets})
    print(f"built {', '.join(built)} into {out_dir}; the runtime uses them from now on "
          "(python -m rdna_flash_attn rebuild --clear goes back to the prebuilt ones)")
    if args.no_selftest:
        return 0
    if not any(target in built for _, target in gpus):
        print("no GPU of these targets here: the self-test runs on first use on one")
        return 0
    return _selftest_built(gpus, built)
