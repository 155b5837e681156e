"""UNet sampling speed and peak memory per attention provider: a diffusers UNet2DConditionModel in the
SD1.5 or SDXL layout (random weights), classifier-free guidance doubling the batch, random 77-token
text embeddings, a plain Euler loop.

Each configuration reports it/s over the timed steps (after one warm-up step) and the peak memory
allocated during sampling (weights included) and above the weights. A configuration whose Sq x Sk
score buffers cannot fit is skipped with the estimate, and one that runs out of memory anyway is
recorded as skipped with the error, rather than ending the run.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

import rdna_flash_attn
from rdna_flash_attn.tools.benchmark import ModelProvider

GUIDANCE = 7.0
TEXT_TOKENS = 77
MATH_BYTES_PER_SCORE = 12  # scores, softmax and its temporaries the math backend holds (measured ~9)
MEMORY_HEADROOM = 0.9  # share of the device's memory a configuration may plan to use


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the config is a dict
class UNetSpec:
    """A UNet layout: its diffusers config, text context width and pooled-text width (SDXL's
    added_cond_kwargs; None where the model has none)."""

    name: str
    config: dict
    context_dim: int
    pooled_dim: int | None

    def attention_levels(self) -> list[tuple[int, int, int, int]]:
        """(level, channels, heads, transformer depth) of each resolution level with attention; the
        mid block (also attention) sits at the last level."""
        down = self.config["down_block_types"]
        heads = self.config["attention_head_dim"]  # the number of heads in these configs (a misnomer)
        depth = self.config.get("transformer_layers_per_block", 1)
        heads = heads if isinstance(heads, tuple) else (heads,) * len(down)
        depth = depth if isinstance(depth, tuple) else (depth,) * len(down)
        return [(level, self.config["block_out_channels"][level], heads[level], depth[level])
                for level, kind in enumerate(down) if kind.startswith("CrossAttn")]


SD15 = UNetSpec(
    "sd15",
    dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
         block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, cross_attention_dim=768,
         down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")),
    context_dim=768, pooled_dim=None)

SDXL = UNetSpec(
    "sdxl",
    dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
         up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
         attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048,
         use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
         projection_class_embeddings_input_dim=2816),
    context_dim=2048, pooled_dim=1280)

# The same layouts, small enough for a CPU test.
TINY_SD15 = UNetSpec(
    "sd15-tiny",
    dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
         attention_head_dim=2, cross_attention_dim=32, norm_num_groups=8,
         down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")),
    context_dim=32, pooled_dim=None)

TINY_SDXL = UNetSpec(
    "sdxl-tiny",
    dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
         attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), cross_attention_dim=32, norm_num_groups=8,
         use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
         projection_class_embeddings_input_dim=16 + 6 * 8),
    context_dim=32, pooled_dim=16)


@dataclass(frozen=True)
class Config:
    spec: UNetSpec
    width: int
    height: int
    batch: int  # images; the UNet sees twice this with CFG

    @property
    def name(self) -> str:
        return f"{self.spec.name} {self.width}x{self.height} batch {self.batch}"


def configs(size: str) -> list[Config]:
    """full: SD1.5 at 512, 768, 1024 px and SDXL at 1024 and 1536x1024, batch 1 and 4; tiny: CPU sizes."""
    if size == "tiny":
        return [Config(TINY_SD15, 64, 64, 1), Config(TINY_SDXL, 96, 64, 2)]
    sizes = [(SD15, 512, 512), (SD15, 768, 768), (SD15, 1024, 1024), (SDXL, 1024, 1024), (SDXL, 1536, 1024)]
    return [Config(spec, w, h, b) for spec, w, h in sizes for b in (1, 4)]


def latent_size(config: Config) -> tuple[int, int]:
    return config.height // 8, config.width // 8


def attention_flops_per_step(config: Config) -> float:
    """FLOPs of the self-attention calls of one step (cross-attention adds < 3 %, left out):
    4 * batch * tokens^2 * channels per transformer layer, with layers_per_block attentions per level
    going down, one more going up, and the mid block at the last level."""
    h, w = latent_size(config)
    per_block = config.spec.config["layers_per_block"]
    last = len(config.spec.config["block_out_channels"]) - 1
    unet_batch = 2 * config.batch
    total = 0.0
    for level, channels, _heads, depth in config.spec.attention_levels():
        tokens = (h >> level) * (w >> level)
        total += 4.0 * unet_batch * tokens**2 * channels * (2 * per_block + 1) * depth
    mid_tokens, mid_depth = (h >> last) * (w >> last), config.spec.attention_levels()[-1][3]
    return total + 4.0 * unet_batch * mid_tokens**2 * config.spec.config["block_out_channels"][last] * mid_depth


def math_score_bytes(config: Config) -> int:
    """The largest Sq x Sk working set SDPA's math backend holds in one self-attention call."""
    h, w = latent_size(config)
    tokens_heads = [((h >> level) * (w >> level), heads) for level, _c, heads, _d in config.spec.attention_levels()]
    return max(2 * config.batch * heads * tokens * tokens * MATH_BYTES_PER_SCORE for tokens, heads in tokens_heads)


def build_unet(spec: UNetSpec, device: torch.device, dtype: torch.dtype):
    """Random weights, created on the device in `dtype` (initialising an SDXL UNet on a CPU takes
    minutes, and in float32 twice the memory)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        unet = UNet2DConditionModel(**spec.config)
    return unet.eval().requires_grad_(False)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@dataclass
class _Inputs:
    latents: torch.Tensor
    context: torch.Tensor
    added: dict = field(default_factory=dict)


def _inputs(config: Config, device: torch.device, dtype: torch.dtype) -> _Inputs:
    generator = torch.Generator(device=device).manual_seed(1)
    h, w = latent_size(config)
    latents = torch.randn(config.batch, 4, h, w, device=device, dtype=torch.float32, generator=generator)
    # CFG: rows 0..batch-1 unconditional, the rest conditional; 77 random "text" tokens each
    context = torch.randn(2 * config.batch, TEXT_TOKENS, config.spec.context_dim, device=device, dtype=dtype,
                          generator=generator)
    added = {}
    if config.spec.pooled_dim is not None:
        pooled = torch.randn(2 * config.batch, config.spec.pooled_dim, device=device, dtype=dtype, generator=generator)
        # SDXL's micro-conditioning: original size, crop top-left, target size
        size = torch.tensor([config.height, config.width, 0, 0, config.height, config.width], device=device,
                            dtype=dtype)
        added = {"text_embeds": pooled, "time_ids": size.expand(2 * config.batch, 6)}
    return _Inputs(latents, context, added)


def euler_sample(unet, inputs: _Inputs, steps: int, on_step: Callable[[int], None] = lambda i: None) -> torch.Tensor:
    """A plain Euler loop over a Karras-free sigma ramp with classifier-free guidance."""
    sigmas = torch.linspace(14.6, 0.0, steps + 1).tolist()
    timesteps = torch.linspace(999, 0, steps).tolist()
    x = inputs.latents * sigmas[0]
    dtype = inputs.context.dtype
    for i in range(steps):
        model_in = (torch.cat([x, x]) / (sigmas[i] ** 2 + 1) ** 0.5).to(dtype)
        eps = unet(model_in, timesteps[i], encoder_hidden_states=inputs.context,
                   added_cond_kwargs=inputs.added or None).sample.float()
        uncond, cond = eps.chunk(2)
        x = x + (uncond + GUIDANCE * (cond - uncond)) * (sigmas[i + 1] - sigmas[i])
        on_step(i)
    return x


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20


def release(device: torch.device) -> None:
    """Hand freed blocks back to the device, so the next measurement starts from the same state."""
    if device.type == "cuda":
        gc.collect()  # tensors held by reference cycles (a failed call's traceback)
        torch.cuda.empty_cache()


def start_measurement(device: torch.device) -> None:
    """Peak memory and the dispatcher's counters from zero, before a measured run."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rdna_flash_attn.reset_stats()


def out_of_memory_note(exc: BaseException) -> str:
    """A skipped row's reason: the error's first line, short."""
    return f"skipped: out of memory ({(str(exc).splitlines() or [''])[0][:160]})"


def is_out_of_memory(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError: also on the torch 2.2-2.7 builds ZLUDA users run; HIP says it in words
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


def _fits(config: Config, provider: ModelProvider, device: torch.device, weights_bytes: int) -> str | None:
    """Why `config` would not fit on `device` with `provider` (only SDPA math holds Sq x Sk buffers),
    or None."""
    if device.type != "cuda" or provider.name != "sdpa-math":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    need = weights_bytes + math_score_bytes(config)
    if need > MEMORY_HEADROOM * total:
        return (f"skipped: SDPA math needs ~{need / 2**30:.0f} GiB (weights + Sq x Sk scores) "
                f"of {total / 2**30:.0f} GiB")
    return None


def empty_row(config: Config, provider: ModelProvider, steps: int, weights_bytes: int | None,
              skipped: str | None) -> dict:
    return dict(part="generation", config=config.name, model=config.spec.name, width=config.width,
                height=config.height, batch=config.batch, unet_batch=2 * config.batch, provider=provider.name,
                steps=steps, attention_tflop_per_step=attention_flops_per_step(config) / 1e12,
                it_per_s=None, seconds=None, peak_allocated_mib=None, peak_reserved_mib=None,
                peak_above_weights_mib=None, weights_mib=None if weights_bytes is None else mib(weights_bytes),
                finite=None, attention_calls=None, skipped=skipped)


def measure(unet, config: Config, provider: ModelProvider, device: torch.device, dtype: torch.dtype,
            steps: int, weights_bytes: int) -> dict:
    """One result row: it/s, peak memory, attention calls per path; `skipped` says why a row has no
    numbers."""
    row = empty_row(config, provider, steps, weights_bytes, _fits(config, provider, device, weights_bytes))
    if row["skipped"]:
        return row
    inputs = None
    try:
        inputs = _inputs(config, device, dtype)
        start_measurement(device)
        with provider.context(), torch.no_grad():
            euler_sample(unet, inputs, 1)  # warm-up: lazy loading, allocator growth
            sync(device)
            start = time.perf_counter()
            result = euler_sample(unet, inputs, steps)
            sync(device)
            seconds = time.perf_counter() - start
        calls = rdna_flash_attn.stats()
        row.update(it_per_s=steps / seconds, seconds=seconds, finite=bool(torch.isfinite(result).all()),
                   attention_calls=calls if provider.name == "rdna_fa" else None)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_allocated_mib=mib(peak), peak_reserved_mib=mib(torch.cuda.max_memory_reserved(device)),
                       peak_above_weights_mib=mib(peak - weights_bytes))
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        row["skipped"] = out_of_memory_note(exc)
    finally:
        del inputs
        release(device)
    return row


def run(configs_: list[Config], providers: list[ModelProvider], device: torch.device, dtype: torch.dtype,
        steps: int, progress: Callable[[int, int, str], None]) -> list[dict]:
    """Every configuration with every provider; one UNet per layout, built once and reused."""
    rows = []
    total = len(configs_) * len(providers)
    for spec in dict.fromkeys(c.spec for c in configs_):
        try:
            unet = build_unet(spec, device, dtype)
        except (RuntimeError, MemoryError) as exc:
            if not is_out_of_memory(exc):
                raise
            for config in (c for c in configs_ if c.spec == spec):
                for provider in providers:
                    rows.append(empty_row(config, provider, steps, None, "skipped: the UNet's weights do not fit"))
                    progress(len(rows), total, f"{config.name} {provider.name}: {rows[-1]['skipped']}")
            continue
        weights_bytes = sum(p.numel() * p.element_size() for p in unet.parameters())
        for config in (c for c in configs_ if c.spec == spec):
            for provider in providers:
                rows.append(measure(unet, config, provider, device, dtype, steps, weights_bytes))
                progress(len(rows), total, f"{config.name} {provider.name}: {row_text(rows[-1])}")
        del unet
        release(device)
    return rows


def row_text(row: dict) -> str:
    if row.get("skipped"):
        return row["skipped"]
    peak = "" if row["peak_allocated_mib"] is None else f", peak {row['peak_allocated_mib'] / 1024:.2f} GiB"
    return f"{row['it_per_s']:.2f} it/s{peak}"
