"""yunchang's own ring and Ulysses attention on 2 CPU processes (gloo), with `flash_attn` resolving to our
stand-in: `python -m tests.sequence_parallel.yunchang_ranks RESULTS.pt` (PYTHONPATH: the repository and
the stand-in's folder). Each rank holds its slice of the sequence; rank 0 gathers every output and
gradient and saves them, beside the full inputs, for tests/sequence_parallel/test_yunchang.py to compare
with one attention over the whole sequence."""

from __future__ import annotations

import os
import sys
import tempfile

import flash_attn
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yunchang
from yunchang import UlyssesAttention, ring_flash_attn_func
from yunchang.kernels import AttnType

WORLD = 2
SHAPE = (1, 64, 4, 32)  # (batch, tokens, heads, head dim): yunchang's layout
DTYPE = torch.bfloat16  # yunchang's ring backward returns dq in bfloat16 whatever the inputs


def full_inputs(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator).to(DTYPE) for _ in range(4)]


def gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 1)


def run(function: str, causal: bool, q, k, v, dout, rank: int) -> dict:
    """This rank's slice through yunchang's `function`, forward and backward; every rank's, gathered."""
    rows = slice(rank * SHAPE[1] // WORLD, (rank + 1) * SHAPE[1] // WORLD)
    leaves = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
    if function == "ring":
        out = ring_flash_attn_func(*leaves, causal=causal, group=dist.group.WORLD, attn_type=AttnType.FA)
    else:
        attention = UlyssesAttention(dist.group.WORLD, scatter_idx=2, gather_idx=1, attn_type=AttnType.FA)
        out = attention(*leaves, causal=causal)
    out.backward(dout[:, rows])
    return {"out": gathered(out.detach()), **{name: gathered(leaf.grad) for name, leaf in zip("qkv", leaves)}}


def rank_main(rank: int, store_path: str, results_path: str, seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    q, k, v, dout = full_inputs(seed)
    results = {(function, causal): run(function, causal, q, k, v, dout, rank)
               for function in ("ring", "ulysses") for causal in (False, True)}
    if rank == 0:
        torch.save({"inputs": (q, k, v, dout), "results": results, "flash_attn": flash_attn.__file__,
                    "flash_attn_version": flash_attn.__version__, "yunchang": yunchang.__version__}, results_path)
    dist.destroy_process_group()


def main() -> None:
    results_path, seed = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(os.path.join(folder, "store"), results_path, seed), nprocs=WORLD)


if __name__ == "__main__":
    main()
