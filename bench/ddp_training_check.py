"""Data-parallel training through the launcher: a distributed launcher starts the ranks, each runs this
script behind `python -m rdna_flash_attn.launch` (so its torch SDPA calls go through the dispatcher),
wraps a small attention model in DistributedDataParallel and takes one training step on its own batch.
The all-reduced gradients with the kernels are judged by FlashAttention-2's criterion against float64:
per parameter, within 2x the error of the same step with PyTorch's math SDPA in the input dtype.

    RDNA_FA_FORCE=1 torchrun --nproc_per_node=2 -m rdna_flash_attn.launch -m bench.ddp_training_check --out DIR

Each rank describes its own device and loads the kernels for it. With a GPU per rank the gradients are
all-reduced through NCCL; with fewer GPUs than ranks they share them (gloo, which all-reduces CUDA
tensors through the host). `--backend` overrides the choice; the JSON records what each rank saw.
Writes DIR/ddp_training_check.json; exits 1 when a gradient misses the criterion or a rank's
attention did not reach the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rdna_flash_attn
from rdna_flash_attn.dispatch import router

WIDTH, HEADS, LAYERS, TOKENS, BATCH = 256, 4, 2, 300, 2  # head dim 64; a length that is no tile multiple


class AttentionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v)  # looked up at call time: the launcher's override
        return x + self.out(attended.transpose(1, 2).flatten(2))


def model(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(*(AttentionBlock() for _ in range(LAYERS))).to(device=device, dtype=dtype)


def step_gradients(dtype: torch.dtype, device: torch.device, batch: torch.Tensor, kernels: bool) -> dict:
    """The all-reduced gradients of one step of a DDP model in `dtype`, with the kernels or math SDPA."""
    ddp = torch.nn.parallel.DistributedDataParallel(model(dtype, device))
    rdna_flash_attn.settings.disable = not kernels
    context = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    with context:
        loss = ddp(batch.to(dtype)).float().square().sum()  # a sum: float16 gradients stay clear of subnormals
        loss.backward()
    rdna_flash_attn.settings.disable = False
    return {name: p.grad.detach().double() for name, p in ddp.module.named_parameters()}


def reference_gradients(device: torch.device, batch: torch.Tensor) -> dict:
    """The same step in float64 on every rank, averaged over the ranks as DDP averages."""
    net = model(torch.float64, device)
    net(batch.double()).square().sum().backward()
    grads = {name: p.grad.detach() for name, p in net.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return grads


def judge(kernels: dict, math_sdpa: dict, reference: dict) -> list[dict]:
    rows = []
    for name, ref in reference.items():
        error, yardstick = (float((g[name] - ref).abs().max()) for g in (kernels, math_sdpa))
        floor = 1e-6 * float(ref.abs().max())
        rows.append(dict(parameter=name, error=error, math_sdpa_error=yardstick,
                         ratio=error / yardstick if yardstick else None, passed=error <= 2 * yardstick + floor))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for ddp_training_check.json")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--backend", choices=("nccl", "gloo"),
                        help="default: nccl with a GPU per rank, else gloo (NCCL cannot put two ranks on one GPU)")
    args = parser.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = args.backend or ("nccl" if torch.cuda.device_count() >= world_size else "gloo")
    dist.init_process_group(backend)
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    generator = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own batch
    batch = torch.randn(BATCH, TOKENS, WIDTH, generator=generator, device=device, dtype=torch.float64)
    rdna_flash_attn.reset_stats()
    kernels = step_gradients(dtype, device, batch, kernels=True)
    counters = rdna_flash_attn.stats()
    math_sdpa = step_gradients(dtype, device, batch, kernels=False)
    rows = judge(kernels, math_sdpa, reference_gradients(device, batch))
    verdict = router.device_verdict(device)
    library = verdict.library
    seen = dict(rank=rank, local_rank=local_rank, device=str(device), device_name=verdict.info.name,
                kernels=verdict.refusal or f"{library.artifact.target} ({library.artifact.path.name})",
                sdpa_patch_enabled=rdna_flash_attn.sdpa_patch_enabled(), stream=torch.cuda.current_stream().cuda_stream,
                counters=counters, gradients=rows)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    passed = all(r["passed"] for s in gathered for r in s["gradients"]) and all(
        s["counters"]["kernel"] > 0 and s["sdpa_patch_enabled"] for s in gathered)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        record = dict(world_size=dist.get_world_size(), backend=backend, dtype=args.dtype, torch=torch.__version__,
                      shape=dict(width=WIDTH, heads=HEADS, layers=LAYERS, tokens=TOKENS, batch=BATCH),
                      passed=passed, ranks=gathered)
        (args.out / "ddp_training_check.json").write_text(json.dumps(record, indent=1))
        for s in gathered:
            worst = max((r["ratio"] or 0.0) for r in s["gradients"])
            print(f"rank {s['rank']} on {s['device']} ({s['device_name']}): kernels {s['kernels']}, "
                  f"{s['counters']['kernel']} kernel calls, {s['counters']['fallback']} fallbacks, "
                  f"worst gradient error / math SDPA's {worst:.3f}")
        print(f"{'passed' if passed else 'FAILED'}: {args.out / 'ddp_training_check.json'}")
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
