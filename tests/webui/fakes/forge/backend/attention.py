"""Fake of Forge backend/attention.py: its PyTorch attention functions, bound to the two names the
model modules import, with Forge's signatures and (B, N, H*D) / (B, C, H, W) layouts."""

import torch

calls = {"attention_function": 0, "single_head_spatial": 0}


def get_attn_precision(attn_precision=torch.float32):
    return attn_precision


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    calls["attention_function"] += 1
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, inner = q.shape
        dim_head = inner // heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def attention_xformers(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    raise NotImplementedError("no xformers in the fake")


def pytorch_attention_single_head_spatial(q, k, v):
    calls["single_head_spatial"] += 1
    b, c, h, w = q.shape
    q, k, v = (t.view(b, 1, c, -1).transpose(2, 3).contiguous() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(2, 3).reshape(b, c, h, w)


attention_function = attention_pytorch
attention_function_single_head_spatial = pytorch_attention_single_head_spatial
