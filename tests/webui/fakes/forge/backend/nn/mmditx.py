"""Fake of Forge backend/nn/mmditx.py (SD3.5): its own `attention` calls PyTorch's SDPA, and its
blocks call that module global; counts its calls."""

import torch

calls = {"attention": 0}


def attention(q, k, v, heads, mask=None):
    calls["attention"] += 1
    b, _, dim_head = q.shape
    dim_head //= heads
    q, k, v = [t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def block_mixing(q, k, v, num_heads):
    return attention(q, k, v, num_heads)
