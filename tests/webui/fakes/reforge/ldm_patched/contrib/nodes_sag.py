"""Fake of reForge's ldm_patched/contrib/nodes_sag.py: binds optimized_attention at import."""

from ldm_patched.ldm.modules.attention import optimized_attention


def attention_with_guidance(q, k, v, heads):
    return optimized_attention(q, k, v, heads)
