"""Ring attention as yunchang and xDiT run it (rdna_fa_lab/ring_attention.py: flash-attn's private pair per
chunk, outputs merged by their lse, the backward per chunk from the merged out and lse), through our
flash_attn module on the shipped code objects run by the CPU interpreter, against one attention over the
whole sequence by FlashAttention-2's criterion: the forward within 2x the error of the same attention
computed in the input dtype against fp64 (each chunk's output comes in the input dtype before the merge, as
flash-attn returns it: one rounding more than one call, which math SDPA's error does not allow for), each
gradient within 2x that attention's gradient error plus one rounding per chunk gradient summed
(attention_reference.summed_backward_bound). Causal rings cut keys inside query chunks, so some calls have
query rows that see no key of their chunk."""

from __future__ import annotations

import pytest
import torch

from rdna_fa_lab.attention_reference import (attention_fp64, attention_input_dtype, grads_fp64, grads_input_dtype,
                                             max_error, summed_backward_bound)
from rdna_fa_lab.ring_attention import ring_attention
from rdna_flash_attn.integrations import flash_attn_interface as fa

from ..seeds import case_seed

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")

from ..call_path import interpreted_gpu  # noqa: E402

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
    with interpreted_gpu(target) as gpu:
        out, lse, grads, calls = ring_attention(fa, q, k, v, dout, chunks, causal, key_cuts)
    kinds = [symbol.split(f"_{'bf16' if dtype == torch.bfloat16 else 'f16'}_")[0] for symbol, *_ in gpu.launches]
    # Every call on the kernels: its forward, then its backward's dQ and dK/dV launches.
    assert [kinds.count(kind) for kind in ("rdna_fa_fwd", "rdna_fa_bwd_dq", "rdna_fa_bwd_dkdv")] == [calls] * 3

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
