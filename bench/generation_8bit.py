"""8-bit attention end to end on a generation (issue 24): the same seed sampled with attention on the exact
kernels and in 8-bit attention ("8bit-qkpv"), and the images compared (PSNR).

No pretrained diffusion model can reach the test machine (no network, 64 MiB of files), and a model with
random weights draws noise whose difference says little. So the run first trains a small diffusion
transformer here: rectified flow on procedural 64x64 images (a two-colour gradient with up to three discs
and squares), patch 2, so 1024 tokens per image, and head dim 128 (Flux's, Wan's). Then it samples the same
noise four times, changing only the attention:
  reference  the model in float32, PyTorch's math attention in float32
  sdpa       the model in bf16, PyTorch's own SDPA: what the host runs without us
  exact      the model in bf16, rdna_flash_attn's exact kernels
  8bit       the model in bf16, rdna_flash_attn in "8bit-qkpv"
and reports the PSNR of each pair. On NVIDIA the kernels run through the gfx12 emulation
(RDNA_FA_FORCE=1 RDNA_FA_EMULATE=gfx12, build/emu); the run stops if any call of a kernel path fell back or
ran at the wrong precision.

    RDNA_FA_FORCE=1 RDNA_FA_EMULATE=gfx12 python3 -m bench.generation_8bit --out bench/results/generation_8bit

What it cannot show: a small model trained for minutes on simple images has neither the outlier channels
nor the depth of a real diffusion model (bench/quantized_attention_accuracy.py models those statistics
per call); and the emulation shows the kernels' arithmetic, not their speed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import matplotlib
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import rdna_flash_attn  # noqa: E402

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PROVIDERS = ("reference", "sdpa", "exact", "8bit")
COMPARED = (("exact", "8bit"), ("reference", "exact"), ("reference", "8bit"), ("reference", "sdpa"), ("sdpa", "exact"))


@dataclass(frozen=True)
class Setup:
    size: int = 64  # image side, pixels
    patch: int = 2
    width: int = 512
    heads: int = 4
    depth: int = 8
    train_steps: int = 3000
    batch: int = 32
    learning_rate: float = 3e-4
    images: int = 16
    sample_steps: int = 32
    seed: int = 0

    @property
    def tokens(self) -> int:
        return (self.size // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


TINY = Setup(size=16, patch=4, width=64, heads=1, depth=2, train_steps=3, batch=4, images=2, sample_steps=2)


def procedural_images(count: int, size: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(count, 3, size, size) in [-1, 1]: a linear gradient between two random colours at a random angle,
    and one to three filled discs or squares of random colour, position and size."""
    def uniform(*shape, low=0.0, high=1.0):
        return low + (high - low) * torch.rand(*shape, generator=generator, device=generator.device).to(device)

    axis = torch.linspace(-1.0, 1.0, size, device=device)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    angle = uniform(count, 1, 1, high=2 * math.pi)
    ramp = ((torch.cos(angle) * x + torch.sin(angle) * y) / math.sqrt(2.0) / 2.0 + 0.5).unsqueeze(1)
    images = uniform(count, 3, 1, 1) * (1.0 - ramp) + uniform(count, 3, 1, 1) * ramp
    for chance in (1.0, 0.6, 0.3):
        present = uniform(count, 1, 1) < chance
        centre_x, centre_y = uniform(count, 1, 1, low=-0.6, high=0.6), uniform(count, 1, 1, low=-0.6, high=0.6)
        radius = uniform(count, 1, 1, low=0.15, high=0.4)
        disc = (x - centre_x) ** 2 + (y - centre_y) ** 2 < radius**2
        square = torch.maximum((x - centre_x).abs(), (y - centre_y).abs()) < 0.85 * radius
        inside = torch.where(uniform(count, 1, 1) < 0.5, disc, square) & present
        images = torch.where(inside.unsqueeze(1), uniform(count, 3, 1, 1), images)
    return images * 2.0 - 1.0


def sincos(positions: torch.Tensor, channels: int) -> torch.Tensor:
    frequencies = torch.exp(-math.log(10000.0) * torch.arange(channels // 2, device=positions.device) / (channels // 2))
    angles = positions.float()[:, None] * frequencies[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class Block(nn.Module):
    """A DiT block: adaLN-zero modulation from the timestep, self-attention, MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.modulation = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, condition: torch.Tensor, attention: Attention) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(condition)[:, None].chunk(6, dim=-1)
        batch, tokens, width = x.shape
        h = self.norm1(x) * (1 + scale1) + shift1
        # (3, B, H, N, d) views of one projection: strided q, k, v as diffusers' processors pass them
        q, k, v = self.qkv(h).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        x = x + gate1 * self.proj(attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width))
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class DiffusionTransformer(nn.Module):
    """Predicts the rectified-flow velocity (noise - image) of a noised image at time t in [0, 1]."""

    def __init__(self, setup: Setup):
        super().__init__()
        self.setup = setup
        side = setup.size // setup.patch
        self.embed = nn.Conv2d(3, setup.width, setup.patch, stride=setup.patch)
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        position = torch.cat([sincos(rows.flatten(), setup.width // 2), sincos(cols.flatten(), setup.width // 2)], 1)
        self.register_buffer("position", position[None], persistent=False)
        self.time = nn.Sequential(nn.Linear(256, setup.width), nn.SiLU(), nn.Linear(setup.width, setup.width))
        self.blocks = nn.ModuleList(Block(setup.width, setup.heads) for _ in range(setup.depth))
        self.norm = nn.LayerNorm(setup.width, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Linear(setup.width, 2 * setup.width)
        self.out = nn.Linear(setup.width, setup.patch**2 * 3)
        for layer in (self.final_modulation, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, images: torch.Tensor, t: torch.Tensor, attention: Attention) -> torch.Tensor:
        setup, batch = self.setup, images.shape[0]
        x = self.embed(images).flatten(2).transpose(1, 2) + self.position.to(images.dtype)
        condition = F.silu(self.time(sincos(t.float() * 1000.0, 256).to(images.dtype)))
        for block in self.blocks:
            x = block(x, condition, attention)
        shift, scale = self.final_modulation(condition)[:, None].chunk(2, dim=-1)
        x = self.out(self.norm(x) * (1 + scale) + shift)
        side = setup.size // setup.patch
        x = x.view(batch, side, side, setup.patch, setup.patch, 3).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(batch, 3, setup.size, setup.size)


def train(setup: Setup, device: torch.device, progress: Callable[[str], None]) -> tuple[DiffusionTransformer, list]:
    """Rectified flow with logit-normal times (as SD3), AdamW, bf16 autocast on CUDA; PyTorch's SDPA."""
    torch.manual_seed(setup.seed)
    model = DiffusionTransformer(setup).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.0)
    warmup = max(1, setup.train_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    data = torch.Generator(device=device).manual_seed(setup.seed + 1)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    losses, start = [], time.monotonic()
    for step in range(setup.train_steps):
        images = procedural_images(setup.batch, setup.size, data, device)
        noise = torch.randn(images.shape, generator=data, device=device)
        t = torch.sigmoid(torch.randn(setup.batch, generator=data, device=device))
        noised = (1 - t[:, None, None, None]) * images + t[:, None, None, None] * noise
        with autocast:
            velocity = model(noised, t, F.scaled_dot_product_attention)
        loss = F.mse_loss(velocity.float(), noise - images)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % max(1, setup.train_steps // 10) == 0:
            recent = sum(losses[-50:]) / len(losses[-50:])
            progress(f"train {step + 1}/{setup.train_steps}: loss {recent:.4f} ({time.monotonic() - start:.0f} s)")
    return model.eval(), losses


@torch.inference_mode()
def sample(model: DiffusionTransformer, noise: torch.Tensor, steps: int, attention: Attention) -> torch.Tensor:
    """Euler from pure noise (t = 1) to the image (t = 0), the state in float32 as ComfyUI keeps its latents
    and the model in its own dtype; images in [0, 1]."""
    dtype = next(model.parameters()).dtype
    x = noise.float()
    times = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    for t, t_next in zip(times[:-1], times[1:]):
        x = x + (t_next - t) * model(x.to(dtype), t.expand(x.shape[0]), attention).float()
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def math_attention(q, k, v):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


def kernel_attention(precision: str) -> Attention:
    def attention(q, k, v):
        with rdna_flash_attn.precision(precision):
            return rdna_flash_attn.scaled_dot_product_attention(q, k, v)
    return attention


def float32_run(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`run` in float32 throughout: cuDNN's convolutions would take TF32 by default (the patch embedding)."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return run()
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def checked_kernel_run(run: Callable[[], torch.Tensor], calls: int, eight_bit: bool) -> tuple[torch.Tensor, dict]:
    """Runs `run` and refuses its result unless every one of its `calls` attention calls reached the kernels
    at the asked precision (a fallback would compare SDPA with itself); returns it with the dispatcher's
    counts."""
    rdna_flash_attn.reset_stats()
    images = run()
    counts = rdna_flash_attn.stats()
    wanted = {"kernel": calls, "kernel_8bit": calls if eight_bit else 0, "fallback": 0}
    if any(counts[key] != value for key, value in wanted.items()):
        raise RuntimeError(f"attention calls did not all reach the kernels as asked: wanted {wanted}, got {counts}")
    return images, counts


def psnr(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per image, in dB, for images in [0, 1] (inf where identical)."""
    mse = ((a.double() - b.double()) ** 2).flatten(1).mean(1)
    return [math.inf if e == 0 else 10.0 * math.log10(1.0 / e) for e in mse.tolist()]


def generate(model: DiffusionTransformer, setup: Setup, device: torch.device, progress: Callable[[str], None],
             providers=PROVIDERS) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Images per provider, and the dispatcher's counts of each kernel provider's run."""
    noise = torch.randn(setup.images, 3, setup.size, setup.size, device=device,
                        generator=torch.Generator(device=device).manual_seed(setup.seed + 2))
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    calls = setup.sample_steps * setup.depth
    runs = {
        "reference": lambda: (float32_run(lambda: sample(model, noise, setup.sample_steps, math_attention)), None),
        "sdpa": lambda: (sample(bf16_model, noise, setup.sample_steps, F.scaled_dot_product_attention), None),
        "exact": lambda: checked_kernel_run(
            lambda: sample(bf16_model, noise, setup.sample_steps, kernel_attention("exact")), calls, eight_bit=False),
        "8bit": lambda: checked_kernel_run(
            lambda: sample(bf16_model, noise, setup.sample_steps, kernel_attention("8bit-qkpv")), calls,
            eight_bit=True),
    }
    images, counts = {}, {}
    for name in providers:
        start = time.monotonic()
        result, dispatch = runs[name]()
        images[name] = result.cpu()
        if dispatch is not None:
            counts[name] = dispatch
        calls_text = f", {dispatch['kernel']} kernel calls ({dispatch['kernel_8bit']} in 8 bits)" if dispatch else ""
        progress(f"sampled {name}: {setup.images} images, {setup.sample_steps} steps{calls_text} "
                 f"({time.monotonic() - start:.1f} s)")
    return images, counts


def compare(images: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for a, b in COMPARED:
        if a in images and b in images:
            values = psnr(images[a], images[b])
            finite = [v for v in values if math.isfinite(v)]  # identical images (inf) left out of the mean
            rows.append(dict(pair=f"{a} vs {b}", psnr_db=values, mean_db=sum(finite) / len(finite) if finite else math.inf,
                             min_db=min(values), max_abs=(images[a] - images[b]).abs().max().item()))
    return rows


def save_grid(images: torch.Tensor, path: Path, columns: int = 8, zoom: int = 2) -> None:
    count, _, size, _ = images.shape
    rows = math.ceil(count / columns)
    canvas = torch.ones(3, rows * (size + 2), columns * (size + 2))
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        canvas[:, r * (size + 2) + 1:r * (size + 2) + 1 + size, c * (size + 2) + 1:c * (size + 2) + 1 + size] = image
    pixels = (canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).resize((pixels.shape[1] * zoom, pixels.shape[0] * zoom), Image.NEAREST).save(path)


def plot(images: dict[str, torch.Tensor], rows: list[dict], losses: list[float], path: Path, shown: int = 8) -> None:
    names = [n for n in ("reference", "exact", "8bit") if n in images]
    panels = names + (["|exact - 8bit| x 10"] if {"exact", "8bit"} <= images.keys() else [])
    figure, axes = plt.subplots(len(panels) + 1, shown, figsize=(1.6 * shown, 1.7 * (len(panels) + 1)), squeeze=False)
    for row, name in enumerate(panels):
        batch = (images["exact"] - images["8bit"]).abs().mul(10).clamp(0, 1) if name.startswith("|") else images[name]
        for col in range(shown):
            axis = axes[row][col]
            axis.axis("off")
            if col < batch.shape[0]:
                axis.imshow(batch[col].permute(1, 2, 0).numpy(), interpolation="nearest")
            if col == 0:
                axis.set_title(name, fontsize=8, loc="left")
    for axis in axes[-1]:
        axis.remove()
    loss_axis = figure.add_subplot(len(panels) + 1, 2, 2 * len(panels) + 1)
    loss_axis.plot(losses, linewidth=0.6)
    loss_axis.set_yscale("log")
    loss_axis.set_title("training loss", fontsize=8)
    text = figure.add_subplot(len(panels) + 1, 2, 2 * len(panels) + 2)
    text.axis("off")
    text.text(0, 0.5, "\n".join(f"{r['pair']}: PSNR mean {r['mean_db']:.1f} dB, min {r['min_db']:.1f} dB"
                                for r in rows), fontsize=8, va="center")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="prefix of the .json, .png, _exact.png, _8bit.png")
    parser.add_argument("--train-steps", type=int, default=Setup.train_steps)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and run (CPU smoke test)")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"a subset of {','.join(PROVIDERS)}")
    args = parser.parse_args(argv)
    providers = tuple(args.providers.split(","))
    if not set(providers) <= set(PROVIDERS):
        parser.error(f"--providers: expected names from {PROVIDERS}, got {args.providers!r}")
    setup = TINY if args.tiny else Setup(train_steps=args.train_steps)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def progress(line: str) -> None:
        print(line, flush=True)

    start = time.monotonic()
    model, losses = train(setup, device, progress)
    training_s = time.monotonic() - start
    images, dispatch_counts = generate(model, setup, device, progress, providers)
    rows = compare(images)
    for row in rows:
        progress(f"{row['pair']}: PSNR mean {row['mean_db']:.2f} dB, min {row['min_db']:.2f} dB, max |diff| {row['max_abs']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record = dict(setup=asdict(setup), tokens=setup.tokens, head_dim=setup.head_dim, device=device_name,
                  torch=torch.__version__, training_seconds=training_s, final_loss=sum(losses[-100:]) / len(losses[-100:]),
                  environment={k: os.environ.get(k) for k in ("RDNA_FA_FORCE", "RDNA_FA_EMULATE")},
                  dispatch_counts=dispatch_counts, losses=losses[::10], comparisons=rows)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    for name in ("exact", "8bit"):
        if name in images:
            save_grid(images[name], args.out.parent / f"{args.out.name}_{name}.png")
    plot(images, rows, losses, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
