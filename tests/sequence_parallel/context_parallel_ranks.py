"""torch's context parallelism (its ring templates; head-tail load balancing for the causal call) on 2 CPU
processes (gloo), each running the shipped code objects on the CPU interpreter through our serving of the
aten flash ops: `python -m tests.sequence_parallel.context_parallel_ranks RESULTS.pt SEED TARGET`. Each rank
calls `aten::_scaled_dot_product_flash_attention` on DTensors sharded along the sequence (what SDPA calls
under `context_parallel` on a GPU whose SDPA picks the flash backend; the CPU's SDPA picks another op), then
the backward; rank 0 saves the unsharded output and gradients, the full inputs and what each rank launched."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options, context_parallel_unshard

import rdna_flash_attn as rfa
from rdna_fa_lab.stand_in import stand_in_gpu
from rdna_flash_attn.integrations import aten_attention

WORLD = 2
SHAPE = (1, 2, 64, 64)  # (batch, heads, tokens, head dim)


def rank_main(rank: int, store_path: str, results_path: str, seed: int, target: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(SHAPE, generator=generator).to(torch.bfloat16) for _ in range(4)]
    results = {}
    with stand_in_gpu(target) as gpu:
        assert aten_attention.serve_aten_attention("cpu") is None
        for causal in (False, True):
            q, k, v, dout = (t.clone() for t in inputs)
            launched, rfa_calls = len(gpu.launches), rfa.stats()["kernel"]
            _cp_options.enable_load_balance = causal  # torch's head-tail balancing is for causal calls only
            with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                sharded = [DTensor.from_local(t, mesh, [Shard(2)]) for t in leaves]
                out = torch.ops.aten._scaled_dot_product_flash_attention(*sharded, is_causal=causal)[0]
                out.backward(DTensor.from_local(dout, mesh, [Shard(2)]))
                local = [out.to_local().detach(), *(leaf.grad for leaf in leaves)]
                out, dq, dk, dv = context_parallel_unshard(mesh, local, [2, 2, 2, 2])
            counts = torch.tensor([len(gpu.launches) - launched, rfa.stats()["kernel"] - rfa_calls,
                                   rfa.stats()["fallback"]])
            every = [torch.empty_like(counts) for _ in range(WORLD)]
            dist.all_gather(every, counts)
            results[causal] = {"out": out, "q": dq, "k": dk, "v": dv, "launches_kernel_calls_fallbacks": every}
    if rank == 0:
        torch.save({"inputs": inputs, "results": results}, results_path)
    dist.destroy_process_group()


def main() -> None:
    results_path, seed, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(rank_main, args=(os.path.join(folder, "store"), results_path, seed, target), nprocs=WORLD)


if __name__ == "__main__":
    main()
