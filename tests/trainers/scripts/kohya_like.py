"""A cross-attention block written the way kohya sd-scripts' `library/original_unet.py` runs its
`--sdpa` path (our own code; theirs cannot be committed): torch.nn.functional imported as a module
at import time, `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, ...)` looked up at call
time on (batch, heads, tokens, head dim) tensors."""

import torch.nn.functional as F
from torch import nn


class KohyaStyleCrossAttention(nn.Module):
    def __init__(self, query_dim: int, context_dim: int | None = None, heads: int = 2, dim_head: int = 16):
        super().__init__()
        inner = heads * dim_head
        context_dim = context_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        return self.to_out(out.transpose(1, 2).flatten(2))


class KohyaStyleBlock(nn.Module):
    """Self-attention, then cross-attention on a text context, as a transformer block of the UNet."""

    def __init__(self, dim: int = 32, context_dim: int = 24):
        super().__init__()
        self.attn1 = KohyaStyleCrossAttention(dim)
        self.attn2 = KohyaStyleCrossAttention(dim, context_dim)

    def forward(self, x, context, mask=None):
        x = x + self.attn1(x)
        return x + self.attn2(x, context, mask)
