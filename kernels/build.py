"""Builds the kernel code objects.

    python kernels/build.py                      # every AMD target into prebuilt/ + manifest.json
    python kernels/build.py --targets gfx1100    # some targets only (the manifest keeps the others)
    python kernels/build.py --emulate            # NVIDIA emulation builds (gfx11 and gfx12) into build/emu/
    python kernels/build.py --check              # manifest matches the sources and the files

AMD code objects come from clang >= 19 with builtins only (no ROCm headers or device libraries), so
Debian's clang-19 reproduces them byte for byte. ninja runs the compiles in parallel and shows
progress.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
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

from rdna_flash_attn import variants  # noqa: E402  (needs ROOT on the path)

AMD_TARGETS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1200", "gfx1201")
EMULATED_LAYERS = ("gfx11", "gfx12")
CUDA_ARCHS = ("80", "90")
CODE_OBJECT_VERSION = 5
MAIN_SOURCE = "attention.hip"
# -cuid: clang otherwise names a symbol after a hash of paths and options, and the code objects would
# differ between checkouts.
CLANG_FLAGS = (
    "-x hip --cuda-device-only --no-gpu-bundle-output -nogpulib -nogpuinc -O3 -std=c++17 "
    f"-mcode-object-version={CODE_OBJECT_VERSION} -cuid=rdna_flash_attn"
)
NVCC_FLAGS = "-O3 -std=c++17 -x cu -fatbin " + " ".join(f"-gencode arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS)
MIN_CLANG_MAJOR = 19


def artifact_name(target: str) -> str:
    return f"rdna_fa_{target}.hsaco"


def emulated_name(layer: str) -> str:
    return f"rdna_fa_emu_{layer}.fatbin"


def source_files() -> list[Path]:
    """The kernel sources; with the flags and the variant list they decide the code objects."""
    return sorted(p for p in KERNELS.rglob("*") if p.suffix in (".h", ".hip"))


def source_hash() -> str:
    """Hash of the sources, the clang flags and the generated variant list: a change to anything else
    (variants.py's Python included) leaves the code objects as they are."""
    digest = hashlib.sha256()
    digest.update(f"clang flags: {CLANG_FLAGS}\n".encode())
    digest.update(f"variants:\n{variants.instantiation_lines()}".encode())
    for path in source_files():
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def find_clang(explicit: str | None) -> tuple[str, str]:
    """The clang to use and its version line; clang-15 crashes on WMMA code and clang-16 lacks gfx1201."""
    candidates = [explicit] if explicit else ["clang-19", "clang-20", "clang-21", "clang"]
    for name in candidates:
        path = shutil.which(name) if name else None
        if not path:
            continue
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        match = re.search(r"clang version (\d+)", version)
        if match and int(match.group(1)) >= MIN_CLANG_MAJOR:
            return path, version
    sys.exit(f"no clang >= {MIN_CLANG_MAJOR} found (tried {', '.join(filter(None, candidates))}); "
             "on Debian: apt-get install clang-19 lld-19")


def write_instances() -> None:
    GENERATED.mkdir(parents=True, exist_ok=True)
    path = GENERATED / "instances.inc"
    text = variants.instantiation_lines()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def ninja_file(clang: str | None, targets: list[str], emulate: bool, out_dir: Path) -> str:
    deps = " ".join(str(p) for p in source_files()) + f" {GENERATED / 'instances.inc'}"
    main = KERNELS / MAIN_SOURCE
    lines = [
        f"rule hip\n  command = {clang} {CLANG_FLAGS} --offload-arch=$target -I{GENERATED} $in -o $out\n"
        "  description = clang $target",
        f"rule nvcc\n  command = nvcc {NVCC_FLAGS} -DRDNA_EMULATE=$layer -I{GENERATED} $in -o $out\n"
        "  description = nvcc emulated gfx$layer",
    ]
    for target in targets:
        lines.append(f"build {out_dir / artifact_name(target)}: hip {main} | {deps}\n  target = {target}")
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


def write_manifest(out_dir: Path, built: list[str], compiler: str) -> None:
    path = out_dir / "manifest.json"
    manifest = load_manifest(path)
    new_sources = source_hash()
    targets = manifest.get("targets", {}) if manifest.get("source_hash") == new_sources else {}
    for target in built:
        file = out_dir / artifact_name(target)
        targets[target] = {
            "file": file.name,
            "sha256": sha256_file(file),
            "size": file.stat().st_size,
            "kernels": list(variants.ALL_SYMBOLS),
        }
    manifest = {
        "abi_version": variants.ABI_VERSION,
        "compiler": compiler,
        "code_object_version": CODE_OBJECT_VERSION,
        "source_hash": new_sources,
        "targets": dict(sorted(targets.items())),
    }
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def check(out_dir: Path) -> int:
    manifest = load_manifest(out_dir / "manifest.json")
    problems = []
    if manifest.get("source_hash") != source_hash():
        problems.append("kernel sources changed since prebuilt/ was built: run python kernels/build.py")
    if manifest.get("abi_version") != variants.ABI_VERSION:
        problems.append("manifest ABI version differs from rdna_flash_attn/variants.py")
    for target in AMD_TARGETS:
        entry = manifest.get("targets", {}).get(target)
        if entry is None:
            problems.append(f"{target}: missing from the manifest")
            continue
        file = out_dir / entry["file"]
        if not file.exists():
            problems.append(f"{target}: {file.name} missing")
        elif sha256_file(file) != entry["sha256"]:
            problems.append(f"{target}: {file.name} does not match its sha256")
    for problem in problems:
        print(f"manifest check: {problem}", file=sys.stderr)
    if not problems:
        print(f"manifest check: {len(AMD_TARGETS)} targets match the sources ({manifest['source_hash'][:12]})")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", help="comma-separated AMD targets (default: all)")
    parser.add_argument("--no-amd", action="store_true", help="build no AMD target")
    parser.add_argument("--emulate", action="store_true", help="also build the NVIDIA emulation (needs nvcc)")
    parser.add_argument("--out", type=Path, default=PREBUILT, help="where the AMD code objects go")
    parser.add_argument("--clang", help="clang executable (default: the first clang >= 19 on PATH)")
    parser.add_argument("--jobs", type=int, help="parallel compiles (ninja's default otherwise)")
    parser.add_argument("--check", action="store_true", help="only verify the manifest against sources and files")
    args = parser.parse_args(argv)
    out_dir = args.out.resolve()
    if args.check:
        return check(out_dir)
    targets = [] if args.no_amd else (args.targets.split(",") if args.targets else list(AMD_TARGETS))
    unknown = sorted(set(targets) - set(AMD_TARGETS))
    if unknown:
        parser.error(f"unknown target(s): {', '.join(unknown)}")
    clang, compiler = find_clang(args.clang) if targets else (None, "")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_instances()
    run_ninja(ninja_file(clang, targets, args.emulate, out_dir), args.jobs)
    if targets:
        write_manifest(out_dir, targets, compiler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
