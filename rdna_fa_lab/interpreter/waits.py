"""Memory operations in flight, and the waits that retire them.

The interpreter performs a load at once, but the hardware returns it later: until an s_waitcnt
(gfx11) or s_wait_*cnt (gfx12) has retired it, its destination registers are poisoned. An
instruction that reads a poisoned register, or writes one (the late return would overwrite the new
value), is an error naming the instruction, the register, the load and its counter.

The model is the one LLVM's SIInsertWaitcnts assumes, so that the compiler's correct code passes:

- Counters. gfx11: vmcnt (global/flat loads), lgkmcnt (LDS, scalar memory, s_sendmsg), vscnt
  (global/flat stores), expcnt. gfx12: loadcnt (global/flat loads and global_inv), dscnt (LDS),
  kmcnt (scalar memory, s_sendmsg), storecnt (stores, global_wb), samplecnt, bvhcnt, expcnt. A
  flat access counts as a global one: the interpreter has no flat LDS apertures, and LLVM counts it
  on vmcnt alone where it knows the address is global. buffer_gl0_inv / buffer_gl1_inv count on no
  counter (LLVM leaves them out).
- Order. A wait for count N retires all but the N newest operations of its counter when they return
  in issue order: one kind of operation (global loads, LDS accesses, ...). Scalar memory loads may
  return in any order, and so may a mix of kinds on one counter (LDS with scalar loads on gfx11's
  lgkmcnt): then only a wait for 0 retires anything. When a counter is full, issuing one more waits
  for the oldest (retiring it where order is known).
- Hazards. A read of a poisoned register needs the wait. So does a write, with one exception LLVM
  makes: on gfx11 a global/flat load may overwrite the destination of an earlier global/flat load
  in flight, as loads of one type write their registers in order (LLVM's vmem-write-vgpr-in-order,
  which gfx12 lacks). A d16 load merges into its destination, so it also reads it.
- Stores read their data and address registers when they issue on gfx11 and gfx12 (LLVM keeps
  store data registers locked only on gfx6, VMW_GPR_LOCK): a register a store names may be
  overwritten at once. Their counters are modelled, without registers.
- Memory order is not checked: the interpreter performs accesses in program order, and a wave's
  own LDS accesses are ordered by the hardware, so an LDS store followed by a load of the same
  bytes needs no wait (the LDS race check covers other waves).

Registers are tracked whole (a 16-bit half poisons its 32-bit register) and for all lanes, as LLVM
tracks them. Register sets are Python ints: VGPR i is bit i, SGPR (or VCC, M0, EXEC) encoding j is
bit 256 + j.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InterpreterError
from .vector import base_name
from .wave import EXEC_LO, NULL, VCC_LO, VGPR_BASE, Wave

SGPR_BIT = 256


def vgpr_bits(index: int, count: int = 1) -> int:
    return ((1 << count) - 1) << index


def sgpr_bits(index: int, count: int = 1) -> int:
    return ((1 << count) - 1) << (SGPR_BIT + index)


def register_name(bit: int) -> str:
    if bit < SGPR_BIT:
        return f"v{bit}"
    index = bit - SGPR_BIT
    return {VCC_LO: "vcc_lo", VCC_LO + 1: "vcc_hi", 125: "m0", EXEC_LO: "exec_lo", EXEC_LO + 1: "exec_hi"}.get(
        index, f"ttmp{index - 108}" if 108 <= index < 124 else f"s{index}")


def registers_text(mask: int) -> str:
    """A contiguous register set as the assembler writes it: v5, v[4:7], s[0:1]."""
    low = (mask & -mask).bit_length() - 1
    high = mask.bit_length() - 1
    if low == high:
        return register_name(low)
    first, last = register_name(low), register_name(high)
    if first[0] == last[0] and first[0] in "vs" and first[1:].isdigit() and last[1:].isdigit():
        return f"{first[0]}[{first[1:]}:{last[1:]}]"
    return f"{first}..{last}"


@dataclass(frozen=True)
class CounterModel:
    """The wait counters of an ISA: their hardware maximum, and which counter each kind of memory
    operation increments."""

    limits: dict[str, int]
    vector_load: str
    lds: str
    scalar: str  # scalar memory loads: they may return out of order
    store: str
    message: str
    loads_write_in_order: bool  # global/flat loads of one type write their VGPRs in issue order


GFX11 = CounterModel({"vmcnt": 63, "lgkmcnt": 63, "vscnt": 63, "expcnt": 7},
                     vector_load="vmcnt", lds="lgkmcnt", scalar="lgkmcnt", store="vscnt", message="lgkmcnt",
                     loads_write_in_order=True)
GFX12 = CounterModel({"loadcnt": 63, "dscnt": 63, "kmcnt": 31, "storecnt": 63, "samplecnt": 63, "bvhcnt": 7,
                      "expcnt": 7},
                     vector_load="loadcnt", lds="dscnt", scalar="kmcnt", store="storecnt", message="kmcnt",
                     loads_write_in_order=False)


def counter_model(arch: str) -> CounterModel:
    return GFX11 if arch == "rdna3" else GFX12


# Kinds of operation. "inv" (gfx12's global_inv) counts on loadcnt in order with the loads.
VECTOR_LOAD, LDS, SCALAR, STORE, MESSAGE, INVALIDATE = "vector load", "lds", "scalar load", "store", "message", "inv"


class Operation:
    """One memory operation in flight: the registers its return will write."""

    __slots__ = ("kind", "mask", "name", "pc", "counter", "sequence")

    def __init__(self, kind: str, mask: int, name: str, pc: int, counter: str):
        self.kind, self.mask, self.name, self.pc, self.counter = kind, mask, name, pc, counter
        self.sequence = 0  # issue order across the wave's counters


def _in_order(queue: list[Operation]) -> bool:
    """Whether the counter retires `queue` oldest first (LLVM's counterOutOfOrder, negated)."""
    kinds = {op.kind for op in queue if op.kind != INVALIDATE}
    return SCALAR not in kinds and len(kinds) <= 1


def _recompute_poison(wave: Wave) -> None:
    poison = 0
    for queue in wave.outstanding.values():
        for op in queue:
            poison |= op.mask
    wave.poison = poison


def retire(wave: Wave, counter: str, count: int) -> None:
    """The wait `counter` <= count: what the hardware guarantees has returned is retired."""
    queue = wave.outstanding.get(counter)
    if not queue or len(queue) <= count:
        return
    if count == 0:
        queue.clear()
    elif _in_order(queue):
        del queue[: len(queue) - count]
    else:
        return  # out of order: which ones returned is unknown
    _recompute_poison(wave)


def issue(wave: Wave, op: Operation, limit: int) -> None:
    queue = wave.outstanding.get(op.counter)
    if queue is None:
        queue = wave.outstanding[op.counter] = []
    elif len(queue) >= limit:
        retire(wave, op.counter, limit - 1)  # the hardware stalls the issue until the counter has room
    op.sequence = wave.issued
    wave.issued += 1
    queue.append(op)
    wave.poison |= op.mask


# ---------------------------------------------------------------------------------------------
# What each instruction reads and writes.

_DESTINATIONS = {"vdst", "sdst", "sdata", "vdstx", "vdsty"}
_MEMORY = {"GLOBAL", "FLAT", "VGLOBAL", "VFLAT", "SCRATCH", "VSCRATCH"}
_SHORT_VECTOR = {"VOP1", "VOP2", "VOPC"}
# Instructions that also read their destination: accumulators and tied inputs (LLVM's vdst_in).
_READS_DESTINATION = ("fmac_", "dot2acc_", "fma_mix", "permlanex16", "permlane16", "mac_")
_READS_VCC = ("cndmask_b32", "add_co_ci_u32", "sub_co_ci_u32", "subrev_co_ci_u32", "div_fmas_")


def _register_mask(offset: int, count: int, sixteen_bit_short: bool = False) -> int:
    if VGPR_BASE <= offset < 2 * VGPR_BASE:
        index = offset - VGPR_BASE
        if sixteen_bit_short:
            index &= 0x7F  # bit 7 of a 16-bit VOP1/VOP2/VOPC operand selects the high half
        return vgpr_bits(index, count)
    if offset < 128 and offset != NULL:
        return sgpr_bits(offset, min(count, 128 - offset))
    return 0  # inline constants, literals, SCC, ...


_FIELDS: dict[type, dict] = {}


def _field(inst, key: str):
    """(name, bit field) of the instruction field an operand key names, or None."""
    fields = _FIELDS.get(type(inst))
    if fields is None:
        fields = _FIELDS[type(inst)] = dict(inst._fields)
    for name in (key, key[1:] if key.startswith("v") else None):  # vsrc0 -> src0
        if name in fields:
            return name, fields[name]
    return None


def _operand_list(inst, operands: dict, bits: dict, rename=lambda key: key):
    """(field, register offset, register count, bits) of each register operand in `operands`."""
    from tinygrad.renderer.amd.dsl import Reg, VDSTYField

    out = []
    for key in operands:
        found = _field(inst, rename(key))
        if found is None:
            continue
        name, field = found
        # The raw field decoded (tinygrad's attribute access would also resize it, slowly).
        value = getattr(inst, name) if isinstance(field, VDSTYField) else field.decode(inst._raw >> field.lo & field.mask)
        if not isinstance(value, Reg):
            continue
        width = bits.get(key, operands[key][1])
        out.append((name, value.offset, max(1, -(-width // 32)), width))
    return out


_MASKS: dict[tuple, tuple[int, int]] = {}  # by encoding bits: kernels repeat many instructions


def operand_masks(d, arch: str) -> tuple[int, int]:
    """(registers read, registers written) by one instruction, EXEC and VCC included where implicit."""
    key = (arch, type(d.inst), d.inst._raw)
    masks = _MASKS.get(key)
    if masks is None:
        masks = _MASKS[key] = _operand_masks(d)
    return masks


def _operand_masks(d) -> tuple[int, int]:
    inst, name = d.inst, d.name
    encoding = d.encoding.split("_LIT")[0]
    if encoding == "VOPD":
        return _vopd_masks(inst)
    reads = writes = 0
    if not hasattr(inst, "op"):
        return 0, 0
    operands = inst.operands
    bits = inst.op_bits
    memory = encoding in _MEMORY
    for field, offset, count, width in _operand_list(inst, operands, bits):
        if memory and field in ("addr", "vaddr"):
            count = 1 if _uses_saddr(inst) and not encoding.endswith("FLAT") else 2
        if memory and field == "saddr" and not _uses_saddr(inst):
            continue
        mask = _register_mask(offset, count, width == 16 and encoding in _SHORT_VECTOR)
        destination = field in _DESTINATIONS or (encoding == "MUBUF" and field == "vdata" and "load" in name)
        if destination:
            writes |= mask
        else:
            reads |= mask
    short = base_name(name)
    vector = encoding.startswith(("VOP", "VINTERP")) or encoding in _MEMORY or encoding in ("DS", "MUBUF")
    if vector:
        reads |= sgpr_bits(EXEC_LO)
    if encoding == "SOPK" and "cmpk" in name:
        reads, writes = reads | writes, 0  # s_cmpk_*: sdst is the compared operand
    elif encoding == "SOPK" and name.startswith(("s_addk", "s_mulk", "s_cmovk")):
        reads |= writes
    elif "saveexec" in name:
        reads |= sgpr_bits(EXEC_LO)
        writes |= sgpr_bits(EXEC_LO)
    elif name in ("s_cbranch_vccz", "s_cbranch_vccnz"):
        reads |= sgpr_bits(VCC_LO)
    elif name in ("s_cbranch_execz", "s_cbranch_execnz"):
        reads |= sgpr_bits(EXEC_LO)
    if encoding.startswith("VOP"):
        if short.startswith("cmpx_"):
            writes = sgpr_bits(EXEC_LO)  # gfx11/gfx12 v_cmpx writes EXEC only
        elif encoding == "VOPC":
            writes |= sgpr_bits(VCC_LO)
        if encoding == "VOP2" and "_co_" in short:
            writes |= sgpr_bits(VCC_LO)  # carry out
        if short.startswith(_READS_VCC) and (encoding == "VOP2" or short.startswith("div_fmas")):
            reads |= sgpr_bits(VCC_LO)
        if short.startswith(_READS_DESTINATION):
            reads |= writes & ((1 << SGPR_BIT) - 1)
    if (encoding in _MEMORY or encoding == "DS") and "_d16" in name and "load" in name:
        reads |= writes  # a d16 load keeps the other half of its destination
    return reads, writes


def _uses_saddr(inst) -> bool:
    saddr = inst.saddr.offset
    return saddr < 128 and saddr not in (NULL, 125)


def _vopd_masks(inst) -> tuple[int, int]:
    from tinygrad.renderer.amd.dsl import OPERANDS

    reads, writes = sgpr_bits(EXEC_LO), 0
    for op, half in ((inst.opx, "x"), (inst.opy, "y")):
        operands = OPERANDS.get(op, {})
        rename = (lambda key: key.replace("y", "x")) if half == "x" else (lambda key: key)
        half_writes = 0
        for field, offset, count, _width in _operand_list(inst, operands, {}, rename):
            mask = _register_mask(offset, count)
            if field.startswith("vdst"):
                half_writes |= mask
            else:
                reads |= mask
        short = base_name(op.name.lower())
        if short.startswith(_READS_DESTINATION):
            reads |= half_writes
        if short.startswith("cndmask"):
            reads |= sgpr_bits(VCC_LO)
        writes |= half_writes
    return reads, writes


# ---------------------------------------------------------------------------------------------
# Which counter an instruction increments, and the waits.

def memory_operation(d, arch: str) -> tuple[str, str] | None:
    """(counter, kind) of an instruction that increments a wait counter, else None."""
    model = counter_model(arch)
    encoding, name = d.encoding.split("_LIT")[0], d.name
    if encoding == "SMEM":
        return model.scalar, SCALAR
    if encoding == "DS":
        return model.lds, LDS
    if encoding in _MEMORY:
        if name == "global_inv":
            return model.vector_load, INVALIDATE
        if name.startswith(("global_wb", "global_wbinv")):
            return model.store, STORE
        op = name.split("_", 1)[1]
        if op.startswith("load") or "_rtn" in op or (op.startswith("atomic") and getattr(d.inst, "glc", 0)):
            return model.vector_load, VECTOR_LOAD
        return model.store, STORE
    if encoding == "MUBUF":
        if name in ("buffer_gl0_inv", "buffer_gl1_inv"):
            return None  # LLVM counts no cache invalidation of gfx11's MUBUF form
        return (model.vector_load, VECTOR_LOAD) if "load" in name else (model.store, STORE)
    if name in ("s_sendmsg", "s_sendmsghalt", "s_sendmsg_rtn_b32", "s_sendmsg_rtn_b64"):
        return model.message, MESSAGE
    return None


_GFX12_WAITS = {
    "s_wait_loadcnt": "loadcnt", "s_wait_dscnt": "dscnt", "s_wait_kmcnt": "kmcnt", "s_wait_storecnt": "storecnt",
    "s_wait_samplecnt": "samplecnt", "s_wait_bvhcnt": "bvhcnt", "s_wait_expcnt": "expcnt",
}
_GFX11_SOPK_WAITS = {"s_waitcnt_vscnt": "vscnt", "s_waitcnt_vmcnt": "vmcnt", "s_waitcnt_lgkmcnt": "lgkmcnt",
                     "s_waitcnt_expcnt": "expcnt"}


def wait_counts(d, arch: str) -> list[tuple[str, int]] | None:
    """[(counter, count)] a wait instruction waits for, or None if `d` is no counter wait."""
    name, simm = d.name, getattr(d.inst, "simm16", 0)
    if arch == "rdna3":
        if name == "s_waitcnt":
            return [("vmcnt", simm >> 10 & 0x3F), ("lgkmcnt", simm >> 4 & 0x3F), ("expcnt", simm & 0x7)]
        if name in _GFX11_SOPK_WAITS:
            if d.inst.sdst.offset != NULL:
                raise InterpreterError(f"{name} with a register count is not supported")
            return [(_GFX11_SOPK_WAITS[name], simm & 0x3F)]
        return None
    if name in _GFX12_WAITS:
        return [(_GFX12_WAITS[name], simm)]
    if name == "s_wait_loadcnt_dscnt":
        return [("loadcnt", simm >> 8 & 0x3F), ("dscnt", simm & 0x3F)]
    if name == "s_wait_storecnt_dscnt":
        return [("storecnt", simm >> 8 & 0x3F), ("dscnt", simm & 0x3F)]
    return None


def compile_wait(d, ctx):
    """The closure of a counter wait, or None. (s_delay_alu, s_waitcnt_depctr and gfx12's s_wait_alu
    are not waits on memory: on gfx11/gfx12 the hardware interlocks VALU and SALU dependencies by
    itself, and s_delay_alu only tells it where to insert the stalls early, a performance hint. They
    stay no-ops in scalar.py and nothing checks them.)"""
    try:
        waits = wait_counts(d, ctx.arch)
    except InterpreterError as error:
        raise InterpreterError(str(error), ctx.kernel, d.offset, d.name) from None
    if waits is None:
        return None
    waits = tuple(waits)

    def wait(wave: Wave):
        if wave.outstanding:
            for counter, count in waits:
                retire(wave, counter, count)
    return wait


def with_issue(run, d, ctx, writes: int):
    """`run` followed by the issue of its memory operation (its written registers poisoned)."""
    operation = memory_operation(d, ctx.arch)
    if operation is None:
        return run
    counter, kind = operation
    limit = counter_model(ctx.arch).limits[counter]
    name, pc = d.name, d.offset

    def run_and_issue(wave: Wave):
        target = run(wave)
        issue(wave, Operation(kind, writes, name, pc, counter), limit)
        return target
    return run_and_issue


def check_hazard(wave: Wave, step, ctx) -> None:
    """Raises if the instruction of `step` reads or writes a register a memory operation in flight
    still has to write; called only when its registers meet the poisoned ones."""
    d = step.decoded
    read_hit = wave.poison & step.reads
    write_hit = wave.poison & step.writes
    if read_hit:
        register, op = _culprit(wave, read_hit)
        raise InterpreterError(f"reads {register_name(register)} before a wait retires the "
                               f"{_describe(wave, op, ctx)}", ctx.kernel, d.offset, d.name)
    if step.in_order_load:
        ops = [op for queue in wave.outstanding.values() for op in queue if op.mask & write_hit]
        if all(op.kind == VECTOR_LOAD for op in ops):
            return  # gfx11: loads of one type write their registers in issue order
    register, op = _culprit(wave, write_hit)
    raise InterpreterError(f"writes {register_name(register)} while the {_describe(wave, op, ctx)} may still "
                           "write it (its late return would overwrite this value): it needs a wait first",
                           ctx.kernel, d.offset, d.name)


def _culprit(wave: Wave, hit: int) -> tuple[int, Operation]:
    """The lowest register of `hit` and the newest operation in flight that writes it."""
    register = (hit & -hit).bit_length() - 1
    bit = 1 << register
    newest = None
    for queue in wave.outstanding.values():
        for op in queue:
            if op.mask & bit:
                newest = op if newest is None or op.sequence > newest.sequence else newest
    return register, newest


def _describe(wave: Wave, op: Operation, ctx) -> str:
    queue = wave.outstanding[op.counter]
    position = queue.index(op)
    newer = len(queue) - 1 - position
    needed = newer if _in_order(queue) else 0
    wait = f"s_waitcnt {op.counter}({needed})" if ctx.arch == "rdna3" else f"s_wait_{op.counter} {needed}"
    return (f"{op.name} {registers_text(op.mask)} issued at pc 0x{op.pc:x}, outstanding on {op.counter} "
            f"({len(queue)} in flight, {newer} issued after it; {wait} would retire it)")
