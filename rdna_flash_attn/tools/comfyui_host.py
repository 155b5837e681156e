"""What ComfyUI itself picks for attention on a GPU, for `doctor`: the silent fallbacks of its own that
users meet on AMD, and what the RDNA Flash Attention nodes change about each call.

The conditions are those of ComfyUI 0.33's comfy/model_management.py (its start-up, without attention
options on the command line):

- On a ROCm build of PyTorch it enables PyTorch attention (SDPA, AOTriton's kernels) only where its
  AOTriton probe passes (`torch.backends.cuda.can_use_flash_attention` on a (1, 1, 8, 64) float16 query)
  and either PyTorch is 2.7 or later on gfx90a, gfx942, gfx950, gfx1100, gfx1101, gfx1150 or gfx1151, or
  ROCm is 7.0 or later on gfx1200 or gfx1201. Everywhere else (gfx1102, gfx1103, ...) the diffusion
  model runs its sub-quadratic attention, and its memory reservation for sampling is sized for attention
  that holds the score matrix (0.15 MB per latent element, against 0.01 x dtype size).
- The VAE's attention never uses PyTorch attention on AMD: it runs ComfyUI's split attention (the whole
  score matrix, in query slices where memory is short), and its decode memory estimate is 2.73x that of
  other GPUs.
- Under ZLUDA PyTorch reports a CUDA build: ComfyUI takes it for NVIDIA and enables PyTorch attention for
  the model and the VAE, which there is SDPA's math backend (ZLUDA has no flash or memory-efficient SDPA),
  while reserving memory as for memory-efficient attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PYTORCH_ATTENTION_TARGETS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1150", "gfx1151")
PYTORCH_ATTENTION_TARGETS_ROCM7 = ("gfx1200", "gfx1201")


def version_tuple(text: str | None) -> tuple[int, int]:
    """(major, minor) of a version string such as torch's "2.8.0+rocm6.4" or HIP's "6.4.43482"; (0, 0) if unreadable."""
    parts = (text or "").split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def aotriton_probe_refusal(device: torch.device) -> str | None:
    """Why ComfyUI's AOTriton probe fails on `device` (it then treats the GPU as without AOTriton), or None
    where it passes: the same query ComfyUI makes."""
    try:
        if not torch.backends.cuda.is_flash_attention_available():
            return "this PyTorch was built without flash attention"
        q = torch.empty((1, 1, 8, 64), dtype=torch.float16, device=device)
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
        if not torch.backends.cuda.can_use_flash_attention(params, False):
            return "torch.backends.cuda.can_use_flash_attention says no for this GPU"
    except (AttributeError, RuntimeError, TypeError) as error:
        return f"the probe raised {type(error).__name__}: {error}"
    return None


@dataclass(frozen=True)
class ComfyAttention:
    """What ComfyUI picks on one GPU."""

    model: str  # the diffusion model's attention
    why: str  # why ComfyUI picked it
    vae: str  # the VAE's attention
    memory_efficient_reservation: bool  # whether ComfyUI sizes its sampling reservation for memory-efficient attention


def comfy_attention(backend: str, gfx_target: str | None, torch_version: str, hip_version: str | None,
                    probe_refusal: str | None) -> ComfyAttention:
    """ComfyUI 0.33's choice for a GPU (`backend` as device.describe says: "rocm" or "zluda")."""
    if backend == "zluda":
        return ComfyAttention(
            "PyTorch SDPA, which under ZLUDA is its math backend (the whole score matrix in memory)",
            "ComfyUI takes ZLUDA's CUDA build of PyTorch for NVIDIA", "PyTorch SDPA (math backend)", True)
    target = gfx_target or "this GPU"
    vae = "ComfyUI's split attention (whole score matrix in query slices; never PyTorch attention on AMD)"
    torch_ok = version_tuple(torch_version) >= (2, 7)
    rocm7 = version_tuple(hip_version) >= (7, 0)
    listed = any(name in target for name in PYTORCH_ATTENTION_TARGETS)
    listed_rocm7 = any(name in target for name in PYTORCH_ATTENTION_TARGETS_ROCM7)
    if (listed and torch_ok) or (listed_rocm7 and rocm7):
        if probe_refusal is None:
            return ComfyAttention("PyTorch SDPA (AOTriton)", f"ComfyUI enables PyTorch attention on {target}",
                                  vae, True)
        why = (f"ComfyUI's AOTriton probe fails ({probe_refusal}), so it silently leaves {target} on sub-quadratic "
               "attention (--use-pytorch-cross-attention overrides it)")
    elif listed:
        why = f"ComfyUI enables PyTorch attention on {target} only from PyTorch 2.7 on"
    elif listed_rocm7:
        why = f"ComfyUI enables PyTorch attention on {target} only from ROCm 7.0 on"
    else:
        why = f"ComfyUI keeps {target} on sub-quadratic attention (not in its PyTorch-attention list)"
    return ComfyAttention("sub-quadratic attention (chunked, in PyTorch operations)", why, vae, False)


def report_lines(choice: ComfyAttention) -> list[tuple[str, str]]:
    """(label, text) lines: each kind of call, as ComfyUI runs it without and with this project's nodes."""
    reservation = ("sized for memory-efficient attention" if choice.memory_efficient_reservation else
                   "sized for attention holding the score matrix (7.5x the memory-efficient figure in 16 bits)")
    return [
        ("  ComfyUI picks", f"{choice.model}: {choice.why}"),
        ("  model calls", f"without the node: {choice.model}; with the model node: the kernels, and the calls they "
                          "do not take on ComfyUI's pick"),
        ("  VAE calls", f"without the node: {choice.vae}; with the VAE node: the kernels"),
        ("  sampling memory", f"without the node: ComfyUI's reservation {reservation}; with the model node: sized "
                              "for memory-efficient attention where the kernels take the model's calls"),
    ]
