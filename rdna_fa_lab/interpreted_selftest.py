"""`python -m rdna_fa_lab selftest`: the kernels' first-use self-test on a shipped code object, run on
the CPU by the ISA interpreter, instruction by instruction: no GPU needed."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from rdna_flash_attn.dispatch import selftest
from rdna_flash_attn.runtime import artifacts, loader
from . import interpreted

# The CPU interpreter's case: small, ragged, causal off-square, one tile of each kind, in both
# dtypes; it takes seconds, not the minutes the GPU self-test's whole case list would.
INTERPRET_CASE = (1, 2, 64, 77, 64, True)
INTERPRETER_DURATION = "10 s to a minute, depending on the CPU"


def _say(line: str) -> None:
    print(line, flush=True)


def run_interpreted(target: str, say: Callable[[str], None] | None = _say) -> tuple[list[selftest.Check], float, str]:
    """The self-test's forward and backward checks of INTERPRET_CASE run by the CPU interpreter on the
    code object shipped for `target` (code object v5), what it runs and each launch announced through
    `say` (None: silent): (checks, seconds, code object path). Raises ImportError without numpy,
    MissingDecoder without tinygrad, artifacts.ArtifactError without a code object."""
    batch, heads, seq_q, seq_k, dim, causal = INTERPRET_CASE
    library = interpreted.interpreted_library(target, say)
    if say is not None:
        say(f"{target}: the self-test's case (b{batch} h{heads} q{seq_q} k{seq_k} d{dim}{' causal' if causal else ''}, "
            f"float16 and bfloat16) through the shipped code object on the CPU interpreter: {INTERPRETER_DURATION}")
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    checks = []
    with loader.explicit_library(library):
        for dtype in selftest.DTYPES:
            if say is not None:
                say(f"  {str(dtype).removeprefix('torch.')}: forward and backward ...")
            checks += selftest.case_checks(torch.device("cpu"), dtype, INTERPRET_CASE, generator,
                                           selftest.direct_gradients)
    return checks, time.perf_counter() - start, str(library.artifact.path)


def run_interpreted_selftest(target: str) -> int:
    """The shipped code object for `target`, run on the CPU by the ISA interpreter; 0 passed,
    1 failed, 2 nothing tested (no numpy, no decoder or no code object)."""
    try:
        from .interpreter import InterpreterError, MissingDecoder  # needs numpy: see interpreted.interpreted_library
    except ImportError as error:
        print(f"cannot interpret the {target} code object: {error}; {interpreted.INTERPRETER_REQUIREMENTS}")
        return 2
    try:
        checks, seconds, path = run_interpreted(target)
    except (MissingDecoder, artifacts.ArtifactError) as error:
        print(f"cannot interpret the {target} code object: {error}")
        return 2
    except InterpreterError as error:  # the kernel did something the interpreter refuses (names kernel and pc)
        print(f"{target} code object FAILED under the interpreter: {error}")
        return 1
    for check in checks:
        mark = "ok  " if check.passed else "FAIL"
        print(f"  {mark} {check.name}: error {check.error:.3g} (tolerance {check.tolerance:.3g})")
    passed = all(check.passed for check in checks)
    print(f"{target} code object {path}, interpreted on the CPU in {seconds:.1f} s: {'passed' if passed else 'FAILED'}")
    return 0 if passed else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="gfx1100",
                        help=f"the GPU target whose shipped code object runs (default %(default)s; "
                             f"{INTERPRETER_DURATION}; needs {interpreted.INTERPRETER_REQUIREMENTS})")


def run(args: argparse.Namespace) -> int:
    return run_interpreted_selftest(args.target)
