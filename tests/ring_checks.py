"""The yardstick of ring attention (rdna_fa_lab/ring_attention.py) against one attention over the whole
sequence, shared by the interpreter's and the GPU's ring tests: FlashAttention-2's criterion. The forward
within 2x the error of the same attention computed in the input dtype against fp64 (each chunk's output
comes in the input dtype before the merge, as flash-attn returns it: one rounding more than one call, which
math SDPA's error does not allow for), each gradient within 2x that attention's gradient error plus one
rounding per chunk gradient summed (attention_reference.summed_backward_bound)."""

from __future__ import annotations

from rdna_fa_lab.attention_reference import (attention_fp64, attention_input_dtype, grads_fp64, grads_input_dtype,
                                             max_error, summed_backward_bound)


def check_against_one_attention(out, lse, grads, q, k, v, dout, causal: bool, summed: int) -> None:
    """Ring attention's output, lse and gradients for (batch, tokens, heads, head dim) q, k, v, dout, each
    gradient a sum of `summed` chunk gradients."""
    full = [t.transpose(1, 2) for t in (q, k, v, dout)]  # (batch, heads, tokens, head dim)
    reference, reference_lse = attention_fp64(*full[:3], causal)
    assert out.isfinite().all() and lse.isfinite().all()
    error = max_error(out.transpose(1, 2), reference)
    baseline = max_error(attention_input_dtype(*full[:3], causal), reference)
    assert error <= 2 * baseline, f"forward error {error:.3e} > 2 x the input-dtype attention's {baseline:.3e}"
    assert max_error(lse, reference_lse) < 1e-3
    exact, input_dtype = grads_fp64(*full, causal), grads_input_dtype(*full, causal)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, exact, input_dtype):
        error = max_error(grad.transpose(1, 2), ref)
        bound = summed_backward_bound(max_error(base, ref), ref, q.dtype, summed)
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"
