"""rdna_flash_attn's stand-in for Dao-AILab's flash-attn, put on sys.path only on request
(RDNA_FA_FLASH_ATTN=1, or `python -m rdna_flash_attn.launch --flash-attn`) and only where no real
flash-attn is installed. It implements flash-attn 2.8.3's Python API, the version it reports, on
rdna_flash_attn's dispatcher: the kernels where they take a call, PyTorch SDPA elsewhere."""

__version__ = "2.8.3"

from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]
