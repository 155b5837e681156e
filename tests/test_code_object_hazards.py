"""gfx1100-gfx1103's VALUTransUseHazard in the shipped code objects.

A VALU instruction that reads a VGPR written by a transcendental one (v_exp_f32 and the like) must have 6
VALU instructions (transcendental ones included) or 2 transcendental ones between them, or a va_vdst=0
wait (`s_waitcnt_depctr 0xfff`) before it; a memory or export instruction between them ends the hazard
too (LLVM's GCNHazardRecognizer, fixVALUTransUseHazard). Otherwise it can read a stale value. LLVM inserts
the wait for the instructions it selects, but not for inline asm: stop 44's first `pack_probabilities`
rounded v_exp_f32 results with an asm v_fma_mix and read them unmitigated. gfx1150/1151 and gfx12 do not
have the hazard.

The scan follows each kernel's control flow (branches, fall-throughs, loop back edges) to a fixed point, so
a transcendental result is tracked into every block it can reach. It is at least as strict as LLVM: an
accumulating instruction (v_fmac, v_dot2acc, v_fma_mix, v_permlanex16, ...) reads its destination, and a
later write of the register does not end the hazard of the transcendental one."""

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


# Instructions whose destination is also a source (an accumulator, or a half or lanes they keep).
TIED = ("v_fmac_", "v_dual_fmac_", "v_dot2acc_", "v_dual_dot2acc_", "v_dot2c_", "v_fma_mixlo_", "v_fma_mixhi_",
        "v_permlane", "v_writelane_", "v_mac_")
BRANCH, NO_FALL_THROUGH = ("s_cbranch", "s_branch"), ("s_branch", "s_setpc", "s_endpgm")


def reads_and_writes(op: str, args: str) -> tuple[set[int], set[int]]:
    """The VGPRs a VALU instruction reads and writes: its first operand is written (a VOPD names one per
    half) and, for TIED instructions, read; v_cmpx writes only exec."""
    reads, writes = set(), set()
    for index, half in enumerate(args.split("::")):
        operands = [a.strip() for a in half.split(",")]
        mnemonic = op
        if index:
            mnemonic, operands[0] = operands[0].split(None, 1)  # the second half's own mnemonic
        if mnemonic.startswith("v_cmpx"):
            reads |= set().union(*map(vgprs, operands))
            continue
        writes |= vgprs(operands[0])
        reads |= set().union(*map(vgprs, operands[1 if not mnemonic.startswith(TIED) else 0:]))
    return reads, writes


def branch_target(addr: int, op: str, args: str) -> int | None:
    if not op.startswith(BRANCH):
        return None
    offset = int(args.split()[0])
    return addr + 4 + 4 * (offset - 65536 if offset >= 32768 else offset)


Pending = dict[int, tuple[int, int]]  # VGPR -> (VALU, transcendental) issued since a transcendental wrote it


def run_block(block, pending: Pending, found: set[str], kernel: str) -> Pending:
    """One basic block from the given state: records the reads that come too early, returns the state after."""
    pending = dict(pending)
    for addr, op, args in block:
        if op.startswith(MEMORY) or op == "s_waitcnt_depctr" and (int(args, 16) >> 12) & 0xF == 0:
            pending.clear()
        if not op.startswith("v_"):
            continue
        reads, writes = reads_and_writes(op, args)
        if reads & pending.keys():
            found.add(f"{kernel}: {addr:#x} {op} {args}")
        transcendental = op.startswith(TRANSCENDENTAL)
        pending = {r: (valu + 1, trans + transcendental) for r, (valu, trans) in pending.items()  # TRANS is VALU too
                   if valu + 1 < VALU_BETWEEN and trans + transcendental < TRANSCENDENTAL_BETWEEN}
        if transcendental:
            pending.update({r: (0, 0) for r in writes})
    return pending


def unmitigated_reads(listing: str) -> list[str]:
    """'kernel: address op' of every VALU instruction that can read a transcendental result too early."""
    kernels: dict[str, list[tuple[int, str, str]]] = {}
    name = None
    for line in listing.splitlines():
        if m := _FUNCTION.match(line):
            name = m.group(1)
            kernels[name] = []
        elif name and (m := _LINE.match(line)):
            kernels[name].append((int(m.group(3), 16), m.group(1), m.group(2)))
    found: set[str] = set()
    for kernel, body in kernels.items():
        targets = {t for addr, op, args in body if (t := branch_target(addr, op, args)) is not None}
        starts = sorted({0} | {i for i, (addr, _, _) in enumerate(body) if addr in targets}
                        | {i + 1 for i, (_, op, _) in enumerate(body[:-1]) if op.startswith(BRANCH + NO_FALL_THROUGH)})
        blocks = [body[a:b] for a, b in zip(starts, starts[1:] + [len(body)])]
        index = {block[0][0]: i for i, block in enumerate(blocks)}
        successors = []
        for i, block in enumerate(blocks):
            addr, op, args = block[-1]
            nexts = [] if op.startswith(NO_FALL_THROUGH) or i + 1 == len(blocks) else [i + 1]
            if (t := branch_target(addr, op, args)) in index:
                nexts.append(index[t])
            successors.append(nexts)
        entry: list[Pending | None] = [{}] + [None] * (len(blocks) - 1)
        work = [0]
        while work:  # states only grow (more registers, smaller counts), so this ends
            i = work.pop()
            after = run_block(blocks[i], entry[i], found, kernel)
            for j in successors[i]:
                merged = dict(entry[j] or {})
                for r, (valu, trans) in after.items():
                    old = merged.get(r)
                    merged[r] = (valu, trans) if old is None else (min(old[0], valu), min(old[1], trans))
                if merged != entry[j]:
                    entry[j] = merged
                    work.append(j)
    return sorted(found)


def test_the_scan_finds_early_reads_through_accumulators_and_branches_and_accepts_separated_ones():
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
        "\tv_exp_f32_e32 v13, v2                // 000000001030: 00000000",
        "\tv_fmac_f32_e32 v13, v2, v2           // 000000001034: 00000000",
        "\tv_exp_f32_e32 v14, v2                // 000000001038: 00000000",
        "\ts_cbranch_execz 1                    // 00000000103C: 00000000",
        "\tv_mov_b32_e32 v15, 0                 // 000000001040: 00000000",
        "\tv_mov_b32_e32 v16, v14               // 000000001044: 00000000",
        "\ts_endpgm                             // 000000001048: 00000000",
    ])
    assert unmitigated_reads(listing) == ["k: 0x1004 v_fma_mixlo_f16 v3, v1, s2, 0",
                                          "k: 0x1020 v_dual_mov_b32 v9, v6 :: v_dual_mov_b32 v10, v7",
                                          "k: 0x1034 v_fmac_f32_e32 v13, v2, v2",
                                          "k: 0x1044 v_mov_b32_e32 v16, v14"]


@pytest.mark.parametrize("version", [5, 4])
@pytest.mark.parametrize("target", HAZARD_TARGETS)
def test_no_valu_reads_a_transcendental_result_unmitigated(target, version):
    objdump = find_objdump()
    if objdump is None:
        pytest.skip("llvm-objdump (>= 19) not installed")
    path = artifacts.prebuilt_artifact(target, version).path
    listing = subprocess.run([objdump, "-d", f"--mcpu={target}", str(path)], capture_output=True, text=True,
                             check=True).stdout
    found = unmitigated_reads(listing)
    assert not found, f"{len(found)} unmitigated reads, first: {found[:3]}"
