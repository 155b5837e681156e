"""Fake of reForge's ldm_patched/ldm/wan/vae.py: the video VAE's AttentionBlock takes its attention function
from vae_attention() and runs it on each frame, q, k and v chunks of one projection (B * T, C, H, W)."""

import torch

from ldm_patched.ldm.modules.diffusionmodules.model import vae_attention


class AttentionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.optimized_attention = vae_attention()

    def forward(self, qkv):
        q, k, v = qkv.chunk(3, dim=1)
        return self.optimized_attention(q, k, v)
