"""Read the resource usage of every kernel in an AMDGPU code object (.hsaco), without ROCm.

A code object is an ELF64 shared object. The compiler records each kernel's registers, LDS,
scratch and spills in one ELF note, NT_AMDGPU_METADATA (owner "AMDGPU", type 32), whose payload
is MessagePack (AMDGPUUsage, "Code Object V3 to V5 Metadata"). This module parses just enough
ELF and MessagePack to read it: the standard library only, because `doctor` uses it at runtime.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_EM_AMDGPU = 224
_PT_NOTE = 4
_NT_AMDGPU_METADATA = 32
_NOTE_OWNER = b"AMDGPU"
# e_ident[EI_ABIVERSION] of an HSA code object -> code object version (AMDGPUUsage, "ELF Header")
_EI_ABIVERSION = 8
_ABI_VERSION_TO_CODE_OBJECT = {2: 4, 3: 5, 4: 6}

# e_flags & EF_AMDGPU_MACH (0xff) -> processor, for the targets this project builds: AMDGPUUsage's
# EF_AMDGPU_MACH table (LLVM BinaryFormat/ELF.h), as llvm-readelf-19 decodes clang-19's output. Only
# used when the metadata lacks amdhsa.target.
_EF_AMDGPU_MACH = 0xFF
_MACH_TO_PROCESSOR = {
    0x41: "gfx1100",
    0x46: "gfx1101",
    0x47: "gfx1102",
    0x44: "gfx1103",
    0x43: "gfx1150",
    0x4A: "gfx1151",
    0x55: "gfx1152",
    0x48: "gfx1200",
    0x4E: "gfx1201",
}


class CodeObjectError(ValueError):
    """The bytes are not an AMDGPU code object this reader understands."""


@dataclass(frozen=True)
class KernelResources:
    name: str
    vgpr_count: int
    sgpr_count: int
    agpr_count: int | None  # only on targets with accumulation registers (none of RDNA)
    lds_bytes: int  # .group_segment_fixed_size: static LDS; dynamic LDS is added at launch
    scratch_bytes: int  # .private_segment_fixed_size, per work-item
    vgpr_spill_count: int
    sgpr_spill_count: int
    uses_dynamic_stack: bool  # scratch whose size the compiler could not bound
    max_flat_workgroup_size: int
    wavefront_size: int
    workgroup_processor_mode: bool  # WGP mode (gfx10+ default) vs CU mode
    # value kinds of the implicit arguments the runtime appends (hidden_block_count_x, ...): their
    # layout differs between code object v4 and v5
    hidden_args: tuple[str, ...] = ()
    kernarg_bytes: int = 0  # .kernarg_segment_size: explicit arguments plus any hidden ones


@dataclass(frozen=True)
class CodeObject:
    target: str  # processor, e.g. "gfx1100"
    target_id: str  # full target ID, e.g. "amdgcn-amd-amdhsa--gfx1100"
    kernels: tuple[KernelResources, ...]
    code_object_version: int | None = None  # from the ELF header; None if not an HSA version it knows

    def kernel(self, name: str) -> KernelResources:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)


def load_code_object(path: str | Path) -> CodeObject:
    return parse_code_object(Path(path).read_bytes())


def parse_code_object(data: bytes) -> CodeObject:
    metadata = read_metadata(data)
    target_id = metadata["amdhsa.target"]
    kernels = tuple(_kernel_resources(k) for k in metadata["amdhsa.kernels"])
    return CodeObject(target=processor_of(target_id), target_id=target_id, kernels=kernels,
                      code_object_version=_ABI_VERSION_TO_CODE_OBJECT.get(data[_EI_ABIVERSION]))


def read_metadata(data: bytes) -> dict[str, Any]:
    """The code object's whole AMDGPU metadata map; amdhsa.target is filled from the ELF flags
    when the metadata lacks it."""
    e_flags = _check_elf_header(data)
    metadata = unpack_msgpack(_metadata_note(data))
    if not isinstance(metadata, dict) or "amdhsa.kernels" not in metadata:
        raise CodeObjectError("AMDGPU metadata has no amdhsa.kernels")
    if not metadata.get("amdhsa.target"):
        metadata["amdhsa.target"] = _target_from_flags(e_flags)
    return metadata


def processor_of(target_id: str) -> str:
    """'amdgcn-amd-amdhsa--gfx1100:xnack-' -> 'gfx1100'."""
    return target_id.split(":", 1)[0].rsplit("-", 1)[-1]


def _check_elf_header(data: bytes) -> int:
    """Validate an ELF64 little-endian AMDGPU header; return e_flags."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        raise CodeObjectError("not an ELF file")
    if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
        raise CodeObjectError("not a little-endian ELF64 file")
    (e_machine,) = struct.unpack_from("<H", data, 18)
    if e_machine != _EM_AMDGPU:
        raise CodeObjectError(f"ELF machine {e_machine} is not AMDGPU ({_EM_AMDGPU})")
    (e_flags,) = struct.unpack_from("<I", data, 48)
    return e_flags


def _target_from_flags(e_flags: int) -> str:
    mach = e_flags & _EF_AMDGPU_MACH
    if mach not in _MACH_TO_PROCESSOR:
        raise CodeObjectError(f"no amdhsa.target and unknown EF_AMDGPU_MACH 0x{mach:x}")
    return f"amdgcn-amd-amdhsa--{_MACH_TO_PROCESSOR[mach]}"


def _metadata_note(data: bytes) -> bytes:
    """Payload of the NT_AMDGPU_METADATA note, found through the PT_NOTE program headers."""
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == _PT_NOTE:
            payload = _find_note(data, p_offset, p_offset + p_filesz)
            if payload is not None:
                return payload
    raise CodeObjectError("no NT_AMDGPU_METADATA note (is this a linked code object v3+?)")


def _find_note(data: bytes, start: int, end: int) -> bytes | None:
    pos = start
    while pos + 12 <= end:
        namesz, descsz, note_type = struct.unpack_from("<III", data, pos)
        name_at = pos + 12
        desc_at = name_at + _align4(namesz)
        if desc_at + descsz > end:
            raise CodeObjectError("truncated ELF note")
        if note_type == _NT_AMDGPU_METADATA and data[name_at : name_at + namesz].rstrip(b"\0") == _NOTE_OWNER:
            return data[desc_at : desc_at + descsz]
        pos = desc_at + _align4(descsz)
    return None


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _kernel_resources(meta: dict[str, Any]) -> KernelResources:
    try:
        return KernelResources(
            name=meta[".name"],
            vgpr_count=meta[".vgpr_count"],
            sgpr_count=meta[".sgpr_count"],
            agpr_count=meta.get(".agpr_count"),
            lds_bytes=meta[".group_segment_fixed_size"],
            scratch_bytes=meta[".private_segment_fixed_size"],
            vgpr_spill_count=meta.get(".vgpr_spill_count", 0),
            sgpr_spill_count=meta.get(".sgpr_spill_count", 0),
            uses_dynamic_stack=bool(meta.get(".uses_dynamic_stack", False)),
            max_flat_workgroup_size=meta[".max_flat_workgroup_size"],
            wavefront_size=meta[".wavefront_size"],
            # Absent before code object v5; gfx10+ compiles in WGP mode unless told otherwise.
            workgroup_processor_mode=bool(meta.get(".workgroup_processor_mode", 1)),
            kernarg_bytes=meta.get(".kernarg_segment_size", 0),
            hidden_args=tuple(kind for arg in meta.get(".args", ())
                              if str(kind := arg.get(".value_kind", "")).startswith("hidden_")),
        )
    except KeyError as missing:
        raise CodeObjectError(f"kernel metadata lacks {missing}") from None


# --- MessagePack (https://github.com/msgpack/msgpack/blob/master/spec.md) -----------------------
# Only what AMDGPU metadata uses: nil, bool, ints, floats, str, bin, array, map. No extension types.

_FIXED_WIDTH = {  # type byte -> struct format of the value that follows
    0xCA: ">f", 0xCB: ">d",
    0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
    0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
}
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}
_LENGTH_PREFIXED = {  # type byte -> (kind, struct format of the length)
    0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
    0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
    0xDC: ("array", ">H"), 0xDD: ("array", ">I"),
    0xDE: ("map", ">H"), 0xDF: ("map", ">I"),
}


def unpack_msgpack(data: bytes) -> Any:
    """Decode one MessagePack value that spans all of `data`."""
    try:
        value, end = _unpack(memoryview(data), 0)
    except (IndexError, struct.error):
        raise CodeObjectError("truncated MessagePack data") from None
    if end != len(data):
        raise CodeObjectError(f"{len(data) - end} bytes after the MessagePack value")
    return value


def _unpack(buf: memoryview, pos: int) -> tuple[Any, int]:
    tag = buf[pos]
    pos += 1
    if tag <= 0x7F:
        return tag, pos
    if tag >= 0xE0:
        return tag - 0x100, pos
    if tag <= 0x8F:
        return _unpack_map(buf, pos, tag & 0x0F)
    if tag <= 0x9F:
        return _unpack_array(buf, pos, tag & 0x0F)
    if tag <= 0xBF:
        return _unpack_str(buf, pos, tag & 0x1F)
    if tag in _CONSTANTS:
        return _CONSTANTS[tag], pos
    if tag in _FIXED_WIDTH:
        fmt = _FIXED_WIDTH[tag]
        (value,) = struct.unpack_from(fmt, buf, pos)
        return value, pos + struct.calcsize(fmt)
    if tag in _LENGTH_PREFIXED:
        kind, fmt = _LENGTH_PREFIXED[tag]
        (length,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        if kind == "str":
            return _unpack_str(buf, pos, length)
        if kind == "bin":
            return _take(buf, pos, length), pos + length
        if kind == "array":
            return _unpack_array(buf, pos, length)
        return _unpack_map(buf, pos, length)
    raise CodeObjectError(f"unsupported MessagePack type byte 0x{tag:02x}")


def _take(buf: memoryview, pos: int, length: int) -> bytes:
    if pos + length > len(buf):
        raise IndexError
    return bytes(buf[pos : pos + length])


def _unpack_str(buf: memoryview, pos: int, length: int) -> tuple[str, int]:
    return _take(buf, pos, length).decode("utf-8"), pos + length


def _unpack_array(buf: memoryview, pos: int, count: int) -> tuple[list, int]:
    items = []
    for _ in range(count):
        item, pos = _unpack(buf, pos)
        items.append(item)
    return items, pos


def _unpack_map(buf: memoryview, pos: int, count: int) -> tuple[dict, int]:
    result = {}
    for _ in range(count):
        key, pos = _unpack(buf, pos)
        result[key], pos = _unpack(buf, pos)
    return result, pos
