"""Fake of sgm.modules.diffusionmodules.model.AttnBlock: one head over the channels."""

from torch import nn


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.norm = nn.GroupNorm(32, in_channels, eps=1e-6, affine=True)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(in_channels, in_channels, 1) for _ in range(4))

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = (t.flatten(2).transpose(1, 2) for t in (self.q(h_), self.k(h_), self.v(h_)))
        weights = (q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        out = (weights @ v.float()).to(q.dtype).transpose(1, 2).reshape(x.shape)
        return x + self.proj_out(out)
