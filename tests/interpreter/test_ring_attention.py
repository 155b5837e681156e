"""Ring attention as yunchang and xDiT run it (rdna_fa_lab/ring_attention.py: flash-attn's private pair per
chunk, outputs merged by their lse, the backward per chunk from the merged out and lse), through our
flash_attn module on the shipped code objects run by the CPU interpreter, against one attention over the
whole sequence by FlashAttention-2's criterion (tests/ring_checks.py). Causal rings cut keys inside query
chunks, so some calls have query rows that see no key of their chunk."""

from __future__ import annotations

import pytest
import torch

from rdna_fa_lab.ring_attention import ring_attention
from rdna_flash_attn.integrations import flash_attn_interface as fa

from ..ring_checks import check_ring
from ..seeds import case_seed

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from rdna_fa_lab.stand_in import stand_in_gpu  # noqa: E402

# (target, dtype, head dim, tokens, chunks, causal, key cuts inside query chunks)
CASES = (
    ("gfx1100", torch.bfloat16, 64, 40, 2, True, (13, 27)),
    ("gfx1201", torch.float16, 64, 40, 2, True, (6, 33)),
    ("gfx1201", torch.bfloat16, 64, 36, 3, False, ()),
)


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case[:6])))
def test_ring_attention_on_the_code_objects_matches_one_attention(case):
    target, dtype, head_dim, tokens, chunks, causal, key_cuts = case
    generator = torch.Generator().manual_seed(case_seed(case))
    q, k, v, dout = (torch.randn(1, tokens, 2, head_dim, generator=generator).to(dtype) for _ in range(4))
    with stand_in_gpu(target) as gpu:
        out, lse, grads, calls = ring_attention(fa, q, k, v, dout, chunks, causal, key_cuts)
    kinds = [symbol.split(f"_{'bf16' if dtype == torch.bfloat16 else 'f16'}_")[0] for symbol, *_ in gpu.launches]
    # Every call on the kernels: its forward, then its backward's dQ and dK/dV launches.
    assert [kinds.count(kind) for kind in ("rdna_fa_fwd", "rdna_fa_bwd_dq", "rdna_fa_bwd_dkdv")] == [calls] * 3

    check_ring(out, lse, grads, q, k, v, dout, causal, chunks + len(key_cuts))
