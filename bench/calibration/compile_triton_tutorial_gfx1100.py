"""Compile the backward kernel `_attn_bwd` of Triton's fused-attention tutorial
(triton-lang/triton, python/tutorials/06-fused-attention.py) for gfx1100 (wave32) without a GPU,
producing a .hsaco code object: the held-out backward case of the estimator's calibration
(bench/results/estimator_calibration.md). The tutorial is not part of this repository: SRC must be a
folder holding `fused_attention_bwd.py`, an unchanged copy of the four backward functions of the
tutorial (`_attn_bwd_preprocess`, `_attn_bwd_dkdv`, `_attn_bwd_dq`, `_attn_bwd`) from the stored
version at commit 003da478d84f5bb0f51b3988cf0ea0bbe60282b7, with `import triton` and
`import triton.language as tl` above them (nothing else of the file is needed).

Run (Triton 3.9.0 from pip; no GPU needed):
    python3 -m bench.calibration.compile_triton_tutorial_gfx1100 SRC [OUT]     # OUT: build/calibration
    python3 -m bench.calibration.compile_triton_tutorial_gfx1100 SRC [OUT] --num-stages 1

The first writes OUT/attn_bwd_tutorial_gfx1100.hsaco (the tutorial's num_stages 5); the second
OUT/attn_bwd_tutorial_stages1_gfx1100.hsaco, a sensitivity variant (not the tutorial's config): Triton
3.9's AMD stream pipeliner turns num_stages 5 into multi-buffered loops that spill to scratch on
gfx1100, and the Triton of the measurement (May 2024) may not have pipelined this way.

The launch is bound as the tutorial's `_attention.backward` binds it, at the measured shape
(B=4, H=48, N_CTX=16384, HEAD_DIM=64, fp16: the tutorial's default BATCH/N_HEADS/HEAD_DIM of that time
and its largest N_CTX): q/k/v/do/dq/dk/dv fp16 (B, H, N, D) contiguous, M and delta fp32 (B, H, N),
strides of q, H, N_CTX; the tutorial's backward config, which has no HIP branch:
BLOCK_M1 32, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 32, BLK_SLICE_FACTOR 2, num_warps 4, num_stages 5
(no waves_per_eu); grid (N_CTX / BLOCK_N1, 1, B*H). Triton's own binder for the HIP backend turns
those values into signature / constexprs / attrs (as `_attn_bwd[grid](...)` would on a gfx1100
device); tensors are mock objects with dtype, a 16-byte aligned data_ptr and their storage size.
Then triton.compile() with GPUTarget("hip", "gfx1100", 32).
"""
import os
import sys

ARGV = sys.argv[1:]
NUM_STAGES = 5  # _attention.backward of the tutorial
if "--num-stages" in ARGV:
    i = ARGV.index("--num-stages")
    NUM_STAGES = int(ARGV[i + 1])
    del ARGV[i:i + 2]
if len(ARGV) not in (1, 2):
    sys.exit(__doc__)
SRC = os.path.abspath(ARGV[0])
OUT = os.path.abspath(ARGV[1] if len(ARGV) == 2 else os.path.join("build", "calibration"))

import torch  # noqa: E402  (CPU torch, only for dtypes)
import triton  # noqa: E402

from bench.calibration.triton_offline import GFX1100, FakeTensor, compile_kernel, import_external  # noqa: E402

tutorial = import_external(SRC, "fused_attention_bwd")

B, H, N_CTX, HEAD_DIM = 4, 48, 16384, 64
# _attention.backward of the tutorial
CONFIG = dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, BLK_SLICE_FACTOR=2)
NUM_WARPS = 4
SM_SCALE = 1.3  # the tutorial's benchmark


def main():
    f16, f32 = torch.float16, torch.float32
    q, k, v, do, dq, dk, dv = (FakeTensor((B, H, N_CTX, HEAD_DIM), f16) for _ in range(7))
    m, delta = FakeTensor((B, H, N_CTX), f32), FakeTensor((B, H, N_CTX), f32)
    assert N_CTX % CONFIG["BLOCK_N1"] == 0 and N_CTX % 128 == 0
    args = (q, k, v, SM_SCALE, do, dq, dk, dv, m, delta,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), H, N_CTX)
    name = "attn_bwd_tutorial" if NUM_STAGES == 5 else f"attn_bwd_tutorial_stages{NUM_STAGES}"
    compile_kernel(tutorial._attn_bwd, args, dict(CONFIG, HEAD_DIM=HEAD_DIM, num_warps=NUM_WARPS, num_stages=NUM_STAGES),
                   GFX1100, os.path.join(OUT, f"{name}_gfx1100"), forms=("ttgir", "amdgcn"))
    print("grid:", (N_CTX // CONFIG["BLOCK_N1"], 1, B * H), "triton", triton.__version__)


if __name__ == "__main__":
    main()
