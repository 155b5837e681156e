#!/usr/bin/env python3
"""Compile aiter's Triton FA forward kernel `attn_fwd` (commit 569d6afd, PR #2397)
for gfx1100 (wave32) without a GPU, producing a .hsaco code object: the gfx1100 case of the
estimator's calibration (bench/results/estimator_calibration.md). aiter's sources are not part of this
repository: PKG must hold a package `aiterfa` with unchanged copies of fwd_prefill.py, common.py and
utils.py from aiter/ops/triton/_triton_kernels/flash_attn_triton_amd/ at that commit (and an empty
__init__.py).

Run (Triton 3.9.0 from pip; no GPU needed):
    python3 bench/calibration/compile_aiter_gfx1100.py PKG [OUT]     # OUT: build/calibration

Approach: the argument list is bound exactly as `attention_forward_prefill_triton_impl`
binds it (same positional/keyword split, same values for B=2, S=8192, H=16, D=128,
fp16, bshd, non-causal, no dropout), and Triton's own JIT binder (specialize_impl for
the HIP backend) turns those values into signature / constexprs / attrs, just as
`attn_fwd[grid](...)` would on a real gfx1100 device. Tensors are replaced by mock
objects carrying dtype, a 16-byte aligned data_ptr and the storage size (for the
HIP buffer-op `tt.pointer_range` 32 specialization). Then triton.compile() is
called with GPUTarget("hip", "gfx1100", 32).
"""
import json
import os
import sys

if len(sys.argv) not in (2, 3):
    sys.exit(__doc__)
PKG = os.path.abspath(sys.argv[1])
OUT = os.path.abspath(sys.argv[2] if len(sys.argv) == 3 else os.path.join("build", "calibration"))

# The module computes its config list at import time via get_arch(), which needs a
# GPU driver. Instead we use aiter's documented override env var with the exact
# gfx1100 config from PR #2397 (the `arch.is_rdna` branch with BLOCK_N=64).
GFX1100_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "PRE_LOAD_V": False,
                  "waves_per_eu": 6, "num_stages": 1, "num_warps": 8}
os.environ["FLASH_ATTENTION_FWD_TRITON_AMD_CONFIG_JSON"] = json.dumps(GFX1100_CONFIG)
os.environ.pop("FLASH_ATTENTION_TRITON_AMD_AUTOTUNE", None)
# Triton 3.9 default (FP fusion on, as in earlier Triton releases); set explicitly to
# silence the 3.9 deprecation warning. An empty/0 value would change the code.
os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
os.environ.pop("TRITON_FORCE_DISABLE_FP_FUSION", None)
sys.path.insert(0, PKG)

import torch  # noqa: E402  (CPU torch, only for dtypes)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402
from triton import knobs  # noqa: E402

from aiterfa import fwd_prefill  # noqa: E402

# ---------------------------------------------------------------- problem shape
B, S, H, D = 2, 8192, 16, 128
DTYPE = torch.float16
TARGET = GPUTarget("hip", "gfx1100", 32)


class FakeTensor:
    """Stand-in for a torch CUDA tensor for Triton's specialization only."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype
        st, acc = [], 1
        for s in reversed(self.shape):
            st.append(acc)
            acc *= s
        self._stride = tuple(reversed(st))
        self._nbytes = acc * torch.empty((), dtype=dtype).element_size()

    def stride(self, i=None):
        return self._stride if i is None else self._stride[i]

    def data_ptr(self):
        return 0x7F0000000000  # torch allocations are >=256-byte aligned

    def ptr_range(self):
        return self._nbytes  # HIPBackend.is_within_2gb -> <= 2**31-1


def main():
    kernel = fwd_prefill.attn_fwd
    assert isinstance(kernel, Autotuner), type(kernel)
    fn = kernel.fn  # underlying JITFunction
    cfgs = kernel.configs
    assert len(cfgs) == 1
    cfg = cfgs[0]
    # sanity: same as the PR #2397 gfx1100 branch
    assert cfg.kwargs == {"BLOCK_M": 128, "BLOCK_N": 64, "PRE_LOAD_V": False, "waves_per_eu": 6}, cfg.kwargs
    assert (cfg.num_warps, cfg.num_stages) == (8, 1)

    # ------------------------------------------------ what the launcher computes
    q = FakeTensor((B, S, H, D), DTYPE)
    k = FakeTensor((B, S, H, D), DTYPE)
    v = FakeTensor((B, S, H, D), DTYPE)
    o = FakeTensor((B, S, H, D), DTYPE)
    softmax_lse = FakeTensor((B, H, S), torch.float32)
    # flash_attn computes softmax_scale = q.shape[-1] ** (-0.5) (0.08838834764831845;
    # 1/math.sqrt(128) would differ in the last bit)
    sm_scale = D ** (-0.5)
    causal = False
    window_size_left = window_size_right = -1
    dropout_p = 0.0
    philox_seed, philox_offset = 0x1BF58, 0x1D4B49  # utils.PHILOX_SEED / PHILOX_OFFSET
    use_exp2 = True  # utils.USE_EXP2
    return_scores = False
    bias = alibi_slopes = sd_mask = None
    cu_seqlens_q = cu_seqlens_k = seqused_q = seqused_k = None
    # non-fp8 branch
    FP8_MAX = None
    q_descale = k_descale = v_descale = None
    stride_q_descale_z = stride_k_descale_z = stride_v_descale_z = None
    IS_FP8 = False
    # bshd strides: (batch, head, seq, dim)
    sq = (q.stride(0), q.stride(2), q.stride(1), q.stride(3))
    sk = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
    sv = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
    so = (o.stride(0), o.stride(2), o.stride(1), o.stride(3))
    stride_lse = softmax_lse.stride()
    stride_b = (0, 0, 0, 0)
    stride_a = (0, 0)
    stride_s = (0, 0, 0, 0)
    padded_d = max(1 << (D - 1).bit_length(), 16)
    force_masking = True  # arch.is_rdna for gfx1100

    args = (q, k, v, bias, q_descale, k_descale, v_descale,
            stride_q_descale_z, stride_k_descale_z, stride_v_descale_z,
            softmax_lse, o, sd_mask, alibi_slopes,
            *sq, *sk, *sv, *so, *stride_b, *stride_a, *stride_s, *stride_lse,
            cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    kwargs = dict(
        dropout_p=dropout_p, philox_seed=philox_seed, philox_offset_base=philox_offset,
        HQ=H, HK=H, ACTUAL_BLOCK_DMODEL_QK=D, ACTUAL_BLOCK_DMODEL_V=D,
        MAX_SEQLENS_Q=S, MAX_SEQLENS_K=S, SM_SCALE=sm_scale, IS_CAUSAL=causal,
        USE_SLIDING_WINDOW=False, WINDOW_SIZE_LEFT=window_size_left,
        WINDOW_SIZE_RIGHT=window_size_right, IS_VARLEN=False,
        BLOCK_DMODEL_QK=padded_d, BLOCK_DMODEL_V=padded_d,
        USE_BIAS=False, USE_ALIBI=False, ENABLE_DROPOUT=dropout_p > 0.0,
        USE_EXP2=use_exp2, RETURN_SCORES=return_scores, IS_FP8=IS_FP8,
        FP8_MAX=FP8_MAX, FP8_P_DESCALE=False, USE_SEQUSED=False,
        FORCE_MASKING=force_masking,
    )
    # Autotuner.run merges config.all_kwargs() into kwargs
    kwargs.update(cfg.all_kwargs())
    # JITFunction.run adds these
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts

    # --------------------------- Triton's own binder/specialization for HIP target
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, None)

    print("signature (non-constexpr):")
    for name, ty in signature.items():
        if ty != "constexpr":
            print(f"  {name}: {ty}")
    print("constexprs:")
    for path, val in constexprs.items():
        print(f"  {fn.arg_names[path[0]]} = {val!r}")
    print("attrs:")
    for path, val in attrs.items():
        if val:
            print(f"  {fn.arg_names[path[0]]}: {val}")
    print("options:", {kk: getattr(options, kk) for kk in ("arch", "num_warps", "num_stages", "waves_per_eu", "num_ctas")})

    src = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton_compile(src, target=TARGET, options=options.__dict__)

    os.makedirs(OUT, exist_ok=True)
    hsaco = os.path.join(OUT, "attn_fwd_gfx1100.hsaco")
    with open(hsaco, "wb") as f:
        f.write(compiled.asm["hsaco"])
    for ext in ("ttir", "ttgir", "llir", "amdgcn"):
        if ext in compiled.asm:
            with open(os.path.join(OUT, f"attn_fwd_gfx1100.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
    md = compiled.metadata
    grid = (B, H, triton.cdiv(S, cfg.kwargs["BLOCK_M"]))
    print("wrote", hsaco, len(compiled.asm["hsaco"]), "bytes")
    print("kernel name:", md.name)
    print("shared (LDS bytes):", md.shared, " num_warps:", md.num_warps,
          " threads/WG:", md.num_warps * TARGET.warp_size, " grid:", grid)
    print("triton", triton.__version__)


if __name__ == "__main__":
    main()
