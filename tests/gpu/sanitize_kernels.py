"""A small grid, forward and backward, to run under compute-sanitizer for one emulated layer:

    compute-sanitizer --tool racecheck python -m tests.gpu.sanitize_kernels gfx11
"""

import itertools
import os
import sys

import torch

os.environ["RDNA_FA_EMULATE"] = sys.argv[1] if len(sys.argv) > 1 else "gfx11"

from rdna_flash_attn.ops.attention import (flash_attention_backward, flash_attention_forward,  # noqa: E402
                                           flash_attention_varlen_backward, flash_attention_varlen_forward)
from rdna_flash_attn.ops.autograd import flash_attention, flash_attention_varlen  # noqa: E402  (layer chosen first)
from rdna_flash_attn.ops.quantized import quantized_attention_forward  # noqa: E402


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
    # Masks (key padding and full, bool and additive), grouped key/value heads, a packed batch.
    for dtype, head_dim, masked in itertools.product((torch.float16, torch.bfloat16), (64, 128, 160), (False, True)):
        q = torch.randn(2, 4, 77, head_dim, dtype=dtype, device="cuda", requires_grad=True)
        k, v = (torch.randn(2, 2, 33, head_dim, dtype=dtype, device="cuda", requires_grad=True) for _ in range(2))
        mask = torch.rand(2, 1, 77 if masked else 1, 33, device="cuda") < 0.8
        out = flash_attention(q, k, v, attn_mask=mask if masked else mask.to(dtype).log())
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        cu = torch.tensor([0, 17, 17, 77], dtype=torch.int32, device="cuda")
        packed = [q.detach()[0].transpose(0, 1).contiguous().requires_grad_() for _ in range(3)]  # (77, 4, d)
        out_varlen, _ = flash_attention_varlen(*packed, cu, cu, 60, 60, True)
        grads += torch.autograd.grad(out_varlen, packed, torch.randn_like(out_varlen))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    # Workgroups without a key tile: causal bottom-right with more queries than keys, packed entries without
    # keys beside entries without queries.
    for dtype, head_dim in itertools.product((torch.float16, torch.bfloat16), (64, 128, 512)):
        q, dout = (torch.randn(1, 2, 130, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        k, v = (torch.randn(1, 2, 9, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        out, lse = flash_attention_forward(q, k, v, True, bottom_right=True)
        grads = flash_attention_backward(dout, q, k, v, lse, True, bottom_right=True)
        cu_q, cu_k = (torch.tensor(offsets, dtype=torch.int32, device="cuda") for offsets in ([0, 9, 9, 89], [0, 0, 5, 13]))
        packed_q, packed_k = q[0, :, :89].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()
        packed_k = torch.cat([packed_k, packed_k[:4]])
        out_varlen, lse_varlen = flash_attention_varlen_forward(packed_q, packed_k, packed_k, cu_q, cu_k, 80, 8, True)
        grads += flash_attention_varlen_backward(packed_q, packed_q, packed_k, packed_k, lse_varlen, cu_q, cu_k, 80, 8,
                                                 True)
        torch.cuda.synchronize()
        assert all(torch.isfinite(t).all() for t in (out, out_varlen, *grads))
    if os.environ["RDNA_FA_EMULATE"] == "gfx12":  # the 8-bit forward: ragged queries and keys, grouped heads
        for dtype, head_dim, (seq_q, seq_k) in itertools.product((torch.float16, torch.bfloat16), (40, 128, 160),
                                                                 ((1, 1), (77, 33), (130, 200))):
            q = torch.randn(2, 4, seq_q, head_dim, dtype=dtype, device="cuda")
            k, v = (torch.randn(2, 2, seq_k, head_dim, dtype=dtype, device="cuda") for _ in range(2))
            out = quantized_attention_forward(q, k, v)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
    print(f"sanitize grid done on emulated {os.environ['RDNA_FA_EMULATE']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
