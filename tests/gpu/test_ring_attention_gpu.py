"""Ring attention as yunchang and xDiT run it (rdna_fa_lab/ring_attention.py) through our flash_attn module
on the emulation of both AMD layers, against one attention over the whole sequence by FlashAttention-2's
criterion (tests/ring_checks.py). Causal rings cut keys inside query chunks, so some calls have query rows
that see no key of their chunk. Every call must reach the kernels, forward and backward."""

from __future__ import annotations

import pytest
import torch

from rdna_fa_lab.ring_attention import ring_attention
from rdna_flash_attn.integrations import flash_attn_interface as fa
from rdna_flash_attn.ops import attention as ops

from ..ring_checks import check_ring
from ..seeds import case_seed

# (dtype, heads, head dim, tokens, chunks, causal, key cuts inside query chunks)
CASES = (
    (torch.bfloat16, 4, 128, 1000, 4, True, (100, 499, 700, 999)),
    (torch.float16, 2, 64, 777, 3, True, (1, 300, 517)),
    (torch.bfloat16, 4, 128, 1000, 4, False, ()),
    (torch.float16, 3, 80, 513, 8, False, ()),
)


def _counted(launch, name: str, launched: list):
    def counted(*args, **kwargs):
        launched.append(name)
        return launch(*args, **kwargs)
    return counted


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case[:6])))
def test_ring_attention_on_the_kernels_matches_one_attention(kernels_on, case, monkeypatch):
    dtype, heads, head_dim, tokens, chunks, causal, key_cuts = case
    generator = torch.Generator(device=kernels_on).manual_seed(case_seed(case))
    q, k, v, dout = (torch.randn(2, tokens, heads, head_dim, generator=generator, device=kernels_on).to(dtype)
                     for _ in range(4))
    launched = []
    for name in ("launch_forward", "launch_backward_from_output"):
        monkeypatch.setattr(ops, name, _counted(getattr(ops, name), name, launched))
    out, lse, grads, calls = ring_attention(fa, q, k, v, dout, chunks, causal, key_cuts)
    assert launched.count("launch_forward") == launched.count("launch_backward_from_output") == calls

    check_ring(out, lse, grads, q, k, v, dout, causal, chunks + len(key_cuts))
