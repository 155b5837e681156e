"""Memory the kernel can reach: the launch's buffers (global/flat), the kernarg segment (SMEM),
and the workgroup's LDS (DS). Every access is checked: a byte outside the launch's tensors, the
kernarg segment or the LDS allocation is an error naming kernel, pc and address.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .wave import NULL, VGPR_BASE, Wave, scalar_reader


@dataclass
class Region:
    name: str
    start: int
    data: np.ndarray  # uint8 view of the bytes
    writable: bool

    @property
    def end(self) -> int:
        return self.start + self.data.size


def host_bytes(address: int, size: int) -> np.ndarray:
    """A writable uint8 view of host memory (a CPU tensor's bytes)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address))


class AddressSpace:
    def __init__(self, regions: list[Region]):
        self.regions = regions

    def _locate(self, addresses: np.ndarray, size: int, writing: bool, where) -> list[tuple[Region, np.ndarray]]:
        """(region, lane selector) pairs covering every address; raises on any stray byte."""
        remaining = np.ones(addresses.shape, bool)
        found = []
        for region in self.regions:
            inside = remaining & (addresses >= region.start) & (addresses + size <= region.end)
            if inside.any():
                if writing and not region.writable:
                    raise where(f"store to read-only {region.name} at 0x{int(addresses[inside][0]):x}")
                found.append((region, inside))
                remaining &= ~inside
        if remaining.any():
            stray = int(addresses[remaining][0])
            near = min(self.regions, key=lambda r: min(abs(stray - r.start), abs(stray - r.end)), default=None)
            hint = f" (nearest buffer: {near.name} 0x{near.start:x}-0x{near.end:x})" if near else ""
            raise where(f"{'store' if writing else 'load'} of {size} bytes at 0x{stray:x} outside every launch buffer{hint}")
        return found

    def load(self, addresses: np.ndarray, size: int, where) -> np.ndarray:
        """(lanes, size) uint8 bytes at the given addresses."""
        out = np.zeros((addresses.size, size), np.uint8)
        offsets = np.arange(size, dtype=np.int64)
        for region, lanes in self._locate(addresses, size, False, where):
            index = (addresses[lanes] - region.start).astype(np.int64)[:, None] + offsets
            out[lanes] = region.data[index]
        return out

    def store(self, addresses: np.ndarray, data: np.ndarray, where) -> None:
        size = data.shape[1]
        offsets = np.arange(size, dtype=np.int64)
        for region, lanes in self._locate(addresses, size, True, where):
            index = (addresses[lanes] - region.start).astype(np.int64)[:, None] + offsets
            region.data[index] = data[lanes]


def _registers_to_bytes(registers: np.ndarray, size: int) -> np.ndarray:
    """(regs, lanes) uint32 -> (lanes, size) bytes, little-endian."""
    return np.ascontiguousarray(registers.T).view(np.uint8)[:, :size]


def _bytes_to_registers(data: np.ndarray, regs: int) -> np.ndarray:
    padded = np.zeros((data.shape[0], regs * 4), np.uint8)
    padded[:, : data.shape[1]] = data
    return padded.view(np.uint32).T


# Access size and how a load fills its destination: "full" (whole dwords), "zext"/"sext" (one dword
# from 1 or 2 bytes), "d16"/"d16_hi" (one 16-bit half, the other kept).
_SIZES = {"b32": 4, "b64": 8, "b96": 12, "b128": 16, "u8": 1, "i8": 1, "u16": 2, "i16": 2, "b8": 1, "b16": 2}


def _access(name: str) -> tuple[int, str]:
    suffix = name.rsplit("_", 1)[-1]
    if "_d16_hi_" in name or name.endswith("_d16_hi"):
        kind = "d16_hi"
    elif "_d16_" in name or name.endswith("_d16"):
        kind = "d16"
    elif suffix in ("u8", "u16"):
        kind = "zext"
    elif suffix in ("i8", "i16"):
        kind = "sext"
    else:
        kind = "full"
    if name.endswith(("_d16", "_d16_hi")):
        suffix = name.split("_")[2]
    if suffix not in _SIZES:
        raise KeyError(name)
    return _SIZES[suffix], kind


def _write_loaded(wave: Wave, destination: int, data: np.ndarray, kind: str, lanes: np.ndarray) -> None:
    size = data.shape[1]
    if kind == "full":
        values = _bytes_to_registers(data, size // 4)
        for i in range(size // 4):
            wave.vgpr[destination + i][lanes] = values[i]
        return
    value = data.astype(np.uint32) @ (np.uint32(1) << (8 * np.arange(size, dtype=np.uint32)))
    if kind == "sext":
        bits = 8 * size
        value = np.where(value >> (bits - 1) & 1, value | np.uint32((0xFFFFFFFF << bits) & 0xFFFFFFFF), value)
    if kind in ("d16", "d16_hi"):
        old = wave.vgpr[destination][lanes]
        value = (old & np.uint32(0xFFFF0000)) | value if kind == "d16" else (old & np.uint32(0xFFFF)) | value << np.uint32(16)
    wave.vgpr[destination][lanes] = value.astype(np.uint32)


def _data_bytes(wave: Wave, source: int, size: int, kind: str, lanes: np.ndarray) -> np.ndarray:
    regs = max(size // 4, 1)
    registers = wave.vgpr[source : source + regs][:, lanes]
    if kind == "d16_hi":
        registers = registers >> np.uint32(16)
    return _registers_to_bytes(registers, size)


def compile_memory(d, ctx):
    encoding = d.encoding.split("_LIT")[0]
    if d.name in ("global_inv", "global_wb", "global_wbinv") or (
            encoding == "MUBUF" and d.name in ("buffer_gl0_inv", "buffer_gl1_inv")):
        return lambda wave: None  # cache invalidation / write-back: the interpreter has no caches
    if encoding == "SMEM":
        return _compile_smem(d, ctx)
    if encoding == "DS":
        return _compile_ds(d, ctx)
    if encoding in ("GLOBAL", "FLAT", "VGLOBAL", "VFLAT"):
        return _compile_global(d, ctx)
    return None


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >> (bits - 1) & 1 else value


def _compile_smem(d, ctx):
    inst, name = d.inst, d.name
    if not name.startswith("s_load_b"):
        return None
    regs = int(name.removeprefix("s_load_b")) // 32
    immediate = _signed(inst.ioffset, 24) if ctx.arch == "rdna4" else _signed(inst.offset, 21)
    read_base = scalar_reader(inst.sbase.offset, None, 2)
    read_soffset = scalar_reader(inst.soffset.offset, None, 1) if inst.soffset.offset != NULL else (lambda wave: 0)
    destination = inst.sdata.offset

    def run(wave: Wave):
        address = (read_base(wave) + immediate + read_soffset(wave)) & ~3
        data = ctx.scalar_memory.load(np.array([address], np.uint64), 4 * regs, ctx.where(d))
        values = data.view(np.uint32)[0]
        for i in range(regs):
            wave.sgpr[destination + i] = int(values[i])
    return run


def _compile_global(d, ctx):
    inst, name = d.inst, d.name
    op = name.split("_", 1)[1]  # load_b128, store_b32, ...
    if op.startswith("atomic") or "lds" in op or "addtid" in op:
        return None
    try:
        size, kind = _access(name)
    except KeyError:
        return None
    gfx12 = ctx.arch == "rdna4"
    offset = _signed(inst.ioffset, 24) if gfx12 else _signed(inst.offset, 13)
    address_register = (inst.vaddr if gfx12 else inst.addr).offset - VGPR_BASE
    data_register = (inst.vsrc if gfx12 else inst.data).offset - VGPR_BASE
    destination = inst.vdst.offset - VGPR_BASE
    saddr = inst.saddr.offset
    uses_saddr = saddr not in (NULL, 125) and saddr < 128
    read_saddr = scalar_reader(saddr, None, 2) if uses_saddr else None
    storing = op.startswith("store")

    def addresses(wave: Wave, lanes: np.ndarray) -> np.ndarray:
        if uses_saddr:
            vector = wave.vgpr[address_register][lanes].astype(np.uint64)
            return vector + np.uint64(read_saddr(wave)) + np.uint64(offset & 0xFFFFFFFFFFFFFFFF)
        low = wave.vgpr[address_register][lanes].astype(np.uint64)
        high = wave.vgpr[address_register + 1][lanes].astype(np.uint64)
        return (high << np.uint64(32) | low) + np.uint64(offset & 0xFFFFFFFFFFFFFFFF)

    where = ctx.where(d)
    if storing:
        def store(wave: Wave):
            lanes = wave.exec_lanes()
            if lanes.any():
                ctx.global_memory.store(addresses(wave, lanes), _data_bytes(wave, data_register, size, kind, lanes), where)
        return store

    def load(wave: Wave):
        lanes = wave.exec_lanes()
        if lanes.any():
            _write_loaded(wave, destination, ctx.global_memory.load(addresses(wave, lanes), size, where), kind, lanes)
    return load


class LocalDataShare:
    """The workgroup's LDS: exactly the bytes a real launch allocates, with a race check. Between
    two barriers (one epoch), a byte one wave wrote must not be read or written by another wave,
    and a byte other waves read must not be written: such a kernel's result depends on how the
    hardware happens to schedule its waves."""

    def __init__(self, size: int):
        # Poisoned: real LDS starts with whatever the last workgroup left, so a kernel that reads
        # bytes it never wrote gets NaN here (0xff bytes are NaN as f16 and f32), not a helpful 0.
        self.data = np.full(size, 0xFF, np.uint8)
        self.epoch = 1
        self._write_epoch = np.zeros(size, np.int64)
        self._writer = np.zeros(size, np.int64)
        self._read_epoch = np.zeros(size, np.int64)
        self._readers = np.zeros(size, np.int64)  # bit w: wave w read the byte in _read_epoch

    def _index(self, addresses: np.ndarray, size: int, where) -> np.ndarray:
        if addresses.size and int(addresses.max()) + size > self.data.size:
            stray = int(addresses[addresses + size > self.data.size][0])
            raise where(f"LDS access of {size} bytes at {stray} beyond the {self.data.size} bytes allocated")
        return (addresses.astype(np.int64)[:, None] + np.arange(size)).ravel()

    def _race(self, index, conflict, wave_id, what, where):
        byte = int(index[conflict][0])
        other = int(self._writer[byte]) if what != "write after read" else int(self._readers[byte])
        raise where(f"LDS race: wave {wave_id} {what} at byte {byte} (other wave{'s mask' if what == 'write after read' else ''} "
                    f"{other:#x}) with no barrier between")

    def load(self, addresses, size, where, wave_id: int):
        index = self._index(addresses, size, where)
        conflict = (self._write_epoch[index] == self.epoch) & (self._writer[index] != wave_id)
        if conflict.any():
            self._race(index, conflict, wave_id, "reads a byte another wave wrote", where)
        fresh = self._read_epoch[index] != self.epoch
        self._readers[index[fresh]] = 0
        self._read_epoch[index] = self.epoch
        np.bitwise_or.at(self._readers, index, 1 << wave_id)
        return self.data[index].reshape(-1, size)

    def store(self, addresses, data, where, wave_id: int):
        size = data.shape[1]
        index = self._index(addresses, size, where)
        conflict = (self._write_epoch[index] == self.epoch) & (self._writer[index] != wave_id)
        if conflict.any():
            self._race(index, conflict, wave_id, "writes a byte another wave wrote", where)
        read_by_others = (self._read_epoch[index] == self.epoch) & ((self._readers[index] & ~(1 << wave_id)) != 0)
        if read_by_others.any():
            self._race(index, read_by_others, wave_id, "write after read", where)
        self.data[index] = data.ravel()
        self._write_epoch[index] = self.epoch
        self._writer[index] = wave_id


def _compile_ds(d, ctx):
    inst, name = d.inst, d.name
    if inst.__class__.__name__ == "DS" and getattr(inst, "gds", 0):
        return None
    address_register = inst.addr.offset - VGPR_BASE
    data0, data1 = inst.data0.offset - VGPR_BASE, inst.data1.offset - VGPR_BASE
    destination = inst.vdst.offset - VGPR_BASE
    offset16 = inst.offset0 | inst.offset1 << 8
    where = ctx.where(d)
    two_address = "_2addr_" in name
    if two_address:
        width = 4 if name.endswith("b32") else 8
        stride = width * (64 if "stride64" in name else 1)
        offsets = (inst.offset0 * stride, inst.offset1 * stride)
        if name.startswith("ds_store_2addr"):
            def store_pair(wave: Wave):
                lanes = wave.exec_lanes()
                base = wave.vgpr[address_register][lanes].astype(np.int64)
                for data, extra in ((data0, offsets[0]), (data1, offsets[1])):
                    ctx.lds.store(base + extra, _data_bytes(wave, data, width, "full", lanes), where, wave.wave_id)
            return store_pair
        if name.startswith("ds_load_2addr"):
            def load_pair(wave: Wave):
                lanes = wave.exec_lanes()
                base = wave.vgpr[address_register][lanes].astype(np.int64)
                loaded = [ctx.lds.load(base + extra, width, where, wave.wave_id) for extra in offsets]
                for i, data in enumerate(loaded):
                    _write_loaded(wave, destination + i * width // 4, data, "full", lanes)
            return load_pair
        return None
    try:
        size, kind = _access(name)
    except KeyError:
        return None
    if name.startswith("ds_store_"):
        def store(wave: Wave):
            lanes = wave.exec_lanes()
            base = wave.vgpr[address_register][lanes].astype(np.int64) + offset16
            ctx.lds.store(base, _data_bytes(wave, data0, size, kind, lanes), where, wave.wave_id)
        return store
    if name.startswith("ds_load_"):
        def load(wave: Wave):
            lanes = wave.exec_lanes()
            base = wave.vgpr[address_register][lanes].astype(np.int64) + offset16
            _write_loaded(wave, destination, ctx.lds.load(base, size, where, wave.wave_id), kind, lanes)
        return load
    return None
