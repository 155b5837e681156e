"""A CPU interpreter of the RDNA3 (gfx11) and RDNA4 (gfx12) instruction sets that runs the shipped
code objects themselves, so the exact bytes users get are executed and checked without AMD hardware.

    from rdna_fa_lab.interpreter import InterpretedLibrary
    from rdna_flash_attn.ops import attention
    from rdna_flash_attn.runtime import loader

    library = InterpretedLibrary.for_target("gfx1100")
    with loader.explicit_library(library):
        out, lse = attention.flash_attention_forward(q, k, v)   # CPU tensors

Modules: program (kernel code and descriptor from the ELF), decode (tinygrad's encodings), wave
(register state, operand access), scalar / vector / valu_ops / matrix / memory (instruction
semantics by family), waits (memory operations in flight and the waits that retire them),
executor (per-instruction closures, the wave loop), dispatch (kernarg segment, initial state,
workgroups and barriers), trace (instruction counts), library (the KernelLibrary launch
interface). Needs numpy, and tinygrad==0.14.0 for decoding (rdna_fa_lab/requirements.txt).

What it checks on every launch: each global/flat access lies inside one of the launch's tensors,
each SMEM load inside the kernarg segment (or a tensor), each LDS access inside the allocation a real
launch gets (the descriptor's static size), no two waves touch the same LDS byte between barriers
unless both only read it, the argument block has exactly the size of the kernel's explicit
arguments, gfx11 WMMA operands agree between the half-waves, no register a load (global, flat,
LDS or scalar) has yet to write is read or overwritten before the s_waitcnt / s_wait_*cnt that
retires the load (the counters modelled as LLVM's SIInsertWaitcnts assumes them: waits.py), and
every executed instruction is implemented (an unknown one is an error naming it). Registers and
LDS start as NaN patterns.

Where it is not the hardware: memory accesses are performed at issue, in program order (the wait
check poisons the destinations until the wait instead), s_delay_alu is a no-op (the hardware
interlocks ALU dependencies; it is a scheduling hint); v_exp_f32, v_log_f32, v_rcp_f32 and the
other transcendentals are correctly rounded (the hardware is within about 1 ulp); WMMA sums its 16
exact products in f64 and rounds once to f32 (the hardware's order is undocumented); v_dot2*_f32
adds its two exact products to the f32 accumulator one at a time, each add rounded (the order of
AMD's pseudocode; the hardware may round once). Everything
else (f32 arithmetic, fused multiply-adds, f16/bf16 conversions) rounds to nearest even exactly as
the descriptor's float mode says; a descriptor asking for another mode is refused.
"""

from .errors import InterpreterError, MissingDecoder
from .library import InterpretedLibrary

__all__ = ["InterpretedLibrary", "InterpreterError", "MissingDecoder"]
