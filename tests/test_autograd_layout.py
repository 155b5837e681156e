"""The differentiable op's results lie in memory as its fake implementation (what a compiled graph
plans with) says, also when an input had to be copied first (a misaligned view)."""

from __future__ import annotations

import pytest
import torch

from rdna_flash_attn.ops import autograd, attention as ops


def _misaligned_bshd(batch=1, seq=16, heads=3, dim=64):
    """A (B, H, S, D) view of (B, S, H, D) memory that starts 2 bytes past a 16-byte boundary."""
    flat = torch.randn(batch * seq * heads * dim + 8, dtype=torch.float16)
    return flat[1:1 + batch * seq * heads * dim].view(batch, seq, heads, dim).transpose(1, 2)


@pytest.fixture
def kernels_lay_out_like_ops(monkeypatch):
    """ops' forward and backward launches as the real ones allocate: results in the memory order of the
    (kernel-layout) tensors they are given, unless out/lse are given."""

    def forward(plan, q, k, v, *, out=None, lse=None, saved=None, launcher=None):
        assert ops.kernel_layout(q) is q, "the kernels were given a tensor they cannot address"
        assert (plan.out_size, plan.out_stride) == (q.shape, ops.output_like(q).stride()), "planned for another q"
        out = ops.output_like(q) if out is None else out
        lse = q.new_zeros(q.shape[:3], dtype=torch.float32) if lse is None else lse
        return out.copy_(q), lse

    def backward(dout, q, k, v, lse, is_causal=False, scale=None, *, attn_mask=None, bottom_right=False, out=None,
                 saved=None):
        return tuple(ops.output_like(t).copy_(t) for t in (q, k, v))

    monkeypatch.setattr(ops, "launch_forward", forward)
    monkeypatch.setattr(ops, "launch_backward", backward)


@pytest.mark.parametrize("training", (False, True))
def test_a_copied_query_still_gives_the_promised_output_layout(kernels_lay_out_like_ops, training):
    q = _misaligned_bshd()
    assert ops.kernel_layout(q) is not q
    out, lse, *stats = autograd._forward(q, q, q, None, False, None, False, training)
    assert out.stride() == ops.output_like(q).stride()
    assert torch.equal(out, q) and lse.shape == q.shape[:3]
    promised = autograd._stats_or_empty(q, training)  # what the fake implementation returns
    assert [(t.shape, t.stride(), t.dtype) for t in stats] == [(t.shape, t.stride(), t.dtype) for t in promised]


def test_copied_inputs_still_give_the_promised_gradient_layouts(kernels_lay_out_like_ops):
    q = _misaligned_bshd()
    aligned = ops.output_like(q).copy_(q)
    lse = torch.zeros(q.shape[:3])
    stats = autograd._stats_or_empty(q, False)
    for grad, t in zip(autograd._backward(aligned, q, aligned, q, aligned, lse, stats, None, False, None, False),
                       (q, aligned, q)):
        assert grad.stride() == ops.output_like(t).stride()
        assert torch.equal(grad, t)
