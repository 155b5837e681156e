"""A CPU interpreter of the RDNA3 (gfx11) and RDNA4 (gfx12) instruction sets that runs the shipped
code objects themselves, so the exact bytes users get are executed and checked without AMD hardware.

    from rdna_flash_attn import ops, runtime
    from rdna_flash_attn.interpreter import InterpretedLibrary

    library = InterpretedLibrary.for_target("gfx1100")
    with runtime.explicit_library(library):
        out, lse = ops.flash_attention_forward(q, k, v)   # CPU tensors

Modules: program (kernel code and descriptor from the ELF), decode (tinygrad's encodings), wave
(register state, operand access), scalar / vector / valu_ops / matrix / memory (instruction
semantics by family), executor (per-instruction closures, the wave loop), dispatch (kernarg
segment, initial state, workgroups and barriers), trace (instruction counts), library (the
KernelLibrary launch interface). Needs tinygrad==0.14.0 for decoding (the `interpret` extra).
"""

from .errors import InterpreterError, MissingDecoder
from .library import InterpretedLibrary

__all__ = ["InterpretedLibrary", "InterpreterError", "MissingDecoder"]
