"""Static resource report of the prebuilt code objects: the check that stands in for RDNA hardware.

For every target and kernel: VGPRs, SGPRs, LDS, scratch, spills, waves per SIMD and the WMMA
instructions in the main loop, read from the code object metadata (runtime/codeobject.py) and from
`llvm-objdump` disassembly. `--check` fails on scratch, spills, LDS over 64 KiB, LDS that differs
from what runtime/variants.py says the kernel declares, hidden (implicit) kernel arguments, or a code object
whose version is not the one its manifest entry names.

    python -m rdna_fa_lab report                      # prebuilt/manifest.json
    python -m rdna_fa_lab report build/x.hsaco --check --json report.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rdna_flash_attn.runtime import variants
from rdna_flash_attn.runtime.artifacts import prebuilt_dir
from rdna_flash_attn.runtime.codeobject import CodeObject, KernelResources, load_code_object
from rdna_flash_attn.runtime.build_facts import CODE_OBJECT_VERSION, MANIFEST_FILE, listed_code_objects

DEFAULT_MANIFEST = prebuilt_dir() / MANIFEST_FILE
LDS_LIMIT = variants.LDS_LIMIT  # bytes one workgroup may allocate on every RDNA target

# --- Occupancy facts --------------------------------------------------------------------------
# VGPR file per SIMD, in wave32 registers, and the wave32 allocation granule. gfx1100, gfx1101,
# gfx1151 and gfx12 have the 1.5x file (192 KiB = 1536 x 32 lanes x 4 bytes, granule 24); gfx1102,
# gfx1103, gfx1150 and gfx1152 the base one (128 KiB = 1024, granule 16). Sources: LLVM AMDGPU.td (the
# targets with Feature1_5xVGPRs, formerly FeatureGFX11FullVGPRs), AMDGPUBaseInfo.cpp
# getTotalNumVGPRs / getVGPRAllocGranule; Mesa ac_gpu_info.c (768 wave64 VGPRs per SIMD on Navi31,
# Navi32, Strix Halo and gfx12, else 512). tests/test_report.py checks the resulting occupancy
# against clang-19's own estimate (-Rpass-analysis=kernel-resource-usage) on all nine targets.
_VGPR_FILE_192K = (1536, 24)
_VGPR_FILE_128K = (1024, 16)
VGPR_FILE = {
    "gfx1100": _VGPR_FILE_192K,
    "gfx1101": _VGPR_FILE_192K,
    "gfx1102": _VGPR_FILE_128K,
    "gfx1103": _VGPR_FILE_128K,
    "gfx1150": _VGPR_FILE_128K,
    "gfx1151": _VGPR_FILE_192K,
    "gfx1152": _VGPR_FILE_128K,
    "gfx1200": _VGPR_FILE_192K,
    "gfx1201": _VGPR_FILE_192K,
}
# 16 wave slots per SIMD on gfx10.3+ (AMDGPUBaseInfo.cpp getMaxWavesPerEU; Mesa max_waves_per_simd).
MAX_WAVES_PER_SIMD = 16
# A workgroup runs on one WGP (2 CUs, 4 SIMDs, 128 KiB LDS) in WGP mode, the gfx10+ default, or on
# one CU (2 SIMDs, 64 KiB) in CU mode; at most 32 resp. 16 multi-wave workgroups fit, one per
# hardware barrier. AMDGPUBaseInfo.cpp getLocalMemorySize / getEUsPerCU / getMaxWorkGroupsPerCU.
_WGP_MODE = (4, 128 * 1024, 32)  # (SIMDs, LDS bytes, workgroups)
_CU_MODE = (2, 64 * 1024, 16)
# gfx10.3+ allocate LDS in 1 KiB blocks (Mesa ac_gpu_info.c lds_alloc_granularity); LLVM's
# occupancy estimate ignores this (a FIXME in getOccupancyWithWorkGroupSizes).
LDS_ALLOC_GRANULE = 1024


@dataclass(frozen=True)
class Occupancy:
    waves_per_simd: int
    limited_by: str


def occupancy(target: str, kernel: KernelResources, workgroup_size: int) -> Occupancy | None:
    """Waves per SIMD as LLVM's AMDGPU backend estimates it, plus the hardware's 1 KiB LDS rounding.

    None for a target whose register file this module does not know."""
    if target not in VGPR_FILE:
        return None
    candidates = [
        Occupancy(MAX_WAVES_PER_SIMD, "wave slots"),
        Occupancy(_waves_by_vgprs(target, kernel), "VGPRs"),
        _waves_by_workgroups(kernel, workgroup_size),
    ]
    return min(candidates, key=lambda o: o.waves_per_simd)  # first of equals names the limit


def _waves_by_vgprs(target: str, kernel: KernelResources) -> int:
    # A wave64 uses twice the lanes of a wave32, so the file holds half as many of its registers.
    file_wave32, granule_wave32 = VGPR_FILE[target]
    file = file_wave32 * 32 // kernel.wavefront_size
    granule = granule_wave32 * 32 // kernel.wavefront_size
    allocated = max(granule, _round_up(kernel.vgpr_count, granule))
    return file // allocated


def _waves_by_workgroups(kernel: KernelResources, workgroup_size: int) -> Occupancy:
    simds, lds_pool, max_groups = _WGP_MODE if kernel.workgroup_processor_mode else _CU_MODE
    waves_per_group = -(-workgroup_size // kernel.wavefront_size)
    wave_slots = MAX_WAVES_PER_SIMD * simds
    # Single-wave workgroups need no barrier, so only wave slots bound them.
    by_slots = wave_slots if waves_per_group == 1 else min(wave_slots // waves_per_group, max_groups)
    by_lds = lds_pool // _round_up(kernel.lds_bytes, LDS_ALLOC_GRANULE) if kernel.lds_bytes else by_slots
    groups, limit = (by_lds, "LDS") if by_lds < by_slots else (by_slots, "workgroups")
    # Waves spread evenly over the SIMDs; like LLVM, report the fullest SIMD (round up).
    return Occupancy(-(-groups * waves_per_group // simds), limit)


def _round_up(n: int, granule: int) -> int:
    return -(-n // granule) * granule


# --- WMMA instructions from the disassembly ------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    start: int  # address of the loop header (branch target)
    end: int  # address of the last backward branch to it
    wmma: int  # WMMA instructions for which this is the innermost enclosing loop


@dataclass(frozen=True)
class WmmaCounts:
    total: int
    loops: tuple[Loop, ...]

    @property
    def main_loop(self) -> int:
        """WMMAs per iteration of the loop that holds the most: the kernel's main loop."""
        return max((loop.wmma for loop in self.loops), default=0)

    @property
    def in_loops(self) -> int:
        return sum(loop.wmma for loop in self.loops)


_FUNCTION_HEADER = re.compile(r"^[0-9a-fA-F]+ <(.+)>:$")  # "0000000000001900 <kernel>:"


def find_objdump() -> str | None:
    """llvm-objdump >= 19 (older ones do not know gfx12), newest first, else the unversioned one."""
    names = [f"llvm-objdump-{v}" for v in range(30, 18, -1)] + ["llvm-objdump"]
    return next((path for path in map(shutil.which, names) if path), None)


def disassemble_wmma(objdump: str, path: Path, target: str) -> dict[str, WmmaCounts] | None:
    """WMMA counts per function symbol, or None when this objdump cannot disassemble the target."""
    try:
        result = subprocess.run(
            [objdump, "-d", f"--mcpu={target}", str(path)], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    if "not a recognized processor" in result.stderr:
        return None
    return count_wmma(result.stdout)


def count_wmma(disassembly: str) -> dict[str, WmmaCounts]:
    """Parse `llvm-objdump -d` output: per function, WMMA addresses and backward branches."""
    functions: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}
    wmma: list[int] = []
    back_edges: list[tuple[int, int]] = []
    for line in disassembly.splitlines():
        if not line.startswith("\t"):
            header = _FUNCTION_HEADER.match(line)
            if header:
                wmma, back_edges = functions.setdefault(header.group(1), ([], []))
            continue
        if "v_wmma_" not in line and "branch" not in line:  # cheap filter: most lines are neither
            continue
        mnemonic, _, rest = line.strip().partition(" ")
        if mnemonic.startswith("v_wmma_"):
            wmma.append(_instruction_address(line))
        elif mnemonic == "s_branch" or mnemonic.startswith("s_cbranch_"):
            address = _instruction_address(line)
            target = _branch_target(address, rest.split(None, 1)[0])
            if target <= address:
                back_edges.append((target, address))
    return {name: _attribute_to_loops(w, edges) for name, (w, edges) in functions.items()}


def _instruction_address(line: str) -> int:
    # "\tv_wmma_f32_16x16x16_f16 v[1:8], ...  // 000000001B68: CC404059 1D66C361"
    return int(line.rpartition("//")[2].split(":", 1)[0], 16)


def _branch_target(address: int, simm16: str) -> int:
    # SOPP branches jump by a signed 16-bit count of dwords from the next instruction; objdump
    # prints the raw field, which may appear unsigned (65369) or signed (-167).
    offset = int(simm16) & 0xFFFF
    offset -= (offset & 0x8000) << 1
    return address + 4 + 4 * offset


def _attribute_to_loops(wmma: list[int], back_edges: list[tuple[int, int]]) -> WmmaCounts:
    # A backward branch closes a loop from its target to itself; several branches back to one
    # header (`continue`) are one loop. Each WMMA belongs to the smallest loop around it.
    ends: dict[int, int] = {}
    for start, end in back_edges:
        ends[start] = max(end, ends.get(start, end))
    spans = sorted(ends.items())
    counts = dict.fromkeys(spans, 0)
    for address in wmma:
        around = [s for s in spans if s[0] <= address <= s[1]]
        if around:
            counts[min(around, key=lambda s: s[1] - s[0])] += 1
    loops = tuple(Loop(start, end, n) for (start, end), n in counts.items())
    return WmmaCounts(total=len(wmma), loops=loops)


# --- Collecting the rows -------------------------------------------------------------------------


def variant_table() -> dict:
    """Every kernel family's `<FAMILY>_BY_SYMBOL` dict in variants.py, merged."""
    table: dict = {}
    for name, value in vars(variants).items():
        if name.endswith("_BY_SYMBOL") and isinstance(value, dict):
            table.update(value)
    return table


@dataclass(frozen=True)
class Artifact:
    path: Path
    expected_target: str | None  # what the manifest says, if it was read from one
    expected_kernels: tuple[str, ...]
    expected_code_object_version: int | None = None  # what the manifest entry says, if it says


@dataclass(frozen=True)
class KernelRow:
    target: str
    file: str
    kernel: KernelResources
    workgroup_size: int  # from variants.py, else the compiled maximum
    variant: object | None  # the variants.py entry, None for unknown symbols
    occupancy: Occupancy | None
    wmma: WmmaCounts | None
    code_object_version: int | None = None  # from the ELF header

    @property
    def label(self) -> str:
        """The target, with the code object version when it is not the default one (gfx1100 v4)."""
        if self.code_object_version in (None, CODE_OBJECT_VERSION):
            return self.target
        return f"{self.target} v{self.code_object_version}"


def artifacts_from_manifest(manifest_path: Path) -> list[Artifact]:
    manifest = json.loads(manifest_path.read_text())
    return [
        Artifact(manifest_path.parent / entry["file"], target, tuple(entry.get("kernels", ())),
                 entry.get("code_object_version"))
        for target, _version, entry in listed_code_objects(manifest)
    ]


def collect_rows(code_objects: dict[Path, CodeObject], wmma: dict[Path, dict | None]) -> list[KernelRow]:
    table = variant_table()
    rows = []
    for path, co in code_objects.items():
        counts = wmma[path]
        for kernel in co.kernels:
            variant = table.get(kernel.name)
            workgroup_size = variant.threads if variant else kernel.max_flat_workgroup_size
            rows.append(
                KernelRow(
                    target=co.target,
                    file=path.name,
                    kernel=kernel,
                    workgroup_size=workgroup_size,
                    variant=variant,
                    occupancy=occupancy(co.target, kernel, workgroup_size),
                    wmma=counts.get(kernel.name) if counts is not None else None,
                    code_object_version=co.code_object_version,
                )
            )
    return rows


def kernel_problems(row: KernelRow) -> list[str]:
    """Every static limit this kernel breaks, each as one readable sentence."""
    k, variant = row.kernel, row.variant
    found = []
    if k.scratch_bytes > 0:
        found.append(f"uses {k.scratch_bytes} bytes of scratch per work-item (limit 0)")
    if k.uses_dynamic_stack:
        found.append("uses a dynamic stack (scratch of unknown size)")
    if k.vgpr_spill_count:
        found.append(f"spills {k.vgpr_spill_count} VGPRs")
    if k.sgpr_spill_count:
        found.append(f"spills {k.sgpr_spill_count} SGPRs")
    if k.lds_bytes > LDS_LIMIT:
        found.append(f"declares {k.lds_bytes} bytes of LDS (limit {LDS_LIMIT})")
    if variant is not None and k.lds_bytes != variant.lds_bytes(row.target):
        found.append(
            f"declares {k.lds_bytes} bytes of LDS but variants.py expects {variant.lds_bytes(row.target)}: "
            "host and kernel disagree on the tile layout"
        )
    if variant is not None and variant.threads > k.max_flat_workgroup_size:
        found.append(
            f"is launched with {variant.threads} threads but compiled for at most {k.max_flat_workgroup_size}"
        )
    if k.hidden_args:
        found.append(f"reads hidden kernel arguments ({', '.join(k.hidden_args)}): the runtime lays them out "
                     "differently for code object v4 and v5, and both versions ship")
    if variant is not None and k.wavefront_size != variants.WAVE_SIZE:
        found.append(f"is compiled for wave{k.wavefront_size}; the kernel assumes wave{variants.WAVE_SIZE}")
    return [f"{row.label} {k.name} {problem}" for problem in found]


def artifact_problems(artifact: Artifact, co: CodeObject) -> list[str]:
    found = []
    if artifact.expected_target and artifact.expected_target != co.target:
        found.append(
            f"{artifact.path.name}: manifest says {artifact.expected_target}, code object is {co.target}"
        )
    expected_version = artifact.expected_code_object_version
    if expected_version is not None and expected_version != co.code_object_version:
        found.append(f"{artifact.path.name}: manifest says code object v{expected_version}, "
                     f"the ELF header says v{co.code_object_version}")
    present = {k.name for k in co.kernels}
    found += [
        f"{co.target} {name}: listed in the manifest but missing from {artifact.path.name}"
        for name in artifact.expected_kernels
        if name not in present
    ]
    return found


# --- Output --------------------------------------------------------------------------------------

_COLUMNS = (
    "target", "kernel", "WG", "VGPR", "SGPR", "LDS", "scratch", "spill v/s", "waves/SIMD", "WMMA loop/all",
)


def _table_cells(row: KernelRow) -> tuple[str, ...]:
    k = row.kernel
    occ = f"{row.occupancy.waves_per_simd} ({row.occupancy.limited_by})" if row.occupancy else "n/a"
    wmma = f"{row.wmma.main_loop}/{row.wmma.total}" if row.wmma else "n/a"
    scratch = f"{k.scratch_bytes}+dyn" if k.uses_dynamic_stack else str(k.scratch_bytes)
    return (
        row.label, k.name, str(row.workgroup_size), str(k.vgpr_count), str(k.sgpr_count),
        str(k.lds_bytes), scratch, f"{k.vgpr_spill_count}/{k.sgpr_spill_count}", occ, wmma,
    )


def format_table(rows: list[KernelRow]) -> str:
    lines = [_COLUMNS] + [_table_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_COLUMNS))]
    return "\n".join(_format_line(line, widths) for line in lines)


def _format_line(cells: tuple[str, ...], widths: list[int]) -> str:
    names = [c.ljust(w) for c, w in zip(cells[:2], widths)]  # target and kernel left-aligned
    numbers = [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]
    return "  ".join(names + numbers)


def row_json(row: KernelRow) -> dict:
    k = row.kernel
    return {
        "target": row.target,
        "code_object_version": row.code_object_version,
        "file": row.file,
        "kernel": k.name,
        "workgroup_size": row.workgroup_size,
        "max_flat_workgroup_size": k.max_flat_workgroup_size,
        "wavefront_size": k.wavefront_size,
        "vgpr": k.vgpr_count,
        "sgpr": k.sgpr_count,
        "agpr": k.agpr_count,
        "lds_bytes": k.lds_bytes,
        "lds_expected": row.variant.lds_bytes(row.target) if row.variant else None,
        "scratch_bytes": k.scratch_bytes,
        "dynamic_stack": k.uses_dynamic_stack,
        "vgpr_spills": k.vgpr_spill_count,
        "sgpr_spills": k.sgpr_spill_count,
        "waves_per_simd": row.occupancy.waves_per_simd if row.occupancy else None,
        "occupancy_limited_by": row.occupancy.limited_by if row.occupancy else None,
        "wmma": None if row.wmma is None else {
            "main_loop": row.wmma.main_loop,
            "in_loops": row.wmma.in_loops,
            "total": row.wmma.total,
            "loops": [{"start": hex(l.start), "end": hex(l.end), "wmma": l.wmma} for l in row.wmma.loops],
        },
    }


# --- Command line --------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rdna_fa_lab report",
        description="Registers, LDS, scratch, spills, occupancy and WMMA counts of AMDGPU code objects.",
    )
    parser.add_argument("hsaco", nargs="*", type=Path, help="code objects (default: those in the manifest)")
    parser.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST,
                        help=f"the manifest whose code objects to report (default: prebuilt/{MANIFEST_FILE} "
                             "of this installation)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 on scratch, spills, LDS > 64 KiB or LDS "
                        "different from variants.py")
    parser.add_argument("--no-disasm", action="store_true", help="skip llvm-objdump (no WMMA counts)")
    return parser.parse_args(argv)


def _load_inputs(args: argparse.Namespace) -> list[Artifact]:
    if args.hsaco:
        return [Artifact(p, None, ()) for p in args.hsaco]
    return artifacts_from_manifest(args.manifest)


def _disassemble_all(code_objects: dict[Path, CodeObject], no_disasm: bool) -> dict[Path, dict | None]:
    objdump = None if no_disasm else find_objdump()
    if objdump is None:
        if not no_disasm:
            print("llvm-objdump not found on PATH: WMMA counts are n/a", file=sys.stderr)
        return dict.fromkeys(code_objects)
    # One objdump per target, run side by side: they dominate the report's run time.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {p: pool.submit(disassemble_wmma, objdump, p, co.target) for p, co in code_objects.items()}
        results = {p: f.result() for p, f in futures.items()}
    for path, counts in results.items():
        if counts is None:
            print(f"{objdump} could not disassemble {path.name}: WMMA counts are n/a", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        artifacts = _load_inputs(args)
        code_objects = {a.path: load_code_object(a.path) for a in artifacts}
    except (OSError, ValueError, KeyError) as error:  # CodeObjectError and JSONDecodeError are ValueErrors
        print(f"report: cannot read input: {error}", file=sys.stderr)
        return 2
    rows = collect_rows(code_objects, _disassemble_all(code_objects, args.no_disasm))
    problems = [p for a in artifacts for p in artifact_problems(a, code_objects[a.path])]
    problems += [p for row in rows for p in kernel_problems(row)]

    print(format_table(rows))
    if args.json:
        document = {"kernels": [row_json(r) for r in rows], "problems": problems}
        args.json.write_text(json.dumps(document, indent=1))
    if not args.check:
        return 0
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    print(f"check passed: {len(rows)} kernels in {len(code_objects)} code objects within the static limits")
    return 0
