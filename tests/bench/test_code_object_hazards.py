"""gfx1100-gfx1103's VALUTransUseHazard in the shipped code objects.

A VALU instruction that reads a VGPR written by a transcendental one (v_exp_f32 and the like) must have 6
VALU instructions (transcendental ones included) or 2 transcendental ones between them, or a va_vdst=0
wait (`s_waitcnt_depctr 0xfff`) before it; a memory or export instruction between them ends the hazard
too (LLVM's GCNHazardRecognizer, fixVALUTransUseHazard). Otherwise it can read a stale value. LLVM inserts
the wait for the instructions it selects, but not for inline asm: a first version of `pack_probabilities`
rounded v_exp_f32 results with an asm v_fma_mix and read them unmitigated. gfx1150/1151 and gfx12 do not
have the hazard.

The scan follows each kernel's control flow (branches, fall-throughs, loop back edges) to a fixed point, so
a transcendental result is tracked into every block it can reach. It is at least as strict as LLVM: an
accumulating instruction (v_fmac, v_dot2acc, v_fma_mix, v_permlanex16, ...) reads its destination, and a
later write of the register does not end the hazard of the transcendental one."""

from __future__ import annotations

import re

import pytest

from rdna_fa_lab.resource_report import find_objdump
from rdna_fa_lab.throughput_estimate import Insn, branch_target, classify, disassemble
from rdna_flash_attn.runtime import artifacts

HAZARD_TARGETS = ("gfx1100", "gfx1101", "gfx1102", "gfx1103")
VALU_BETWEEN, TRANSCENDENTAL_BETWEEN = 6, 2
MEMORY = ("ds_", "global_", "buffer_", "flat_", "scratch_", "exp")  # these end the hazard as the wait does
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


Pending = dict[int, tuple[int, int]]  # VGPR -> (VALU, transcendental) issued since a transcendental wrote it


def run_block(block, pending: Pending, found: set[str], kernel: str) -> Pending:
    """One basic block from the given state: records the reads that come too early, returns the state after."""
    pending = dict(pending)
    for insn in block:
        addr, op, args = insn.addr, insn.op, insn.args
        if op.startswith(MEMORY) or op == "s_waitcnt_depctr" and (int(args, 16) >> 12) & 0xF == 0:
            pending.clear()
        if not op.startswith("v_"):
            continue
        reads, writes = reads_and_writes(op, args)
        if reads & pending.keys():
            found.add(f"{kernel}: {addr:#x} {op} {args}")
        transcendental = classify(op) == "trans"
        pending = {r: (valu + 1, trans + transcendental) for r, (valu, trans) in pending.items()  # TRANS is VALU too
                   if valu + 1 < VALU_BETWEEN and trans + transcendental < TRANSCENDENTAL_BETWEEN}
        if transcendental:
            pending.update({r: (0, 0) for r in writes})
    return pending


def unmitigated_reads(kernels: dict[str, list[Insn]]) -> list[str]:
    """'kernel: address op' of every VALU instruction that can read a transcendental result too early."""
    found: set[str] = set()
    for kernel, body in kernels.items():
        targets = {t for i in body if (t := branch_target(i)) is not None}
        starts = sorted({0} | {n for n, i in enumerate(body) if i.addr in targets}
                        | {n + 1 for n, i in enumerate(body[:-1]) if i.op.startswith(BRANCH + NO_FALL_THROUGH)})
        blocks = [body[a:b] for a, b in zip(starts, starts[1:] + [len(body)])]
        index = {block[0].addr: i for i, block in enumerate(blocks)}
        successors = []
        for i, block in enumerate(blocks):
            nexts = [] if block[-1].op.startswith(NO_FALL_THROUGH) or i + 1 == len(blocks) else [i + 1]
            if (t := branch_target(block[-1])) in index:
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
    body = [
        Insn(0x1000, "v_exp_f32_e32", "v1, v2"),
        Insn(0x1004, "v_fma_mixlo_f16", "v3, v1, s2, 0"),
        Insn(0x1008, "v_exp_f32_e32", "v4, v2"),
        Insn(0x100C, "s_waitcnt_depctr", "0xfff"),
        Insn(0x1010, "v_add_f32_e32", "v5, v4, v4"),
        Insn(0x1014, "v_exp_f32_e32", "v6, v2"),
        Insn(0x1018, "v_exp_f32_e32", "v7, v2"),
        Insn(0x101C, "v_exp_f32_e32", "v8, v2"),
        Insn(0x1020, "v_dual_mov_b32", "v9, v6 :: v_dual_mov_b32 v10, v7"),
        Insn(0x1024, "v_exp_f32_e32", "v11, v2"),
        Insn(0x1028, "ds_load_b128", "v[20:23], v0"),
        Insn(0x102C, "v_add_f32_e32", "v12, v11, v11"),
        Insn(0x1030, "v_exp_f32_e32", "v13, v2"),
        Insn(0x1034, "v_fmac_f32_e32", "v13, v2, v2"),
        Insn(0x1038, "v_exp_f32_e32", "v14, v2"),
        Insn(0x103C, "s_cbranch_execz", "1"),
        Insn(0x1040, "v_mov_b32_e32", "v15, 0"),
        Insn(0x1044, "v_mov_b32_e32", "v16, v14"),
        Insn(0x1048, "s_endpgm", ""),
    ]
    assert unmitigated_reads({"k": body}) == ["k: 0x1004 v_fma_mixlo_f16 v3, v1, s2, 0",
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
    found = unmitigated_reads(disassemble(objdump, path, target))
    assert not found, f"{len(found)} unmitigated reads, first: {found[:3]}"
