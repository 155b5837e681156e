"""Fake of sgm.modules.attention.CrossAttention: sgm's forward signature (extra tokens, cross-frame
attention), plain softmax attention."""

import torch
from torch import nn


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim or query_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim or query_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        extra = 0 if additional_tokens is None else additional_tokens.shape[1]
        if extra:
            x = torch.cat([additional_tokens, x], dim=1)
        context = x if context is None else context
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in
                   (self.to_q(x), self.to_k(context), self.to_v(context)))
        weights = (q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        out = (weights @ v.float()).to(q.dtype).transpose(1, 2).flatten(2)
        return self.to_out(out)[:, extra:]
