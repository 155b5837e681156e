"""Machine code to instructions, with tinygrad's tables of AMD's encodings (a pinned dependency).

The whole kernel is decoded once, linearly from its entry: the compiler emits no data in .text
between a kernel's first instruction and its s_code_end padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InterpreterError, require_decoder

_CODE_END = "s_code_end"


@dataclass
class Decoded:
    offset: int  # bytes from the kernel's entry
    size: int
    name: str  # lower-case mnemonic as the ISA spells it (v_add_f32_e32, v_dual_mul_f32::v_dual_add_f32)
    encoding: str  # tinygrad's format class: VOP2, VOP3_SDST_LIT, SMEM, ...
    inst: Any  # the tinygrad instruction object (field access by name)

    @property
    def literal(self) -> int | None:
        return getattr(self.inst, "literal", None)


def instruction_name(inst) -> str:
    if hasattr(inst, "opx"):
        return f"{inst.opx.name.lower()}::{inst.opy.name.lower()}"
    return inst.op.name.lower()


def _decode_buffer(chunk: bytes, arch: str):
    """MUBUF instructions (buffer_gl0_inv, buffer_gl1_inv: cache control the compiler emits around
    barriers), which tinygrad's format detection leaves out for RDNA3."""
    if arch != "rdna3":
        return None
    from tinygrad.runtime.autogen.amd.rdna3 import ins

    word = int.from_bytes(chunk[:4], "little")
    if word >> 26 != 0b111000 or len(chunk) < 8:
        return None
    try:
        return ins.MUBUF.from_bytes(chunk)
    except ValueError:
        return None


def decode_kernel(code: bytes, arch: str, kernel: str) -> dict[int, Decoded]:
    """Every instruction of a kernel by its offset from the entry."""
    decode_inst = require_decoder()
    instructions: dict[int, Decoded] = {}
    offset = 0
    while offset < len(code):
        chunk = code[offset : offset + 16]
        try:
            inst = decode_inst(chunk, arch)
        except (ValueError, AssertionError) as error:
            inst = _decode_buffer(chunk, arch)
            if inst is None:
                raise InterpreterError(f"cannot decode {chunk[:8].hex()}: {error}", kernel, offset) from None
        decoded = Decoded(offset, inst.size(), instruction_name(inst), type(inst).__name__, inst)
        instructions[offset] = decoded
        if decoded.name == _CODE_END:
            break
        offset += decoded.size
    return instructions
