"""fp64 attention reference and the error yardstick: PyTorch's math SDPA in the input dtype."""

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention_fp64(q, k, v, is_causal=False, scale=None):
    """Exact attention in float64 on (B, H, S, D) tensors; returns (out, lse)."""
    q, k, v = (t.double() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def sdpa_math(q, k, v, is_causal=False, scale=None):
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


def grads_fp64(q, k, v, dout, is_causal=False, scale=None):
    """dq, dk, dv of exact attention in float64."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_fp64(q, k, v, is_causal, scale)
    return torch.autograd.grad(out, (q, k, v), dout.double())


def grads_sdpa_math(q, k, v, dout, is_causal=False, scale=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    return torch.autograd.grad(out, (q, k, v), dout)
