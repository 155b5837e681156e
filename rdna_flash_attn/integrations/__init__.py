"""Ways in for code that does not call the dispatcher itself: launch (runs a training script with
torch's SDPA routed), autoload (the .pth hook that does it in every process), diffusers_attention
(a diffusers attention processor), flash_attn_interface (flash-attn's function signature)."""
