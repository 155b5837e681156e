"""Fake of A1111 modules/models/sd3/mmdit.py: binds other_impls.attention at import, as A1111's
MMDiT does, and calls it from its joint block with (B, L, H*D) q, k, v."""

from modules.models.sd3.other_impls import attention


def block_mixing(q, k, v, num_heads):
    return attention(q, k, v, num_heads)
