"""`flash_attn.ops` of the stand-in: only the activations that models import from it."""
