"""The yardstick of attention split over chunks (ring attention, Ulysses, torch's context parallelism)
against one attention over the whole sequence, shared by the interpreter's, the GPU's and the
multi-process tests: FlashAttention-2's criterion. The forward within 2x the error of the same attention
computed in the input dtype against fp64 (each chunk's output comes in the input dtype before the merge,
as flash-attn returns it: one rounding more than one call, which math SDPA's error does not allow for),
each gradient within 2x that attention's gradient error plus one rounding per chunk gradient summed
(attention_reference.summed_backward_bound). And what a NaN lse passed to the backward gives."""

from __future__ import annotations

import torch

from rdna_fa_lab.attention_reference import (attention_fp64, attention_input_dtype, grads_fp64, grads_input_dtype,
                                             max_error, summed_backward_bound)


def check_against_one_attention(out, grads, q, k, v, dout, causal: bool, summed: int) -> None:
    """The output and gradients of (batch, heads, tokens, head dim) q, k, v, dout, each gradient a sum of
    `summed` rounded chunk gradients."""
    reference = attention_fp64(q, k, v, causal)[0]
    assert out.isfinite().all()
    error = max_error(out, reference)
    baseline = max_error(attention_input_dtype(q, k, v, causal), reference)
    assert error <= 2 * baseline, f"forward error {error:.3e} > 2 x the input-dtype attention's {baseline:.3e}"
    exact, input_dtype = grads_fp64(q, k, v, dout, causal), grads_input_dtype(q, k, v, dout, causal)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, exact, input_dtype):
        error = max_error(grad, ref)
        bound = summed_backward_bound(max_error(base, ref), ref, q.dtype, summed)
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


def check_ring(out, lse, grads, q, k, v, dout, causal: bool, summed: int) -> None:
    """As check_against_one_attention, for flash-attn's (batch, tokens, heads, head dim) layout, with the
    merged log-sum-exp too."""
    full = [t.transpose(1, 2) for t in (q, k, v, dout)]
    assert lse.isfinite().all() and max_error(lse, attention_fp64(*full[:3], causal)[1]) < 1e-3
    check_against_one_attention(out.transpose(1, 2), [g.transpose(1, 2) for g in grads], *full, causal, summed)


def check_nan_lse_row(dq, dk, dv, batch: int, head: int, row: int) -> None:
    """flash-attn's backward given a NaN lse at (batch, head, row), one key/value head per query head, in
    its (batch, tokens, heads, head dim) layout: its exponent makes that row's dQ and every dK and dV of
    the (batch, head) NaN, and nothing else."""
    nan_dq = torch.zeros(dq.shape, dtype=torch.bool)
    nan_dq[batch, row, head] = True
    nan_kv = torch.zeros(dk.shape, dtype=torch.bool)
    nan_kv[batch, :, head] = True
    for name, grad, expected in (("dq", dq, nan_dq), ("dk", dk, nan_kv), ("dv", dv, nan_kv)):
        assert torch.equal(grad.isnan().cpu(), expected), f"{name}: NaN where the lse is not, or not where it is"
