"""VAE decode time and peak memory per attention provider: diffusers' AutoencoderKL in the SD layout
(random weights). Its decoder's mid block holds one single-head attention over every latent pixel
(head dim 512): 4096 tokens at 512 px, 16384 at 1024 px.

Providers: the kernels, SDPA's math backend, PyTorch's default SDPA, and the host's split attention:
diffusers' SlicedAttnProcessor (what `enable_attention_slicing()` installs). It slices over
batch x heads, so on the VAE's single head at batch 1 it still holds the whole Sq x Sk score matrix:
diffusers' split attention does not reduce VAE attention memory, and the table shows it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

import rdna_flash_attn
from rdna_flash_attn.tools.benchmark import ModelProvider

from .generation import default_dtype, is_out_of_memory, mib, out_of_memory_note, release, start_measurement, sync

SD_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
              block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
                block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32)
SLICED_NAME = "diffusers-sliced"
SLICED_DESCRIPTION = ("diffusers' SlicedAttnProcessor(slice_size=1), what enable_attention_slicing() installs; it "
                      "slices batch x heads, so the VAE's single head at batch 1 is one slice of the full Sq x Sk")


@dataclass(frozen=True)
class VaeCase:
    size: int  # image side in pixels

    def latent_side(self, config: dict) -> int:
        return self.size // 2 ** (len(config["block_out_channels"]) - 1)


def cases(size: str) -> tuple[dict, list[VaeCase]]:
    """(VAE config, image sizes): full: the SD VAE at 512 and 1024 px; tiny: a CPU-sized VAE."""
    if size == "tiny":
        return TINY_VAE, [VaeCase(32), VaeCase(48)]
    return SD_VAE, [VaeCase(512), VaeCase(1024)]


def build_vae(config: dict, device: torch.device, dtype: torch.dtype):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        vae = AutoencoderKL(**config)
    return vae.eval().requires_grad_(False)


@contextlib.contextmanager
def sliced_attention(vae) -> Iterator[None]:
    """diffusers' SlicedAttnProcessor(slice_size=1) on every attention of `vae`, then the previous
    processors back."""
    from diffusers.models.attention_processor import SlicedAttnProcessor

    # diffusers logs, on every call, that this processor ignores the VAE's `temb` argument
    quiet = logging.getLogger("diffusers.models.attention_processor")
    saved, saved_level = dict(vae.attn_processors), quiet.level
    vae.set_attn_processor(SlicedAttnProcessor(slice_size=1))
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(saved_level)
        vae.set_attn_processor(saved)


def providers_for(vae, model_providers: list[ModelProvider]) -> list[ModelProvider]:
    return [*model_providers, ModelProvider(SLICED_NAME, SLICED_DESCRIPTION, lambda: sliced_attention(vae))]


def measure(vae, config: dict, case: VaeCase, provider: ModelProvider, device: torch.device, dtype: torch.dtype,
            repeats: int, weights_bytes: int) -> dict:
    side = case.latent_side(config)
    row = dict(part="vae", config=f"vae decode {case.size}x{case.size}", size=case.size,
               attention_tokens=side * side, provider=provider.name, repeats=repeats, ms=None,
               peak_allocated_mib=None, peak_above_weights_mib=None, weights_mib=mib(weights_bytes), finite=None,
               attention_calls=None, skipped=None)
    latents = None
    try:
        latents = torch.randn(1, config["latent_channels"], side, side, device=device, dtype=dtype,
                              generator=torch.Generator(device=device).manual_seed(2))
        start_measurement(device)
        with provider.context(), torch.no_grad():
            vae.decode(latents)  # warm-up
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                image = vae.decode(latents).sample
            sync(device)
            seconds = time.perf_counter() - start
        row.update(ms=seconds / repeats * 1e3, finite=bool(torch.isfinite(image).all()),
                   attention_calls=rdna_flash_attn.stats() if provider.name == "rdna_fa" else None)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_allocated_mib=mib(peak), peak_above_weights_mib=mib(peak - weights_bytes))
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        row["skipped"] = out_of_memory_note(exc)
    finally:
        del latents
        release(device)
    return row


def run(size: str, model_providers: list[ModelProvider], device: torch.device, dtype: torch.dtype, repeats: int,
        progress: Callable[[int, int, str], None]) -> list[dict]:
    config, cases_ = cases(size)
    vae = build_vae(config, device, dtype)
    weights_bytes = sum(p.numel() * p.element_size() for p in vae.parameters())
    providers = providers_for(vae, model_providers)
    rows = []
    for case in cases_:
        for provider in providers:
            rows.append(measure(vae, config, case, provider, device, dtype, repeats, weights_bytes))
            text = f"{rows[-1]['config']} {provider.name}: {row_text(rows[-1])}"
            progress(len(rows), len(cases_) * len(providers), text)
    return rows


def row_text(row: dict) -> str:
    if row["skipped"]:
        return row["skipped"]
    peak = "" if row["peak_allocated_mib"] is None else f", peak {row['peak_allocated_mib'] / 1024:.2f} GiB"
    return f"{row['ms']:.1f} ms{peak}"
