"""Fixtures for the suite's CPU tests: a recorded-run JSON as the GPU run writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import design_targets, suite
from rdna_flash_attn.tools.benchmark import Shape, memory_growth

REPO = Path(__file__).resolve().parents[2]


def kernel_row(shape: Shape, provider: str, pass_: str, ms: float, peak: float | None, error=None) -> dict:
    return dict(shape=shape.name, name=shape.name, batch=shape.batch, heads=shape.heads, q_tokens=shape.q_tokens,
                k_tokens=shape.k_tokens, head_dim=shape.head_dim, provider=provider, **{"pass": pass_},
                linear_mib=shape.linear_bytes(pass_, 2) / 2**20, scores_mib=shape.scores_bytes(2) / 2**20,
                ms=None if error else ms, tflops=None if error else shape.flops(pass_) / ms / 1e9,
                peak_extra_mib=None if error else peak, error=error)


def generation_row(config: str, provider: str, it_s: float | None, peak_gib: float | None, skipped=None) -> dict:
    batch = int(config.split()[-1])
    return dict(part="generation", config=config, model=config.split()[0], width=1024, height=1024, batch=batch,
                unet_batch=2 * batch, provider=provider, steps=4, attention_tflop_per_step=3.9, it_per_s=it_s,
                seconds=None if it_s is None else 4 / it_s,
                peak_allocated_mib=None if peak_gib is None else peak_gib * 1024, peak_reserved_mib=None,
                peak_above_weights_mib=None, weights_mib=1640.0, finite=True, attention_calls=None, skipped=skipped)


@pytest.fixture
def recorded_run() -> dict:
    """A small suite JSON shaped like the H100 run with kernels through the emulation."""
    self_4096 = Shape("sd15-self-4096", 2, 8, 4096, 4096, 40)
    sweep = [Shape(f"sweep-self-{n}", 1, 10, n, n, 64) for n in (1024, 2048, 4096)]
    kernels = [kernel_row(self_4096, "rdna_fa", "forward", 3.7, self_4096.linear_bytes("forward", 2) / 2**20),
               kernel_row(self_4096, "sdpa-math", "forward", 4.0, 2344.0),
               kernel_row(self_4096, "sdpa-flash", "backward", 0.8, 41.0),
               kernel_row(self_4096, "rdna_fa", "backward", 11.0, self_4096.linear_bytes("backward", 2) / 2**20),
               kernel_row(self_4096, "sdpa-math", "backward", 0, None, error="skipped: needs ~99 GiB")]
    memory = [kernel_row(s, "rdna_fa", "forward", 1.0, s.linear_bytes("forward", 2) / 2**20) for s in sweep]
    memory += [kernel_row(s, "sdpa-math", "forward", 1.0, s.scores_bytes(2) * 4.6 / 2**20) for s in sweep]
    generation = [generation_row("sd15 1024x1024 batch 1", "rdna_fa", 2.0, 3.1),
                  generation_row("sd15 1024x1024 batch 1", "sdpa-math", 1.9, 38.6),
                  generation_row("sd15 1024x1024 batch 1", "sdpa-default", 9.0, 3.0),
                  generation_row("sd15 1024x1024 batch 4", "sdpa-math", None, None,
                                 skipped="skipped: SDPA math needs ~194 GiB (weights + Sq x Sk scores) of 79 GiB")]
    vae = [dict(part="vae", config="vae decode 1024x1024", size=1024, attention_tokens=16384, provider=p, repeats=3,
                ms=ms, peak_allocated_mib=gib * 1024, peak_above_weights_mib=None, weights_mib=160.0, finite=True,
                attention_calls=None, skipped=None)
           for p, ms, gib in (("rdna_fa", 300.0, 4.9), ("sdpa-math", 280.0, 7.5), ("diffusers-sliced", 350.0, 8.0))]
    return {
        "schema": suite.SCHEMA_VERSION,
        "meta": {"rdna_flash_attn": "0.1.0", "torch": "2.11.0+cu130", "hip": None, "cuda": "13.0",
                 "python": "3.12.3", "platform": "Linux", "device": {"backend": "cuda", "name": "NVIDIA H100 80GB HBM3",
                                                                      "index": 0, "gfx_target": None,
                                                                      "runtime_version": "13.0"},
                 "dtype": "float16", "time": "2026-11-22T06:00:00+00:00", "size": "full",
                 "kernels": {"target": "gfx11", "path": "/x/build/emu/rdna_fa_emu_gfx11.fatbin", "sha256": "ab" * 32,
                             "emulated": True},
                 "flops_convention": "forward 4*B*H*Sq*Sk*D, backward 2.5x forward",
                 "parts": ["kernels", "memory", "generation", "vae", "static"], "seconds": 400.0},
        "targets": list(design_targets.TARGETS),
        "kernels": {"rows": kernels},
        "memory": {"rows": memory, "growth": memory_growth(memory)},
        "generation": {"rows": generation, "providers": {"rdna_fa": "the kernels"}, "sampler": "Euler, 4 timed steps"},
        "vae": {"rows": vae, "providers": {"diffusers-sliced": "SlicedAttnProcessor"}},
        "static": design_targets.static_summary(REPO / "bench" / "results"),
    }


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models' thousands of small ops run tens of times slower when two
    threads contend for a busy 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
