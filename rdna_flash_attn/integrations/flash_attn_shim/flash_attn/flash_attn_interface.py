"""`flash_attn.flash_attn_interface` of the stand-in: rdna_flash_attn.integrations.flash_attn_interface."""

from rdna_flash_attn.integrations.flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _wrapped_flash_attn_backward,
    _wrapped_flash_attn_forward,
    _wrapped_flash_attn_varlen_backward,
    _wrapped_flash_attn_varlen_forward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_forward",
    "_wrapped_flash_attn_varlen_backward",
    "_wrapped_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]
