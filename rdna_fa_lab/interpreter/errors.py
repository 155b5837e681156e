"""The one error type of the interpreter: what went wrong, in which kernel, at which instruction."""

from __future__ import annotations


class InterpreterError(RuntimeError):
    """The kernel did something the interpreter refuses: an unknown instruction, an access outside
    the launch's buffers or LDS, a broken operand rule. The message names kernel and pc."""

    def __init__(self, message: str, kernel: str | None = None, pc: int | None = None, instruction: str | None = None):
        where = []
        if kernel is not None:
            where.append(kernel)
        if pc is not None:
            where.append(f"pc 0x{pc:x}")
        if instruction is not None:
            where.append(instruction)
        super().__init__(f"{' '.join(where)}: {message}" if where else message)
        self.kernel, self.pc, self.instruction = kernel, pc, instruction


class MissingDecoder(ImportError):
    """tinygrad (the pinned decoder of AMD's instruction encodings) is not installed."""


def require_decoder():
    try:
        from tinygrad.renderer.amd import decode_inst
    except ImportError:
        raise MissingDecoder(
            "the ISA interpreter decodes with tinygrad's AMD instruction tables: pip install tinygrad==0.14.0 "
            "(rdna_fa_lab/requirements.txt)") from None
    return decode_inst
