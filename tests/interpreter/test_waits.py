"""The interpreter's wait check (rdna_fa_lab/interpreter/waits.py): a load's destination registers
are poisoned until an s_waitcnt (gfx11) or s_wait_*cnt (gfx12) retires it, so reading one before the
wait, or overwriting one while the load is in flight, is an error. Small hand-assembled programs
(tinygrad's encodings, the same bytes llvm-mc-19 gives) on both instruction sets; each error case
passes once its wait is added."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from tinygrad.renderer.amd.dsl import NULL, s, v  # noqa: E402

from rdna_fa_lab.interpreter import InterpreterError  # noqa: E402
from rdna_fa_lab.interpreter.dispatch import Dispatch, kernarg_segment  # noqa: E402
from rdna_fa_lab.interpreter.executor import CompiledKernel  # noqa: E402
from rdna_fa_lab.interpreter.library import tensor_region  # noqa: E402
from rdna_fa_lab.interpreter.memory import AddressSpace, LocalDataShare, Region  # noqa: E402
from rdna_fa_lab.interpreter.trace import KernelTrace  # noqa: E402
from rdna_fa_lab.interpreter.waits import (SGPR_BIT, operand_masks, registers_text, sgpr_bits,  # noqa: E402
                                               wait_counts)
from rdna_fa_lab.interpreter.wave import EXEC_LO, VCC_LO, Wave  # noqa: E402
from rdna_flash_attn.runtime import artifacts  # noqa: E402

from .test_interpreter_rules import SAMPLE_KERNELS, _forward_launch, _image, _isa  # noqa: E402

TARGETS = ("gfx1100", "gfx1201")
VALUES = np.arange(64, dtype=np.uint32) * 3 + 7  # the buffer the loads read: word i is 3i + 7


class Program:
    """Builds instructions of one target's ISA by name: load(1), ds_load(3), wait(vm=0), ..."""

    def __init__(self, target: str):
        self.target, self.gfx12 = target, target.startswith("gfx12")
        self.ins, self.enum = _isa(target, "ins"), _isa(target, "enum")

    def load(self, register: int, address: int = 0):
        """global_load_b32 v<register>, v<address>, s[0:1]"""
        if self.gfx12:
            return self.ins.VGLOBAL(self.enum.VGLOBALOp.GLOBAL_LOAD_B32, vdst=v[register], vaddr=v[address:address + 1],
                                    saddr=s[0:1])
        return self.ins.GLOBAL(self.enum.GLOBALOp.GLOBAL_LOAD_B32, vdst=v[register], addr=v[address], saddr=s[0:1])

    def store(self, data: int, address: int = 0):
        """global_store_b32 v<address>, v<data>, s[0:1]"""
        if self.gfx12:
            return self.ins.VGLOBAL(self.enum.VGLOBALOp.GLOBAL_STORE_B32, vaddr=v[address:address + 1], vsrc=v[data],
                                    saddr=s[0:1])
        return self.ins.GLOBAL(self.enum.GLOBALOp.GLOBAL_STORE_B32, addr=v[address], data=v[data], saddr=s[0:1])

    def ds_load(self, register: int, address: int = 0):
        return self.ins.DS(self.enum.DSOp.DS_LOAD_B32, vdst=v[register], addr=v[address])

    def ds_store(self, data: int, address: int = 0):
        return self.ins.DS(self.enum.DSOp.DS_STORE_B32, addr=v[address], data0=v[data])

    def s_load(self, register: int):
        """s_load_b32 s<register>, s[0:1], 0x0"""
        return self.ins.SMEM(self.enum.SMEMOp.S_LOAD_B32, sdata=s[register], sbase=s[0:1])

    def add(self, destination: int, a: int, b: int):
        """v_add_nc_u32 v<destination>, v<a>, v<b>"""
        return self.ins.VOP2(self.enum.VOP2Op.V_ADD_NC_U32_E32, v[destination], v[a], v[b])

    def mov(self, destination: int, value: int = 0):
        return self.ins.VOP1(self.enum.VOP1Op.V_MOV_B32_E32, v[destination], value)

    def s_mov(self, destination: int, source):
        return self.ins.SOP1(self.enum.SOP1Op.S_MOV_B32, s[destination], source)

    def wait(self, vm: int | None = None, lgkm: int | None = None, ds: int | None = None, km: int | None = None):
        """gfx11: one s_waitcnt of vmcnt / lgkmcnt (ds and km both mean lgkmcnt there); gfx12: one
        s_wait_loadcnt, s_wait_dscnt or s_wait_kmcnt."""
        sopp, ops = self.ins.SOPP, self.enum.SOPPOp
        if self.gfx12:
            op, count = ((ops.S_WAIT_LOADCNT, vm) if vm is not None else (ops.S_WAIT_DSCNT, ds) if ds is not None
                         else (ops.S_WAIT_KMCNT, km if km is not None else lgkm))
            return sopp(op, simm16=count)
        lgkm = next((c for c in (lgkm, ds, km) if c is not None), 0x3F)
        vm = 0x3F if vm is None else vm
        return sopp(ops.S_WAITCNT, simm16=vm << 10 | lgkm << 4 | 0x7)

    def run(self, instructions, wave: Wave | None = None) -> Wave:
        """Runs the instructions (then s_endpgm) with s[0:1] pointing at VALUES, v0 = 4 * lane
        (the byte offset of each lane's word), all lanes active, 256 bytes of LDS."""
        sopp, end = self.ins.SOPP, self.enum.SOPPOp.S_ENDPGM
        program = _image(self.target).program("rdna_fa_fwd_f16_d64")
        code = b"".join(inst.to_bytes() for inst in instructions) + sopp(end, 0).to_bytes()
        kernel = CompiledKernel(type(program)(program.name, program.target, code, 0, program.descriptor,
                                              program.metadata))
        assert not kernel.unsupported, [d.name for d in kernel.unsupported]
        memory = VALUES.copy()
        buffer = AddressSpace([Region("buffer", memory.ctypes.data, memory.view(np.uint8), True)])
        kernel.context.global_memory = kernel.context.scalar_memory = buffer
        kernel.context.lds = LocalDataShare(256)
        if wave is None:
            wave = Wave(16, 0)
        wave.sgpr[0], wave.sgpr[1] = memory.ctypes.data & 0xFFFFFFFF, memory.ctypes.data >> 32
        wave.sgpr[126] = 0xFFFFFFFF
        wave.vgpr[0] = np.arange(32, dtype=np.uint32) * 4
        self.memory = memory
        kernel.run_wave(wave, {})
        return wave


def _counter(target: str, gfx11: str, gfx12: str) -> str:
    return gfx12 if target.startswith("gfx12") else gfx11


@pytest.mark.parametrize("target", TARGETS)
def test_global_load_read_before_its_wait_is_an_error(target):
    p = Program(target)
    counter = _counter(target, "vmcnt", "loadcnt")
    with pytest.raises(InterpreterError, match=rf"rdna_fa_fwd_f16_d64 pc 0x(8|c) v_add_nc_u32_e32: reads v1 before a "
                                               rf"wait retires the global_load_b32 v1 issued at pc 0x0, outstanding on "
                                               rf"{counter}"):
        p.run([p.load(1), p.add(2, 1, 1)])
    wave = p.run([p.load(1), p.wait(vm=0), p.add(2, 1, 1)])
    assert np.array_equal(wave.vgpr[2], 2 * VALUES[:32])


@pytest.mark.parametrize("target", TARGETS)
def test_a_partial_wait_retires_the_older_loads(target):
    """Loads return in issue order: waiting for one outstanding retires all but the newest."""
    p = Program(target)
    wave = p.run([p.load(1), p.load(2), p.wait(vm=1), p.add(3, 1, 1)])
    assert np.array_equal(wave.vgpr[3], 2 * VALUES[:32])
    with pytest.raises(InterpreterError, match=r"reads v2 before a wait retires the global_load_b32 v2"):
        p.run([p.load(1), p.load(2), p.wait(vm=1), p.add(3, 2, 2)])


@pytest.mark.parametrize("target", TARGETS)
def test_lds_load_read_before_its_wait_is_an_error(target):
    """An LDS store and then a load of the same bytes need no wait between them (a wave's LDS
    accesses are ordered); the loaded register does."""
    p = Program(target)
    counter = _counter(target, "lgkmcnt", "dscnt")
    program = [p.load(1), p.wait(vm=0), p.ds_store(1), p.ds_load(3)]
    with pytest.raises(InterpreterError, match=rf"reads v3 before a wait retires the ds_load_b32 v3 .* outstanding on "
                                               rf"{counter} \(2 in flight, 0 issued after it"):
        p.run(program + [p.add(4, 3, 3)])
    wave = p.run(program + [p.wait(ds=0), p.add(4, 3, 3)])
    assert np.array_equal(wave.vgpr[4], 2 * VALUES[:32])


@pytest.mark.parametrize("target", TARGETS)
def test_scalar_loads_are_retired_by_a_wait_for_zero_only(target):
    """Scalar memory loads may return out of order: a wait for one outstanding guarantees neither."""
    p = Program(target)
    counter = _counter(target, "lgkmcnt", "kmcnt")
    with pytest.raises(InterpreterError, match=rf"s_mov_b32: reads s4 before a wait retires the s_load_b32 s4 .* "
                                               rf"outstanding on {counter} \(2 in flight, 1 issued after it; "):
        p.run([p.s_load(4), p.s_load(5), p.wait(km=1), p.s_mov(6, s[4])])
    wave = p.run([p.s_load(4), p.s_load(5), p.wait(km=0), p.s_mov(6, s[4])])
    assert wave.sgpr[6] == VALUES[0]


def test_gfx11_lgkmcnt_mixing_lds_and_scalar_loads_is_out_of_order():
    """gfx11 counts LDS and scalar loads on one counter: with both in flight, lgkmcnt(1) does not tell
    which returned, so even the older LDS load stays outstanding; with LDS loads alone it retires."""
    p = Program("gfx1100")
    wave = p.run([p.ds_store(0), p.ds_load(3), p.ds_load(4), p.wait(lgkm=1), p.add(5, 3, 3)])
    assert np.array_equal(wave.vgpr[5], 8 * np.arange(32))
    with pytest.raises(InterpreterError, match=r"reads v3 before a wait retires the ds_load_b32 v3 .* outstanding on "
                                               r"lgkmcnt \(3 in flight, 1 issued after it; s_waitcnt lgkmcnt\(0\)"):
        p.run([p.ds_store(0), p.ds_load(3), p.s_load(4), p.wait(lgkm=1), p.add(5, 3, 3)])
    p.run([p.ds_store(0), p.ds_load(3), p.s_load(4), p.wait(lgkm=0), p.add(5, 3, 3)])


@pytest.mark.parametrize("target", TARGETS)
def test_overwriting_a_register_a_load_still_writes_is_an_error(target):
    """Write after write: the load's late return would clobber the new value. For VALU, LDS and
    scalar writes alike (LLVM waits before each)."""
    p = Program(target)
    with pytest.raises(InterpreterError, match=r"v_mov_b32_e32: writes v1 while the global_load_b32 v1 .* may still "
                                               r"write it"):
        p.run([p.load(1), p.mov(1, 5)])
    with pytest.raises(InterpreterError, match=r"writes v3 while the ds_load_b32 v3"):
        p.run([p.ds_load(3), p.mov(3, 5)])
    with pytest.raises(InterpreterError, match=r"global_load_b32: writes v3 while the ds_load_b32 v3"):
        p.run([p.ds_load(3), p.load(3)])
    with pytest.raises(InterpreterError, match=r"s_mov_b32: writes s4 while the s_load_b32 s4"):
        p.run([p.s_load(4), p.s_mov(4, 0)])
    wave = p.run([p.load(1), p.wait(vm=0), p.mov(1, 5)])
    assert np.all(wave.vgpr[1] == 5)


def test_gfx11_loads_of_one_type_may_overwrite_each_other_in_flight():
    """gfx11 global loads write their registers in issue order (LLVM's vmem-write-vgpr-in-order):
    the second load may name the first one's destination before any wait, and the register stays
    poisoned until the second returns. gfx12 makes no such promise."""
    p = Program("gfx1100")
    wave = p.run([p.load(1), p.load(1, address=2), p.wait(vm=0), p.add(3, 1, 1)], _wave_with(2, 4 * np.arange(32) + 8))
    assert np.array_equal(wave.vgpr[3], 2 * VALUES[2:34])
    with pytest.raises(InterpreterError, match=r"reads v1 before a wait retires the global_load_b32 v1 issued at pc 0x8"):
        p.run([p.load(1), p.load(1, address=2), p.wait(vm=1), p.add(3, 1, 1)], _wave_with(2, 4 * np.arange(32) + 8))
    q = Program("gfx1201")
    with pytest.raises(InterpreterError, match=r"global_load_b32: writes v1 while the global_load_b32 v1"):
        q.run([q.load(1), q.load(1, address=2)], _wave_with(2, 4 * np.arange(32) + 8))


@pytest.mark.parametrize("target", TARGETS)
def test_store_data_may_be_overwritten_at_once(target):
    """gfx11 and gfx12 stores read their data when they issue (LLVM locks store data only on gfx6)."""
    p = Program(target)
    wave = p.run([p.mov(1, 42), p.store(1), p.mov(1, 5), p.ds_store(1), p.mov(1, 6)])
    assert np.all(p.memory[:32] == 42) and np.all(wave.vgpr[1] == 6)


def test_gfx12_global_inv_counts_on_loadcnt_in_order():
    """gfx12's global_inv increments loadcnt and completes in order with the loads: after load,
    global_inv, s_wait_loadcnt 1 the load has returned."""
    p = Program("gfx1201")
    inv = p.ins.VGLOBAL(p.enum.VGLOBALOp.GLOBAL_INV)
    wave = p.run([p.load(1), inv, p.wait(vm=1), p.add(3, 1, 1)])
    assert np.array_equal(wave.vgpr[3], 2 * VALUES[:32])
    with pytest.raises(InterpreterError, match="reads v1"):
        p.run([p.load(1), inv, p.wait(vm=2), p.add(3, 1, 1)])


def test_gfx11_vscnt_wait_decodes():
    """s_waitcnt_vscnt null, N (SOPK) is a counter wait like the others, without registers."""
    p = Program("gfx1100")
    vscnt = p.ins.SOPK(p.enum.SOPKOp.S_WAITCNT_VSCNT, sdst=NULL, simm16=0)
    wave = p.run([p.mov(1, 42), p.store(1), vscnt, p.load(2), p.wait(vm=0), p.add(3, 2, 2)])
    assert np.all(wave.vgpr[3] == 84) and not wave.outstanding["vscnt"]


def _wave_with(register: int, values) -> Wave:
    wave = Wave(16, 0)
    wave.vgpr[register] = np.asarray(values, np.uint32)
    return wave


_NAMED_SGPRS = {"vcc_lo": (VCC_LO, 1), "vcc": (VCC_LO, 2), "vcc_hi": (VCC_LO + 1, 1), "exec_lo": (EXEC_LO, 1),
                "exec": (EXEC_LO, 2), "exec_hi": (EXEC_LO + 1, 1), "m0": (125, 1)}


def _listed_registers(operands: str) -> int:
    """The registers an llvm-objdump operand list names, as waits.py's bit mask."""
    mask = 0
    pattern = r"\b([vs])\[(\d+):(\d+)\]|\b([vs])(\d+)\b|\b(vcc_lo|vcc_hi|vcc|exec_lo|exec_hi|exec|m0)\b|\bttmp(\d+)\b"
    for match in re.finditer(pattern, operands):
        if match.group(1):
            kind, first, count = match.group(1), int(match.group(2)), int(match.group(3)) - int(match.group(2)) + 1
        elif match.group(4):
            kind, first, count = match.group(4), int(match.group(5)), 1
        elif match.group(6):
            (first, count), kind = _NAMED_SGPRS[match.group(6)], "s"
        else:
            kind, first, count = "s", 108 + int(match.group(7)), 1
        mask |= ((1 << count) - 1) << (first if kind == "v" else SGPR_BIT + first)
    return mask


@pytest.mark.skipif(shutil.which("llvm-objdump-19") is None, reason="llvm-objdump-19 not installed")
@pytest.mark.parametrize("target", TARGETS)
def test_operand_registers_match_llvm_objdump(target):
    """The registers the check takes each shipped instruction to read or write are the ones
    llvm-objdump-19 prints for it (sizes of multi-register operands included), EXEC and VCC aside:
    the check adds them where an instruction uses them implicitly."""
    implicit = sgpr_bits(EXEC_LO) | sgpr_bits(VCC_LO)
    path = artifacts.prebuilt_artifact(target).path
    image = _image(target)
    for kernel in SAMPLE_KERNELS:
        listing = subprocess.run(["llvm-objdump-19", "-d", f"--mcpu={target}", f"--disassemble-symbols={kernel}",
                                  str(path)], capture_output=True, text=True, check=True).stdout
        rows = re.findall(r"^\s+(\S+)\s*(.*?)\s*// ([0-9A-F]+):", listing, re.MULTILINE)
        entry = int(rows[0][2], 16)
        listed = {int(address, 16) - entry: (mnemonic, operands.split(";")[0]) for mnemonic, operands, address in rows}
        program = image.program(kernel)
        for offset, d in CompiledKernel(program).instructions.items():
            mnemonic, operands = listed[offset]
            if mnemonic.startswith(("s_waitcnt", "s_wait_")):
                continue  # vmcnt(0), not registers
            expected = _listed_registers(operands)
            reads, writes = operand_masks(d, program.arch)
            missing, extra = expected & ~(reads | writes), (reads | writes) & ~expected & ~implicit
            assert not missing and not extra, (kernel, hex(offset), mnemonic, operands,
                                               missing and registers_text(missing), extra and registers_text(extra))


@pytest.mark.parametrize("target", TARGETS)
def test_a_shipped_kernel_without_its_first_load_wait_is_caught(target):
    """The shipped forward kernel with its first wait for global loads turned into s_nop: the
    interpreter names the instruction that reads a loaded register too early. (The kernel as
    shipped passes, as every interpreted test shows.)"""
    library, variant, args, buffers = _forward_launch(target)
    program = library.kernel(variant.symbol).program
    kernel = CompiledKernel(program)
    offset = next(offset for offset, d in kernel.instructions.items()
                  if any(counter in ("vmcnt", "loadcnt") and count < 63
                         for counter, count in wait_counts(d, program.arch) or ()))
    p = Program(target)
    nop = p.ins.SOPP(p.enum.SOPPOp.S_NOP, 0).to_bytes()
    code = program.code[:offset] + nop + program.code[offset + len(nop):]
    block = (variant.threads, 1, 1)
    segment = kernarg_segment(program, bytes(args), (1, 1, 1), block)
    regions = [tensor_region(i, t) for i, t in enumerate(buffers)]

    def run(code):
        mutated = CompiledKernel(dataclasses.replace(program, code=code))
        Dispatch(mutated, (1, 1, 1), block, program.descriptor.group_segment_fixed_size, segment, regions,
                 KernelTrace(program.name)).run()
    run(program.code)
    with pytest.raises(InterpreterError, match=rf"{program.name} pc 0x[0-9a-f]+ .*: reads v\d+ before a wait retires the "
                                               r"global_load_b128 v\[\d+:\d+\] issued at pc 0x"):
        run(code)
