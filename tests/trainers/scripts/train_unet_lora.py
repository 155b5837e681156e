"""A small LoRA training run of a real diffusers UNet2DConditionModel (tiny config) with peft, written
as a trainer would: it knows nothing of rdna_flash_attn. Writes its losses and how many attention
layer calls it made to the JSON file given with --out.

    python train_unet_lora.py --steps 3 --out result.json [--autocast bf16] [--exit-code N]
"""

import argparse
import json
import sys

import torch
from diffusers import UNet2DConditionModel
from peft import LoraConfig


def tiny_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(16, 32), attention_head_dim=2, cross_attention_dim=16,  # 2 heads of 8 and 16
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none")
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    unet = tiny_unet()
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-3)

    attention_calls = 0

    def count(module, inputs, output):
        nonlocal attention_calls
        attention_calls += 1

    for module in unet.modules():
        if type(module).__name__ == "Attention":
            module.register_forward_hook(count)

    losses = []
    for _ in range(args.steps):
        latents = torch.randn(1, 4, 8, 8)
        noise = torch.randn(1, 4, 8, 8)
        context = torch.randn(1, 5, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            prediction = unet(latents + noise, torch.tensor([500]), context).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    with open(args.out, "w") as out:
        json.dump(dict(losses=losses, attention_calls=attention_calls, lora_tensors=len(lora),
                       argv=sys.argv, name=__name__), out)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
