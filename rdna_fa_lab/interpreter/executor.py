"""A kernel compiled for the interpreter: each instruction decoded once into a closure over the
wave state, and the loop that runs one wave until it ends or reaches a barrier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .decode import Decoded, decode_kernel
from .errors import InterpreterError
from .matrix import compile_matrix
from .memory import AddressSpace, LocalDataShare, compile_memory
from .program import KernelProgram
from .scalar import compile_scalar
from .vector import compile_vector
from .waits import VECTOR_LOAD, check_hazard, compile_wait, counter_model, memory_operation, operand_masks, with_issue
from .wave import Wave

_COMPILERS = (compile_wait, compile_scalar, compile_memory, compile_matrix, compile_vector)


class LaunchContext:
    """What the instructions of a kernel reach during one workgroup: set before each runs."""

    def __init__(self, program: KernelProgram):
        self.kernel = program.name
        self.arch = program.arch
        self.global_memory: AddressSpace | None = None
        self.scalar_memory: AddressSpace | None = None
        self.lds: LocalDataShare | None = None

    def where(self, d: Decoded) -> Callable[[str], InterpreterError]:
        return lambda message: InterpreterError(message, self.kernel, d.offset, d.name)


@dataclass
class Step:
    run: Callable[[Wave], int | None]
    next_offset: int
    decoded: Decoded
    reads: int = 0  # registers read and written, as waits.py's bit masks
    writes: int = 0
    touches: int = 0  # reads | writes
    in_order_load: bool = False  # gfx11 global load: may overwrite another's destination in flight


def _unsupported(d: Decoded, ctx: LaunchContext, reason: str):
    def run(wave: Wave):
        raise InterpreterError(reason, ctx.kernel, d.offset, d.name)
    return run


class CompiledKernel:
    def __init__(self, program: KernelProgram):
        self.program = program
        self.context = LaunchContext(program)
        self.instructions = decode_kernel(program.code, program.arch, program.name)
        self.steps: dict[int, Step] = {}
        self.unsupported: list[Decoded] = []
        loads_in_order = counter_model(program.arch).loads_write_in_order
        for offset, d in self.instructions.items():
            reads, writes = operand_masks(d, program.arch)
            run = with_issue(self._compile(d), d, self.context, writes)
            operation = memory_operation(d, program.arch)
            # LLVM lets a global load overwrite another's destination in flight, not a flat load (LDS, maybe).
            in_order_load = (loads_in_order and operation is not None and operation[1] == VECTOR_LOAD
                             and d.encoding.split("_LIT")[0] in ("GLOBAL", "VGLOBAL", "MUBUF"))
            self.steps[offset] = Step(run, offset + d.size, d, reads, writes, reads | writes, in_order_load)

    def _compile(self, d: Decoded):
        for compile_instruction in _COMPILERS:
            try:
                run = compile_instruction(d, self.context)
            except InterpreterError as error:
                self.unsupported.append(d)
                return _unsupported(d, self.context, str(error).split(": ", 1)[-1])
            if run is not None:
                return run
        self.unsupported.append(d)
        return _unsupported(d, self.context, f"instruction {d.name} ({d.encoding}) is not implemented by the interpreter")

    def run_wave(self, wave: Wave, hits: dict[int, int]) -> None:
        """Runs until the wave ends or stops at a barrier; counts executed instructions by offset."""
        steps = self.steps
        pc = wave.pc
        with np.errstate(all="ignore"):
            while True:
                step = steps.get(pc)
                if step is None:
                    raise InterpreterError(f"jump to 0x{pc:x}, outside the kernel's {len(self.program.code)} bytes",
                                           self.program.name, pc)
                hits[pc] = hits.get(pc, 0) + 1
                if wave.poison & step.touches:
                    check_hazard(wave, step, self.context)
                target = step.run(wave)
                pc = step.next_offset if target is None else target
                if wave.ended:
                    return
                if wave.at_barrier:
                    wave.pc = pc
                    return
