"""`flash_attn.ops.activations` of the stand-in: swiglu, which OmniGen2 imports."""

import torch.nn.functional as F


def swiglu(x, y):
    """silu(x) * y, flash-attn's fused SwiGLU in plain torch."""
    return F.silu(x) * y
