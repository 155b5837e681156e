"""bench/generation.py and bench/vae_decode.py at tiny sizes on the CPU: the layouts against the real
diffusers models, attention through the (fake) kernels against SDPA, and the out-of-memory paths."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")

import rdna_flash_attn  # noqa: E402
from bench import generation, vae_decode  # noqa: E402
from rdna_flash_attn import settings  # noqa: E402
from rdna_flash_attn.tools import benchmark

CPU = torch.device("cpu")
TORCH_SDPA = F.scaled_dot_product_attention


def self_attention_layers(spec: generation.UNetSpec) -> list[tuple[int, int]]:
    """(heads, head dim) of every self-attention of the real diffusers model, built without memory."""
    from diffusers.models.attention_processor import Attention

    with torch.device("meta"):
        unet = generation.build_unet(spec, torch.device("meta"), torch.float16)
    return [(m.heads, m.inner_dim // m.heads) for name, m in unet.named_modules()
            if isinstance(m, Attention) and name.endswith("attn1")]


def test_layouts_have_design_section_4_heads_and_flop_count():
    sd15 = self_attention_layers(generation.SD15)
    # DESIGN.md section 4: SD1.5 8 x 40 / 8 x 80 / 8 x 160; 5 layers at each level (2 down, 3 up) + mid
    assert sorted(set(sd15)) == [(8, 40), (8, 80), (8, 160)]
    assert [sd15.count(x) for x in [(8, 40), (8, 80), (8, 160)]] == [5, 5, 6]
    sdxl = self_attention_layers(generation.SDXL)
    assert sorted(set(sdxl)) == [(10, 64), (20, 64)] and sdxl.count((10, 64)) == 10 and sdxl.count((20, 64)) == 60
    # SD1.5 at 512 px, batch 1 with CFG: 4096, 1024, 256 and 64 tokens (DESIGN.md), 4*B*S^2*channels each
    expected = sum(4.0 * 2 * tokens**2 * channels * layers
                   for tokens, channels, layers in [(4096, 320, 5), (1024, 640, 5), (256, 1280, 5), (64, 1280, 1)])
    assert generation.attention_flops_per_step(generation.Config(generation.SD15, 512, 512, 1)) == expected
    sdxl_1024 = generation.Config(generation.SDXL, 1024, 1024, 1)
    assert generation.attention_flops_per_step(sdxl_1024) == 4.0 * 2 * (4096**2 * 640 * 10 + 1024**2 * 1280 * 60)


def test_sampling_through_the_kernels_matches_sdpa(fake_gpu):
    settings.fp32_cast = "bf16"  # the CPU model runs in float32; its attention goes to the kernels in bf16
    config = generation.Config(generation.TINY_SDXL, 64, 64, 2)
    unet = generation.build_unet(config.spec, CPU, torch.float32)
    inputs = generation._inputs(config, CPU, torch.float32)
    (kernels,) = [p for p in benchmark.model_providers(CPU, print) if p.name == "rdna_fa"]
    with kernels.context(), torch.no_grad():
        through_kernels = generation.euler_sample(unet, inputs, 2)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with torch.no_grad():
        reference = generation.euler_sample(unet, inputs, 2)
    # every self- and cross-attention of both steps ran on the kernels, nothing fell back
    assert len(fake_gpu.launches) == 2 * 2 * len(self_attention_layers(config.spec))
    assert rdna_flash_attn.stats()["fallback"] == 0
    error = (through_kernels - reference).norm() / reference.norm()
    assert error < 2e-2  # bf16 attention inside a float32 model


def test_math_estimate_skips_what_cannot_fit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 24 * 2**30}))
    gpu = torch.device("cuda", 0)
    math, default = (benchmark.ModelProvider(n, "", lambda: None) for n in ("sdpa-math", "sdpa-default"))
    big = generation.Config(generation.SD15, 1024, 1024, 1)
    # 2 x 8 heads x 16384^2 scores at 12 bytes: 48 GiB, more than a 24 GiB card
    assert generation.math_score_bytes(big) == 2 * 8 * 16384**2 * 12
    reason = generation._fits(big, math, gpu, 2 * 2**30)
    assert reason.startswith("skipped: SDPA math needs ~50 GiB") and "of 24 GiB" in reason
    assert generation._fits(big, default, gpu, 2 * 2**30) is None
    assert generation._fits(generation.Config(generation.SD15, 512, 512, 1), math, gpu, 2 * 2**30) is None


def oom_provider(error: Exception) -> benchmark.ModelProvider:
    """A provider whose attention raises `error`, as an allocation failure inside SDPA would."""

    @contextlib.contextmanager
    def failing():
        def sdpa(*args, **kwargs):
            raise error
        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = TORCH_SDPA

    return benchmark.ModelProvider("failing", "raises", failing)


def test_out_of_memory_is_recorded_as_skipped_and_the_run_goes_on():
    config = generation.Config(generation.TINY_SD15, 64, 64, 1)
    default = benchmark.ModelProvider("sdpa-default", "", contextlib.nullcontext)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
    seen = []
    rows = generation.run([config], [oom_provider(error), default], CPU, torch.float32, 1,
                          lambda done, total, text: seen.append((done, total, text)))
    failed, ok = rows
    assert failed["skipped"].startswith("skipped: out of memory (CUDA out of memory. Tried to allocate 40.00 GiB")
    assert failed["it_per_s"] is None and ok["skipped"] is None and ok["it_per_s"] > 0 and ok["finite"]
    assert [s[:2] for s in seen] == [(1, 2), (2, 2)] and "out of memory" in seen[0][2]
    rows = vae_decode.run("tiny", [oom_provider(RuntimeError("HIP out of memory"))], CPU, torch.float32, 1,
                          lambda *a: None)
    assert [r["skipped"] is not None for r in rows] == [True, False, True, False]  # sliced runs its own attention
    with pytest.raises(RuntimeError, match="not a memory problem"):
        generation.run([config], [oom_provider(RuntimeError("not a memory problem"))], CPU, torch.float32, 1,
                       lambda *a: None)
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_a_model_whose_weights_do_not_fit_is_skipped(monkeypatch):
    def too_big(spec, device, dtype):
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 5.00 GiB")

    monkeypatch.setattr(generation, "build_unet", too_big)
    configs = generation.configs("tiny")
    providers = [benchmark.ModelProvider(n, "", contextlib.nullcontext) for n in ("sdpa-math", "sdpa-default")]
    rows = generation.run(configs, providers, CPU, torch.float32, 1, lambda *a: None)
    assert [(r["config"], r["provider"]) for r in rows] == [(c.name, p.name) for c in configs for p in providers]
    assert all(r["skipped"] == "skipped: the UNet's weights do not fit" and r["it_per_s"] is None for r in rows)
    normal = generation.empty_row(configs[0], providers[0], 1, 0, None)
    assert all(set(r) == set(normal) for r in rows)
