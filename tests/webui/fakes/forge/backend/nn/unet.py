"""Fake of Forge backend/nn/unet.py: binds attention_function at import and calls it as Forge's
CrossAttention does."""

from backend.attention import attention_function


def cross_attention(q, k, v, heads, mask=None):
    return attention_function(q, k, v, heads, mask)
