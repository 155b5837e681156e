"""Ways in for code that does not call the dispatcher itself: launch (runs a training script with
torch's SDPA routed), autoload (the .pth hook that does it in every process, and puts the flash-attn
stand-in on the path on request), diffusers_attention (a diffusers attention processor),
flash_attn_interface and bert_padding (flash-attn 2.8.3's Python API; flash_attn_shim/ holds the
`flash_attn` package that re-exports them, for code written against Dao-AILab's flash-attn)."""
