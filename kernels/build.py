"""Builds the kernel code objects.

    python kernels/build.py                      # every AMD target into prebuilt/ + manifest.json
                                                 # (code object v5, and v4 for gfx1100-gfx1103)
    python kernels/build.py --targets gfx1100    # some targets only (the manifest keeps the others)
    python kernels/build.py --emulate            # NVIDIA emulation builds (gfx11 and gfx12) into build/emu/
    python kernels/build.py --check              # manifest matches the sources and the files

AMD code objects come from clang >= 19 with builtins only (no ROCm headers or device libraries), so
Debian's clang-19 reproduces them byte for byte. The flags, file names and manifest tables live in
rdna_flash_attn/runtime/build_facts.py (which the loader reads too), the compiler search and the manifest
writer in rdna_flash_attn/tools/rebuild.py (which a user's local rebuild runs too); here ninja runs the
compiles in parallel and shows progress.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
PREBUILT = ROOT / "prebuilt"
BUILD = ROOT / "build"
EMU_DIR = BUILD / "emu"
GENERATED = BUILD / "gen"
sys.path.insert(0, str(ROOT))

from rdna_flash_attn.runtime import variants  # noqa: E402  (needs ROOT on the path)
from rdna_flash_attn.runtime.artifacts import source_hash  # noqa: E402
from rdna_flash_attn.runtime.build_facts import (  # noqa: E402
    MAIN_SOURCE,
    PREBUILT_TARGETS as AMD_TARGETS,
    artifact_name,
    clang_flags,
    code_object_versions,
    manifest_table,
    source_files,
)
from rdna_flash_attn.tools.rebuild import BuildError, find_clang, sha256_file, write_instances, write_manifest  # noqa: E402

EMULATED_LAYERS = ("gfx11", "gfx12")
CUDA_ARCHS = ("80", "90")


def nvcc_flags(cuda_archs) -> str:
    return "-O3 -std=c++17 -x cu -fatbin " + " ".join(f"-gencode arch=compute_{a},code=sm_{a}" for a in cuda_archs)


def emulated_name(layer: str) -> str:
    return f"rdna_fa_emu_{layer}.fatbin"


def ninja_file(clang: str | None, targets: list[str], emulate: bool, out_dir: Path, cuda_archs=CUDA_ARCHS) -> str:
    deps = " ".join(str(p) for p in source_files(KERNELS)) + f" {GENERATED / 'instances.inc'}"
    main = KERNELS / MAIN_SOURCE
    lines = [
        f"rule hip\n  command = {clang} $flags --offload-arch=$target -I{GENERATED} $in -o $out\n"
        "  description = clang $target code object v$version",
        f"rule nvcc\n  command = nvcc {nvcc_flags(cuda_archs)} -DRDNA_EMULATE=$layer -I{GENERATED} $in -o $out\n"
        "  description = nvcc emulated gfx$layer",
    ]
    for target in targets:
        for version in code_object_versions(target):
            lines.append(f"build {out_dir / artifact_name(target, version)}: hip {main} | {deps}\n"
                         f"  target = {target}\n  version = {version}\n  flags = {' '.join(clang_flags(version))}")
    if emulate:
        for layer in EMULATED_LAYERS:
            lines.append(f"build {EMU_DIR / emulated_name(layer)}: nvcc {main} | {deps}\n  layer = {layer[3:]}")
    return "\n".join(lines) + "\n"


def run_ninja(text: str, jobs: int | None) -> None:
    BUILD.mkdir(parents=True, exist_ok=True)
    (BUILD / "build.ninja").write_text(text)
    ninja = shutil.which("ninja")
    if not ninja:
        sys.exit("ninja not found: pip install ninja")
    command = [ninja, "-C", str(BUILD)] + ([f"-j{jobs}"] if jobs else [])
    if subprocess.run(command).returncode != 0:
        sys.exit("kernel build failed")


def load_manifest(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def check(out_dir: Path) -> int:
    manifest = load_manifest(out_dir / "manifest.json")
    problems = []
    if manifest.get("source_hash") != source_hash(KERNELS):
        problems.append("kernel sources changed since prebuilt/ was built: run python kernels/build.py")
    if manifest.get("abi_version") != variants.ABI_VERSION:
        problems.append("manifest ABI version differs from rdna_flash_attn/runtime/variants.py")
    for target in AMD_TARGETS:
        for version in code_object_versions(target):
            entry = manifest.get(manifest_table(version), {}).get(target)
            if entry is None:
                problems.append(f"{target}: code object v{version} missing from the manifest")
                continue
            file = out_dir / entry["file"]
            if not file.exists():
                problems.append(f"{target}: {file.name} missing")
            elif sha256_file(file) != entry["sha256"]:
                problems.append(f"{target}: {file.name} does not match its sha256")
    for problem in problems:
        print(f"manifest check: {problem}", file=sys.stderr)
    if not problems:
        count = sum(len(code_object_versions(target)) for target in AMD_TARGETS)
        print(f"manifest check: {len(AMD_TARGETS)} targets ({count} code objects) match the sources "
              f"({manifest['source_hash'][:12]})")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", help="comma-separated AMD targets (default: all)")
    parser.add_argument("--no-amd", action="store_true", help="build no AMD target")
    parser.add_argument("--emulate", action="store_true", help="also build the NVIDIA emulation (needs nvcc)")
    parser.add_argument("--cuda-archs", default=",".join(CUDA_ARCHS),
                        help="comma-separated NVIDIA architectures of the emulation (90 alone: half the size, "
                             "for the H100/H200 test machines)")
    parser.add_argument("--out", type=Path, default=PREBUILT, help="where the AMD code objects go")
    parser.add_argument("--clang", help="clang executable (default: clang-19, then ROCm's, then a newer clang)")
    parser.add_argument("--jobs", type=int, help="parallel compiles (ninja's default otherwise)")
    parser.add_argument("--check", action="store_true", help="only verify the manifest against sources and files")
    args = parser.parse_args(argv)
    cuda_archs = [arch.strip() for arch in args.cuda_archs.split(",")]
    if not all(arch.isdigit() for arch in cuda_archs):
        parser.error(f"--cuda-archs: comma-separated numbers such as 80,90, not {args.cuda_archs!r}")
    out_dir = args.out.resolve()
    if args.check:
        return check(out_dir)
    targets = [] if args.no_amd else (args.targets.split(",") if args.targets else list(AMD_TARGETS))
    unknown = sorted(set(targets) - set(AMD_TARGETS))
    if unknown:
        parser.error(f"unknown target(s): {', '.join(unknown)}")
    try:
        compiler = find_clang(args.clang) if targets else None
    except BuildError as error:
        sys.exit(str(error))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_instances(GENERATED)
    run_ninja(ninja_file(compiler and compiler.path, targets, args.emulate, out_dir, cuda_archs),
              args.jobs)
    if targets:
        write_manifest(out_dir, targets, compiler.version, KERNELS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
