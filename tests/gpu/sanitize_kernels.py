"""A small grid, forward and backward, to run under compute-sanitizer for one emulated layer:

    PYTHONPATH=. compute-sanitizer --tool racecheck python tests/gpu/sanitize_kernels.py gfx11
"""

import itertools
import os
import sys

import torch

os.environ["RDNA_FA_EMULATE"] = sys.argv[1] if len(sys.argv) > 1 else "gfx11"

from rdna_flash_attn.ops.autograd import flash_attention  # noqa: E402  (the layer is chosen before the first load)


def main() -> int:
    torch.manual_seed(0)
    shapes = itertools.product((torch.float16, torch.bfloat16), (40, 64, 160, 512), ((1, 77), (100, 33), (130, 130)),
                               (False, True))
    for dtype, head_dim, (seq_q, seq_k), causal in shapes:
        q, k, v = (torch.randn(1, 2, seq, head_dim, dtype=dtype, device="cuda", requires_grad=True)
                   for seq in (seq_q, seq_k, seq_k))
        out = flash_attention(q, k, v, causal)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    print(f"sanitize grid done on emulated {os.environ['RDNA_FA_EMULATE']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
