"""Ring attention as yunchang and xDiT run it (rdna_fa_lab/ring_attention.py) through our flash_attn module
on the emulation of both AMD layers, against one attention over the whole sequence by FlashAttention-2's
criterion as tests/interpreter/test_ring_attention.py applies it. Causal rings cut keys inside query chunks,
so some calls have query rows that see no key of their chunk. Every call must reach the kernels, forward
and backward."""

from __future__ import annotations

import pytest
import torch

from rdna_fa_lab.attention_reference import (attention_fp64, attention_input_dtype, grads_fp64, grads_input_dtype,
                                             max_error, summed_backward_bound)
from rdna_fa_lab.ring_attention import ring_attention
from rdna_flash_attn.integrations import flash_attn_interface as fa
from rdna_flash_attn.ops import attention as ops

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

    full = [t.transpose(1, 2) for t in (q, k, v, dout)]  # (batch, heads, tokens, head dim)
    reference, reference_lse = attention_fp64(*full[:3], causal)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    error = max_error(out.transpose(1, 2), reference)
    baseline = max_error(attention_input_dtype(*full[:3], causal), reference)
    assert error <= 2 * baseline, f"forward error {error:.3e} > 2 x the input-dtype attention's {baseline:.3e}"
    assert max_error(lse, reference_lse) < 1e-3
    exact, input_dtype = grads_fp64(*full, causal), grads_input_dtype(*full, causal)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, exact, input_dtype):
        error = max_error(grad.transpose(1, 2), ref)
        bound = summed_backward_bound(max_error(base, ref), ref, dtype, chunks + len(key_cuts))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"
