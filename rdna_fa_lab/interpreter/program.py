"""One kernel of a code object, ready to run: its machine code, its kernel descriptor and metadata.

The ELF is read with the standard library (section headers, symbol table, PT_LOAD segments); the
metadata comes from the project's own reader (rdna_flash_attn.codeobject).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from rdna_flash_attn.runtime import codeobject
from .errors import InterpreterError

_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_PT_LOAD = 1
_KERNEL_DESCRIPTOR_BYTES = 64


@dataclass(frozen=True)
class KernelDescriptor:
    """The fields of the 64-byte amd_kernel_code_t successor (AMDGPUUsage "Kernel Descriptor")
    that decide a wave's initial state."""

    group_segment_fixed_size: int
    kernarg_size: int
    entry_offset: int
    rsrc1: int
    rsrc2: int
    code_properties: int

    @property
    def float_mode(self) -> int:
        """COMPUTE_PGM_RSRC1 bits 12-19: rounding (f32, f16/f64) and denormal modes."""
        return (self.rsrc1 >> 12) & 0xFF

    @property
    def user_sgpr_count(self) -> int:
        return (self.rsrc2 >> 1) & 0x1F

    def workgroup_id_enabled(self, axis: int) -> bool:
        return bool(self.rsrc2 >> (7 + axis) & 1)

    @property
    def workgroup_info_enabled(self) -> bool:
        return bool(self.rsrc2 >> 10 & 1)

    @property
    def private_segment_enabled(self) -> bool:
        return bool(self.rsrc2 & 1)

    def property_enabled(self, bit: int) -> bool:
        return bool(self.code_properties >> bit & 1)


# kernel_code_properties bits, in the order the user SGPRs they enable are laid out, with their size.
USER_SGPR_LAYOUT = (
    ("private_segment_buffer", 0, 4),
    ("dispatch_ptr", 1, 2),
    ("queue_ptr", 2, 2),
    ("kernarg_segment_ptr", 3, 2),
    ("dispatch_id", 4, 2),
    ("flat_scratch_init", 5, 2),
    ("private_segment_size", 6, 1),
)


@dataclass(frozen=True)
class KernelProgram:
    name: str
    target: str  # gfx1100, gfx1201, ...
    code: bytes  # the kernel's machine code, from its entry to the end of its symbol
    entry_address: int  # virtual address of code[0]
    descriptor: KernelDescriptor
    metadata: dict[str, Any]

    @property
    def arch(self) -> str:
        """tinygrad's name of the instruction set: rdna3 (gfx11) or rdna4 (gfx12)."""
        if self.target.startswith("gfx11"):
            return "rdna3"
        if self.target.startswith("gfx12"):
            return "rdna4"
        raise InterpreterError(f"{self.target} is not an RDNA3/RDNA4 target", self.name)

    @property
    def lds_bytes(self) -> int:
        return self.metadata[".group_segment_fixed_size"]

    @property
    def kernarg_size(self) -> int:
        return self.metadata[".kernarg_segment_size"]

    @property
    def args(self) -> list[dict[str, Any]]:
        return self.metadata.get(".args", [])


class CodeObjectImage:
    """A whole code object: finds each kernel's code and descriptor by symbol."""

    def __init__(self, data: bytes):
        self.data = data
        metadata = codeobject.read_metadata(data)
        self.target = codeobject.processor_of(metadata["amdhsa.target"])
        self._kernel_metadata = {k[".name"]: k for k in metadata["amdhsa.kernels"]}
        self._segments = self._load_segments()
        self._symbols = self._read_symbols()
        self._programs: dict[str, KernelProgram] = {}

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._kernel_metadata)

    def program(self, name: str) -> KernelProgram:
        program = self._programs.get(name)
        if program is None:
            program = self._programs[name] = self._build_program(name)
        return program

    def _build_program(self, name: str) -> KernelProgram:
        if name not in self._kernel_metadata:
            raise InterpreterError(f"the {self.target} code object has no kernel {name}")
        metadata = self._kernel_metadata[name]
        kd_address, _ = self._symbols[metadata.get(".symbol", name + ".kd")]
        kd = self.read(kd_address, _KERNEL_DESCRIPTOR_BYTES)
        group, _private, kernarg_size = struct.unpack_from("<III", kd, 0)
        (entry_offset,) = struct.unpack_from("<q", kd, 16)
        rsrc3, rsrc1, rsrc2 = struct.unpack_from("<III", kd, 44)
        (properties,) = struct.unpack_from("<H", kd, 56)
        descriptor = KernelDescriptor(group, kernarg_size, entry_offset, rsrc1, rsrc2, properties)
        entry = kd_address + entry_offset
        code_address, code_size = self._symbols.get(name, (entry, 0))
        if code_address != entry or code_size == 0:
            raise InterpreterError(f"kernel symbol {name} does not start at its descriptor's entry 0x{entry:x}")
        return KernelProgram(name, self.target, self.read(entry, code_size), entry, descriptor, metadata)

    def read(self, address: int, size: int) -> bytes:
        for vaddr, offset, filesz in self._segments:
            if vaddr <= address and address + size <= vaddr + filesz:
                start = offset + address - vaddr
                return self.data[start : start + size]
        raise InterpreterError(f"address 0x{address:x}+{size} is in no loaded segment of the code object")

    def _load_segments(self) -> list[tuple[int, int, int]]:
        (phoff,) = struct.unpack_from("<Q", self.data, 32)
        phentsize, phnum = struct.unpack_from("<HH", self.data, 54)
        segments = []
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", self.data, phoff + i * phentsize)
            if p_type == _PT_LOAD:
                segments.append((p_vaddr, p_offset, p_filesz))
        return segments

    def _read_symbols(self) -> dict[str, tuple[int, int]]:
        data = self.data
        (shoff,) = struct.unpack_from("<Q", data, 40)
        shentsize, shnum = struct.unpack_from("<HH", data, 58)
        headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        symbols: dict[str, tuple[int, int]] = {}
        for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in headers:
            if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM):
                continue
            strings_offset = headers[link][4]
            for pos in range(offset, offset + size, entsize):
                st_name, _st_info, _other, _shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", data, pos)
                end = data.index(b"\0", strings_offset + st_name)
                symbol = data[strings_offset + st_name : end].decode()
                if symbol:
                    symbols[symbol] = (st_value, st_size)
        return symbols
