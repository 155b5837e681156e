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

from ..ring_checks import check_nan_lse_row, check_ring
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


@pytest.mark.parametrize("target", ("gfx1100", "gfx1201"))
def test_a_nan_lse_gives_nan_gradients_on_the_code_objects(target):
    """flash-attn's private backward on the kernels, given a NaN lse (one row of a merged lse, say): that
    row's dQ and every dK and dV of its (batch, head) are NaN, as flash-attn's exponent of it makes them,
    not the zeros of a row without keys."""
    generator = torch.Generator().manual_seed(case_seed((target, "nan lse")))
    q, k, v, dout = (torch.randn(2, seq, 2, 64, generator=generator).half() for seq in (20, 12, 12, 20))
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with stand_in_gpu(target) as gpu:
        out, lse, *_ = fa._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
        lse[1, 0, 5] = float("nan")
        fa._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, False, -1, -1, 0.0, None, False)
    assert any("dkdv" in symbol for symbol, *_ in gpu.launches)
    check_nan_lse_row(*grads, batch=1, head=0, row=5)
