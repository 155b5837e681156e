"""A small forward grid to run under compute-sanitizer (memcheck, racecheck) for one emulated layer:

    compute-sanitizer --tool racecheck python tests/gpu/sanitize_forward.py gfx11
"""

import itertools
import os
import sys

import torch

os.environ["RDNA_FA_EMULATE"] = sys.argv[1] if len(sys.argv) > 1 else "gfx11"

from rdna_flash_attn import ops  # noqa: E402  (the layer is chosen before the first load)


def main() -> int:
    torch.manual_seed(0)
    shapes = itertools.product((torch.float16, torch.bfloat16), (40, 64, 160, 512), ((1, 77), (100, 33), (130, 130)),
                               (False, True))
    for dtype, head_dim, (seq_q, seq_k), causal in shapes:
        q = torch.randn(1, 2, seq_q, head_dim, dtype=dtype, device="cuda")
        k = torch.randn(1, 2, seq_k, head_dim, dtype=dtype, device="cuda")
        v = torch.randn(1, 2, seq_k, head_dim, dtype=dtype, device="cuda")
        out, _ = ops.flash_attention_forward(q, k, v, causal)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    print(f"sanitize grid done on emulated {os.environ['RDNA_FA_EMULATE']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
