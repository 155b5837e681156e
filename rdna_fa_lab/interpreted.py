"""The shipped code objects run on the CPU by the lab's interpreter of the RDNA ISA
(rdna_fa_lab.interpreter), for the lab's CLI: `bench` without an RDNA GPU runs a real Stable Diffusion
attention call through them and compares it with PyTorch's SDPA against float64 (run_call);
`selftest` runs the self-test's checks. A launch takes the interpreter seconds, so each one prints a
line as it goes (Announced).

The interpreter executes the kernels instruction by instruction: it shows what the code objects
compute, never how fast a GPU runs them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rdna_flash_attn.ops import attention
from rdna_flash_attn.runtime import artifacts, loader

INTERPRETER_REQUIREMENTS = "pip install numpy tinygrad==0.14.0 (rdna_fa_lab/requirements.txt)"
TARGET_GPUS = {"gfx1100": "RX 7900 XTX", "gfx1201": "RX 9070 XT"}  # the targets `bench` interprets by default
FA2_ABSOLUTE_FLOOR = 1e-5  # flash-attn's tests: dq error <= 2 x the reference's + 1e-5


@dataclass(frozen=True)
class Call:
    """One attention call: (batch, heads, tokens, head dim) self-attention in `dtype`."""

    name: str
    batch: int
    heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.batch, self.heads, self.tokens, self.head_dim


# SD2.x at 512 px, its UNet's deepest level: 20 heads x 64 over a 16 x 16 latent (256 tokens), head dim 64 as
# in SDXL and SD3. One of its 2 x 20 (CFG batch x heads) heads: every head runs the same kernel code, and the
# interpreter takes about 2 s for this forward and 5 s for its backward per target on one core.
SD_CALL = Call("SD2.x 512 px UNet, deepest self-attention (one of its 2 x 20 heads)", 1, 1, 256, 64)


class Announced:
    """A kernel library whose launches each print a line (kernel, workgroups, seconds) through `say`:
    the interpreter takes seconds per launch. Everything else is the wrapped library's."""

    def __init__(self, library, say: Callable[[str], None]):
        self._library = library
        self._say = say

    def __getattr__(self, name: str):
        return getattr(self._library, name)

    def _announced(self, variant, grid, run: Callable[[], None]) -> None:
        workgroups = grid[0] * grid[1] * grid[2]
        start = time.perf_counter()
        self._say(f"    {variant.symbol}: {workgroups} workgroup{'s' * (workgroups != 1)} of "
                  f"{variant.threads} threads ...")
        run()
        self._say(f"    {variant.symbol}: done in {time.perf_counter() - start:.1f} s")

    def launcher(self, variant, grid: tuple[int, int, int], device: torch.device):
        run = self._library.launcher(variant, grid, device)
        return lambda args, buffers: self._announced(variant, grid, lambda: run(args, buffers))

    def launch(self, variant, grid: tuple[int, int, int], args, buffers) -> None:
        self._announced(variant, grid, lambda: self._library.launch(variant, grid, args, buffers))


def interpreted_library(target: str, say: Callable[[str], None] | None = None):
    """The shipped code object of `target` (code object v5, sha256-verified) on the interpreter, its
    launches announced through `say` when given. Raises ImportError without numpy, the interpreter's
    MissingDecoder without tinygrad, artifacts.ArtifactError without the code object."""
    # Here, not at the top: the interpreter needs numpy and tinygrad, which the expected speed does without.
    from .interpreter import InterpretedLibrary

    library = InterpretedLibrary.for_target(target)
    return library if say is None else Announced(library, say)


# --- references -------------------------------------------------------------------------------------


def _attention(q, k, v, dtype: torch.dtype) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with every operation in `dtype`: float64, the reference; the inputs'
    dtype, flash-attn's `attention_ref(upcast=False)`, the yardstick of FlashAttention-2's backward
    criterion (DESIGN.md 2.4)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    scores = q @ (k * (1 / math.sqrt(q.shape[-1]))).transpose(-1, -2)
    return torch.softmax(scores, dim=-1).to(dtype) @ v


def _grads(fn, q, k, v, dout) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


def _sdpa_math(q, k, v) -> torch.Tensor:
    nn_attention = getattr(torch.nn, "attention", None)
    if nn_attention is not None and hasattr(nn_attention, "sdpa_kernel"):  # torch >= 2.3
        with nn_attention.sdpa_kernel(nn_attention.SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --- the call -------------------------------------------------------------------------------------------


def run_call(target: str, call: Call = SD_CALL, say: Callable[[str], None] = print, seed: int = 0) -> dict:
    """`call`'s forward (as training runs it: it also saves the backward's statistics) and backward
    through the shipped code object of `target` on the interpreter, against float64, beside PyTorch's
    math SDPA in the same dtype. Raises what interpreted_library raises, and the interpreter's errors.

    Returns {"target", "code_object", "sha256", "seconds": {"forward", "backward"}, "checks": [...]}, each
    check {"pass", "tensor", "ours", "sdpa_math", "bound", "rule", "passed"}: the forward by DESIGN.md's
    rule (at most 2x math SDPA's max error against float64), each gradient by FlashAttention-2's (at most
    2x that of the same attention computed in the inputs' dtype, plus 1e-5)."""
    library = interpreted_library(target, say)
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(call.shape, generator=generator).to(call.dtype) for _ in range(4))
    seconds = {}
    with loader.explicit_library(library), torch.no_grad():
        say(f"  {target}: forward ...")
        start = time.perf_counter()
        saved = attention.backward_stats_like(q)
        out, lse = attention.flash_attention_forward(q, k, v, False, None, saved=saved)
        seconds["forward"] = time.perf_counter() - start
        say(f"  {target}: backward ...")
        start = time.perf_counter()
        grads = attention.flash_attention_backward(dout, q, k, v, lse, False, None, out=out, saved=saved)
        seconds["backward"] = time.perf_counter() - start
    reference = _grads(lambda *t: _attention(*t, torch.float64), q, k, v, dout)
    sdpa = _grads(_sdpa_math, q, k, v, dout)
    same_dtype = _grads(lambda *t: _attention(*t, call.dtype), q, k, v, dout)
    checks = []
    for index, (name, ours) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
        error, sdpa_error = _max_error(ours, reference[index]), _max_error(sdpa[index], reference[index])
        if name == "out":
            bound, rule = 2 * sdpa_error, "2x math SDPA's error"
        else:
            bound = 2 * _max_error(same_dtype[index], reference[index]) + FA2_ABSOLUTE_FLOOR
            rule = f"FlashAttention-2's: 2x the error of the same attention computed in " \
                   f"{str(call.dtype).removeprefix('torch.')}, + 1e-5"
        checks.append({"pass": "forward" if name == "out" else "backward", "tensor": name, "ours": error,
                       "sdpa_math": sdpa_error, "bound": bound, "rule": rule,
                       "passed": bool(error <= bound)})  # False for NaN too
    artifact = library.artifact
    return {"target": target, "gpu": TARGET_GPUS.get(target), "code_object": artifact.path.name,
            "sha256": artifact.sha256, "seconds": {key: round(value, 2) for key, value in seconds.items()},
            "checks": checks}


def shipped_sha256(target: str) -> str | None:
    """The sha256 the manifest gives the shipped code object (v5) of `target`, or None without one."""
    try:
        return artifacts.prebuilt_artifact(target).sha256
    except artifacts.ArtifactError:
        return None
