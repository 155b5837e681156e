"""Fake of Forge backend/nn/vae.py: binds the single-head spatial attention at import."""

from backend.attention import attention_function_single_head_spatial


def attn_block(q, k, v):
    return attention_function_single_head_spatial(q, k, v)
