"""A short LoRA training run of a diffusers UNet with SD1.5's attention layout, once with attention
through rdna_flash_attn (forward and backward kernels) and once through PyTorch SDPA: same seed,
same data. Writes the two loss curves, the final LoRA weights' difference, JSON and a PNG.

    RDNA_FA_FORCE=1 python bench/lora_training.py --out bench/results --steps 20

On NVIDIA the kernels run through the gfx11 emulation (RDNA_FA_EMULATE=gfx12 for the other layer):
the numbers are about correctness, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rdna_flash_attn  # noqa: E402


def sd15_unet():
    """SD1.5's UNet layout (8 heads; head dims 40, 80, 160; 768-dim text context), one layer per block
    to keep the run short, randomly initialised."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8, cross_attention_dim=768,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))


def train(route_through_kernels: bool, steps: int, seed: int) -> dict:
    from peft import LoraConfig

    torch.manual_seed(seed)
    unet = sd15_unet().cuda()
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-3)
    data = torch.Generator(device="cuda").manual_seed(seed + 1)
    latents = torch.randn(steps, 1, 4, 64, 64, device="cuda", generator=data)  # 512 px
    noise = torch.randn(steps, 1, 4, 64, 64, device="cuda", generator=data)
    context = torch.randn(steps, 1, 77, 768, device="cuda", generator=data)
    timesteps = torch.randint(0, 1000, (steps, 1), device="cuda", generator=data)

    rdna_flash_attn.reset_stats()
    losses = []
    start = time.perf_counter()
    with rdna_flash_attn.patch_sdpa() if route_through_kernels else contextlib.nullcontext():
        for step in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                prediction = unet(latents[step] + noise[step], timesteps[step], context[step]).sample
            loss = torch.nn.functional.mse_loss(prediction.float(), noise[step])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    torch.cuda.synchronize()
    return dict(losses=losses, seconds=time.perf_counter() - start, stats=rdna_flash_attn.stats(),
                lora=[p.detach().float().clone() for p in lora])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    kernels = train(True, args.steps, args.seed)
    sdpa = train(False, args.steps, args.seed)
    weight_diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(kernels["lora"], sdpa["lora"]))
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(kernels["losses"], sdpa["losses"]))
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, steps=args.steps,
        kernels_losses=kernels["losses"], sdpa_losses=sdpa["losses"], max_relative_loss_difference=loss_diff,
        max_relative_lora_weight_difference=weight_diff, kernel_calls=kernels["stats"],
        seconds=dict(kernels=kernels["seconds"], sdpa=sdpa["seconds"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_training.json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(sdpa["losses"], label="PyTorch SDPA", linewidth=3, alpha=0.5)
    axis.plot(kernels["losses"], label="rdna_flash_attn (emulated)", linestyle="--")
    axis.set(xlabel="step", ylabel="MSE loss", title=f"SD1.5-layout UNet LoRA, 512 px, {result['device']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "lora_training.png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_losses")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
