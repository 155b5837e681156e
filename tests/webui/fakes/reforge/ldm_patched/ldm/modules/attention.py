"""Fake of reForge's ldm_patched/ldm/modules/attention.py: ComfyUI-style attention functions, one
chosen at import as `optimized_attention` (and `optimized_attention_masked`), which CrossAttention
looks up in this module at call time. Counts the calls of the chosen function."""

import torch

calls = {"optimized_attention": 0}


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    calls["optimized_attention"] += 1
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.ndim == 3:  # (batch, queries, keys), as every reForge backend reads it
        mask = mask.unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


optimized_attention = attention_pytorch
optimized_attention_masked = optimized_attention


def cross_attention(q, k, v, heads, mask=None, attn_precision=None):
    """CrossAttention.forward's call, after its projections."""
    if mask is None:
        return optimized_attention(q, k, v, heads, attn_precision=attn_precision)
    return optimized_attention_masked(q, k, v, heads, mask, attn_precision=attn_precision)
