"""Fake of A1111 modules/hypernetworks/hypernetwork.py: apply_hypernetworks (each loaded
hypernetwork maps the context, by its width, through a (key layer, value layer) pair) and
attention_CrossAttention_forward, A1111's unoptimized attention (hypernetworks, then the full
attention matrix), which A1111's undo installs on ldm's and sgm's CrossAttention."""

import torch

from modules import shared

calls = {"attention_CrossAttention_forward": 0}


def apply_hypernetworks(hypernetworks, context, layer=None):
    context_k = context_v = context
    for hypernetwork in hypernetworks:
        layers = hypernetwork.layers.get(context.shape[2])
        if layers is not None:
            context_k, context_v = layers[0](context_k), layers[1](context_v)
    return context_k, context_v


def attention_CrossAttention_forward(self, x, context=None, mask=None, **kwargs):
    calls["attention_CrossAttention_forward"] += 1
    context_k, context_v = apply_hypernetworks(shared.loaded_hypernetworks, x if context is None else context, self)
    q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in
               (self.to_q(x), self.to_k(context_k), self.to_v(context_v)))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        keep = mask.reshape(mask.shape[0], 1, 1, -1)
        scores = scores.masked_fill(~keep, -torch.finfo(scores.dtype).max)
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return self.to_out(out)
