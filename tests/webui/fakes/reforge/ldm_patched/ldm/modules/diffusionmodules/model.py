"""Fake of reForge's ldm_patched/ldm/modules/diffusionmodules/model.py: the VAE's AttnBlock keeps its
attention function per instance, chosen by vae_attention() when the block is built."""

import torch

calls = {"vae_attention": 0}


def pytorch_attention(q, k, v):
    calls["vae_attention"] += 1
    b, c, h, w = q.shape
    q, k, v = (t.view(b, 1, c, -1).transpose(2, 3).contiguous() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    return out.transpose(2, 3).reshape(b, c, h, w)


def vae_attention():
    return pytorch_attention


class AttnBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.optimized_attention = vae_attention()

    def forward(self, q, k, v):
        return self.optimized_attention(q, k, v)
