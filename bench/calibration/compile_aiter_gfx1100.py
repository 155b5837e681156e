"""Compile aiter's Triton FA forward kernel `attn_fwd` (commit 569d6afd, PR #2397)
for gfx1100 (wave32) without a GPU, producing a .hsaco code object: the gfx1100 case of the
estimator's calibration (bench/results/estimator_calibration.md). aiter's sources are not part of this
repository: PKG must hold a package `aiterfa` with unchanged copies of fwd_prefill.py, common.py and
utils.py from aiter/ops/triton/_triton_kernels/flash_attn_triton_amd/ at that commit (and an empty
__init__.py).

Run (Triton 3.9.0 from pip; no GPU needed):
    python3 -m bench.calibration.compile_aiter_gfx1100 PKG [OUT]     # OUT: build/calibration

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

import torch  # noqa: E402  (CPU torch, only for dtypes)
import triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from bench.calibration.triton_offline import GFX1100, FakeTensor, compile_kernel, import_external  # noqa: E402

fwd_prefill = import_external(PKG, "aiterfa.fwd_prefill")

# ---------------------------------------------------------------- problem shape
B, S, H, D = 2, 8192, 16, 128
DTYPE = torch.float16


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
    compile_kernel(fn, args, kwargs, GFX1100, os.path.join(OUT, "attn_fwd_gfx1100"))
    print("grid:", (B, H, triton.cdiv(S, cfg.kwargs["BLOCK_M"])))
    print("triton", triton.__version__)


if __name__ == "__main__":
    main()
