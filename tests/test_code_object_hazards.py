"""gfx1100-gfx1103's VALUTransUseHazard in the shipped code objects.

A VALU instruction that reads a VGPR written by a transcendental one (v_exp_f32 and the like) must have 6
VALU instructions (transcendental ones included) or 2 transcendental ones between them, or a va_vdst=0
wait (`s_waitcnt_depctr 0xfff`) before it; a memory or export instruction between them ends the hazard
too (LLVM's GCNHazardRecognizer, fixVALUTransUseHazard). Otherwise it can read a stale value. LLVM inserts
the wait for the instructions it selects, but not for inline asm: stop 44's first `pack_probabilities`
rounded v_exp_f32 results with an asm v_fma_mix and read them unmitigated. gfx1150/1151 and gfx12 do not
have the hazard.

The scan runs in address order through each straight-line run of a kernel: a branch, or an instruction a
branch lands on, ends the run (across those edges LLVM's own waits are taken on trust)."""

from __future__ import annotations

import re
import subprocess

import pytest

from rdna_flash_attn.runtime import artifacts
from rdna_flash_attn.tools.report import find_objdump

HAZARD_TARGETS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103")
TRANSCENDENTAL = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
VALU_BETWEEN, TRANSCENDENTAL_BETWEEN = 6, 2
MEMORY = ("ds_", "global_", "buffer_", "flat_", "scratch_", "exp")  # these end the hazard as the wait does
_LINE = re.compile(r"^\s+([a-z_0-9]+)\s*(.*?)\s*//\s*([0-9A-F]{12}):")
_FUNCTION = re.compile(r"^[0-9a-f]+ <(\S+)>:")
_VGPRS = re.compile(r"\bv(?:(\d+)\b|\[(\d+):(\d+)\])")


def vgprs(operand: str) -> set[int]:
    found = set()
    for single, first, last in _VGPRS.findall(operand):
        found |= {int(single)} if single else set(range(int(first), int(last) + 1))
    return found


def reads_and_writes(op: str, args: str) -> tuple[set[int], set[int]]:
    """The VGPRs a VALU instruction reads and writes: its first operand is written (a VOPD names one per
    half), except for v_cmpx, which writes only exec."""
    reads, writes = set(), set()
    for index, half in enumerate(args.split("::")):
        operands = [a.strip() for a in half.split(",")]
        if index:
            operands[0] = operands[0].split(None, 1)[1]  # the second half's own mnemonic
        if op.startswith("v_cmpx"):
            reads |= set().union(*map(vgprs, operands))
        else:
            writes |= vgprs(operands[0])
            reads |= set().union(*map(vgprs, operands[1:]))
    return reads, writes


def branch_target(addr: int, op: str, args: str) -> int | None:
    if not (op.startswith("s_cbranch") or op == "s_branch"):
        return None
    offset = int(args.split()[0])
    return addr + 4 + 4 * (offset - 65536 if offset >= 32768 else offset)


def unmitigated_reads(listing: str) -> list[str]:
    """'kernel: address op' of every VALU instruction that reads a transcendental result too early."""
    kernels: dict[str, list[tuple[int, str, str]]] = {}
    name = None
    for line in listing.splitlines():
        if m := _FUNCTION.match(line):
            name = m.group(1)
            kernels[name] = []
        elif name and (m := _LINE.match(line)):
            kernels[name].append((int(m.group(3), 16), m.group(1), m.group(2)))
    found = []
    for kernel, body in kernels.items():
        targets = {t for addr, op, args in body if (t := branch_target(addr, op, args)) is not None}
        pending: dict[int, list[int]] = {}  # VGPR -> [VALU, transcendental] issued since a transcendental wrote it
        for addr, op, args in body:
            if addr in targets:
                pending.clear()
            if op.startswith(MEMORY) or op == "s_waitcnt_depctr" and (int(args, 16) >> 12) & 0xF == 0:
                pending.clear()
            if op.startswith("v_"):
                reads, writes = reads_and_writes(op, args)
                if any(r in pending and pending[r][0] < VALU_BETWEEN and pending[r][1] < TRANSCENDENTAL_BETWEEN
                       for r in reads):
                    found.append(f"{kernel}: {addr:#x} {op} {args}")
                transcendental = op.startswith(TRANSCENDENTAL)
                for counts in pending.values():  # a transcendental instruction counts as a VALU one too
                    counts[0] += 1
                    counts[1] += transcendental
                for r in writes:
                    pending.pop(r, None)
                if transcendental:
                    pending.update({r: [0, 0] for r in writes})
            if op.startswith(("s_cbranch", "s_branch", "s_setpc", "s_endpgm")):
                pending.clear()
    return found


def test_the_scan_finds_an_unmitigated_read_and_accepts_a_waited_distant_or_memory_separated_one():
    listing = "\n".join([
        "0000000000001000 <k>:",
        "\tv_exp_f32_e32 v1, v2                 // 000000001000: 00000000",
        "\tv_fma_mixlo_f16 v3, v1, s2, 0       // 000000001004: 00000000",
        "\tv_exp_f32_e32 v4, v2                 // 000000001008: 00000000",
        "\ts_waitcnt_depctr 0xfff               // 00000000100C: 00000000",
        "\tv_add_f32_e32 v5, v4, v4             // 000000001010: 00000000",
        "\tv_exp_f32_e32 v6, v2                 // 000000001014: 00000000",
        "\tv_exp_f32_e32 v7, v2                 // 000000001018: 00000000",
        "\tv_exp_f32_e32 v8, v2                 // 00000000101C: 00000000",
        "\tv_dual_mov_b32 v9, v6 :: v_dual_mov_b32 v10, v7  // 000000001020: 00000000",
        "\tv_exp_f32_e32 v11, v2                // 000000001024: 00000000",
        "\tds_load_b128 v[20:23], v0            // 000000001028: 00000000",
        "\tv_add_f32_e32 v12, v11, v11          // 00000000102C: 00000000",
    ])
    assert unmitigated_reads(listing) == ["k: 0x1004 v_fma_mixlo_f16 v3, v1, s2, 0",
                                          "k: 0x1020 v_dual_mov_b32 v9, v6 :: v_dual_mov_b32 v10, v7"]


@pytest.mark.parametrize("target", HAZARD_TARGETS)
def test_no_valu_reads_a_transcendental_result_unmitigated(target):
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    path = artifacts.prebuilt_artifact(target).path
    listing = subprocess.run([objdump, "-d", f"--mcpu={target}", str(path)], capture_output=True, text=True,
                             check=True).stdout
    found = unmitigated_reads(listing)
    assert not found, f"{len(found)} unmitigated reads, first: {found[:3]}"
