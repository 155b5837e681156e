"""The model node on tiny SD1.5-, SD2-, SDXL- and Flux-shaped ComfyUI models, sampled by ComfyUI's
own sampler: outputs against the unpatched model, calls per path, chaining, removal, training,
old ComfyUI, and the global switch."""

from __future__ import annotations

import logging

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.config import settings

from rdna_fa_lab.hosts.comfyui_harness import MEASURED_DTYPE, OPTIONLESS_MODELS, build, counting_override, sample

# The families checked here call by call; the coverage benchmark measures the others (python -m rdna_fa_lab coverage).
OPTION_PASSING_MODELS = ["sd15", "sd2", "sdxl", "flux", "sd3"]

# The models run in float32 (ComfyUI's CPU dtype, and fast here); their attention reaches the
# kernels cast to float16 (RDNA_FA_FP32_CAST=fp16), standing in for a float16 model on a GPU. Two
# Euler steps with CFG 5 then differ from the float32 reference by float16 rounding, amplified.
LATENT_TOLERANCE = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def float16_attention():
    settings.fp32_cast = "fp16"


def unpatched_run(name):
    """(model, reference latent, attention calls per sampling) with a counting prior override."""
    calls = []
    model = build(name)
    model.model_options["transformer_options"]["optimized_attention_override"] = counting_override(calls)
    reference = sample(model, name)
    assert calls, "the tiny model has attention"
    return model, reference, len(calls)


@pytest.mark.parametrize("name", OPTION_PASSING_MODELS)
def test_patched_model_matches_and_every_call_reaches_the_kernels(name, model_node, fake_gpu):
    model, reference, attention_calls = unpatched_run(name)
    assert fake_gpu.launches == []
    (patched,) = model_node.patch(model, True, True, "original backend")
    latent = sample(patched, name)
    torch.testing.assert_close(latent, reference, **LATENT_TOLERANCE)
    assert not torch.equal(latent, reference), "the kernels' rounding differs from ComfyUI's CPU attention"
    assert len(fake_gpu.launches) == attention_calls
    assert rdna_flash_attn.stats() == {"kernel": attention_calls, "kernel_8bit": 0, "fallback": 0,
                                       "fallback_reasons": {}, "exact_not_8bit_reasons": {}}
    # the prior (counting) override saw every call of both runs: it was chained, not replaced
    prior = patched.model_options["transformer_options"]["optimized_attention_override"]._rdna_flash_attn_previous
    assert prior is model.model_options["transformer_options"]["optimized_attention_override"]


@pytest.mark.parametrize("name", OPTIONLESS_MODELS)
def test_calls_made_without_the_models_options_reach_the_kernels_while_it_runs(name, model_node, fake_gpu):
    attention_calls = OPTIONLESS_MODELS[name]
    dtype = MEASURED_DTYPE.get(name, torch.float32)  # calls marked low_precision_attention=False: a bf16 model
    model = build(name, dtype=dtype)
    reference = sample(model, name)
    assert fake_gpu.launches == []
    (patched,) = model_node.patch(model, True, True, "original backend")
    latent = sample(patched, name)
    # This random model's latents reach ~900: float16 attention rounding alone moves them by ~4e-4 of that;
    # a bfloat16 model's own rounding (8x float16's) by ~2e-3 of its latents' largest.
    relative = 1e-2 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(latent, reference, atol=relative * float(reference.abs().max()), rtol=0)
    assert rdna_flash_attn.stats() == {"kernel": attention_calls, "kernel_8bit": 0, "fallback": 0,
                                       "fallback_reasons": {}, "exact_not_8bit_reasons": {}}
    # the unpatched model, sampled after, runs ComfyUI's attention: the routing lasts a routed model's call
    assert torch.equal(sample(model, name), reference)
    assert len(fake_gpu.launches) == attention_calls
    (removed,) = model_node.patch(patched, False, True, "original backend")
    assert torch.equal(sample(removed, name), reference)
    assert len(fake_gpu.launches) == attention_calls


def test_attention_run_while_comfyui_prepares_the_conditioning_is_routed(model_node, fake_gpu, monkeypatch):
    """LTX-2's text connectors and MiniMax H3's token refiner run in the model's extra_conds, once per sampling and
    outside any model call, passing their blocks' empty options: routed while the routed model samples, only then."""
    from comfy.ldm.modules import attention

    model, reference, attention_calls = unpatched_run("sd15")
    (patched,) = model_node.patch(model, True, True, "original backend")
    original_extra_conds = patched.model.extra_conds  # the model both clones share
    conditioning_calls = []

    def extra_conds(**kwargs):
        q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(len(conditioning_calls)))
        conditioning_calls.append(attention.optimized_attention(q, q, q, 2, skip_reshape=True, skip_output_reshape=True,
                                                                transformer_options={}))
        return original_extra_conds(**kwargs)

    monkeypatch.setattr(patched.model, "extra_conds", extra_conds)
    torch.testing.assert_close(sample(patched, "sd15"), reference, **LATENT_TOLERANCE)
    routed_calls = len(conditioning_calls)
    assert routed_calls > 0 and len(fake_gpu.launches) == attention_calls + routed_calls
    sample(model, "sd15")  # the unrouted clone: its conditioning's attention stays with ComfyUI
    assert len(conditioning_calls) == 2 * routed_calls and len(fake_gpu.launches) == attention_calls + routed_calls

@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_without_a_usable_gpu_the_original_backend_runs_bit_for_bit(name, model_node):
    model, reference, attention_calls = unpatched_run(name)
    (patched,) = model_node.patch(model, True, True, "original backend")
    assert torch.equal(sample(patched, name), reference)
    stats = rdna_flash_attn.stats()
    assert stats["kernel"] == 0 and stats["fallback"] == attention_calls


def test_input_model_and_removed_node_are_untouched(model_node, fake_gpu):
    model, reference, _ = unpatched_run("sd15")
    (patched,) = model_node.patch(model, True, True, "original backend")
    assert torch.equal(sample(model, "sd15"), reference) and fake_gpu.launches == []
    (disabled,) = model_node.patch(patched, False, True, "original backend")
    assert torch.equal(sample(disabled, "sd15"), reference) and fake_gpu.launches == []
    prior = model.model_options["transformer_options"]["optimized_attention_override"]
    assert disabled.model_options["transformer_options"]["optimized_attention_override"] is prior


def _denoiser_grads(patcher, seed=4):
    """Gradients of a loss through the diffusion model itself, as a LoRA trainer takes them."""
    diffusion_model = patcher.model.diffusion_model
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=generator).requires_grad_()
    context = torch.randn(2, 7, 32, generator=generator)
    timesteps = torch.tensor([10.0, 500.0])
    out = diffusion_model(x, timesteps, context=context,
                          transformer_options=dict(patcher.model_options["transformer_options"]))
    out.square().mean().backward()
    return x.grad


@pytest.mark.parametrize("use_for_training", [True, False])
def test_backward_through_the_patched_unet(use_for_training, model_node, fake_gpu):
    model = build("sd15")
    reference = _denoiser_grads(model)
    (patched,) = model_node.patch(model, True, use_for_training, "original backend")
    grads = _denoiser_grads(patched)
    torch.testing.assert_close(grads, reference, atol=5e-2 * float(reference.abs().max()), rtol=0.1)
    attention_calls = 14  # 7 transformer blocks x (self + cross attention)
    assert fake_gpu.differentiable_launches == (attention_calls if use_for_training else 0)
    assert fake_gpu.launches == []


def test_old_comfyui_gets_replace_patches(model_node, node_package, fake_gpu, monkeypatch):
    from comfy.ldm.modules import attention

    model, reference, attention_calls = unpatched_run("sd15")
    monkeypatch.delattr(attention, "wrap_attn")  # what ComfyUI before 2025-09 lacks
    (patched,) = model_node.patch(model, True, True, "original backend")
    patches = patched.model_options["transformer_options"]["patches_replace"]
    assert len(patches["attn1"]) == len(patches["attn2"]) == 7
    torch.testing.assert_close(sample(patched, "sd15"), reference, **LATENT_TOLERANCE)
    assert len(fake_gpu.launches) == attention_calls


def foreign_replace_patch(calls: list):
    """Another node's attn replace patch (IPAdapter-like): ComfyUI's own attention, recorded."""

    def patch(q, k, v, extra_options):
        from comfy.ldm.modules.attention import optimized_attention

        calls.append(q.shape)
        return optimized_attention(q, k, v, extra_options["n_heads"], attn_precision=extra_options["attn_precision"])

    return patch


@pytest.fixture
def old_comfyui(monkeypatch):
    from comfy.ldm.modules import attention

    monkeypatch.delattr(attention, "wrap_attn")  # what ComfyUI before 2025-09 lacks


def with_foreign_patches(model, node_package, calls):
    """A clone of `model` with another node's replace patches on attn2 of the first UNet block
    (ComfyUI's (name, number, index) key) and attn1 of the second ((name, number) key)."""
    blocks = list(node_package.model_patch._unet_transformer_blocks(model.model.diffusion_model))
    foreign = model.clone()
    foreign.set_model_attn2_replace(foreign_replace_patch(calls), *blocks[0])
    foreign.set_model_attn1_replace(foreign_replace_patch(calls), *blocks[1][:2])
    return foreign, blocks


def test_old_comfyui_leaves_other_nodes_replace_patches_in_place(old_comfyui, model_node, node_package, fake_gpu,
                                                                 log_records):
    model, reference, attention_calls = unpatched_run("sd15")
    foreign_calls = []
    foreign, blocks = with_foreign_patches(model, node_package, foreign_calls)
    for _ in range(2):
        (patched,) = model_node.patch(foreign, True, True, "original backend")
    patches = patched.model_options["transformer_options"]["patches_replace"]
    assert patches["attn2"][blocks[0]] is foreign.model_options["transformer_options"]["patches_replace"]["attn2"][blocks[0]]
    assert blocks[1] not in patches["attn1"] and blocks[1][:2] in patches["attn1"]
    ours = [key for slot in ("attn1", "attn2") for key, patch in patches[slot].items()
            if hasattr(patch, node_package.model_patch.OVERRIDE_MARK)]
    assert len(ours) == 2 * len(blocks) - 2
    torch.testing.assert_close(sample(patched, "sd15"), reference, **LATENT_TOLERANCE)
    assert foreign_calls and len(fake_gpu.launches) == attention_calls - len(foreign_calls)
    kept = [r.getMessage() for r in log_records.records if "another node's replace patch" in r.getMessage()]
    assert len(kept) == 1 and "attn2 input 1.0" in kept[0] and "attn1 input 3.0" in kept[0]


@pytest.mark.parametrize("foreign_patches", [False, True])
def test_old_comfyui_disable_removes_only_our_replace_patches(foreign_patches, old_comfyui, model_node, node_package,
                                                               fake_gpu):
    model = build("sd15")
    source = with_foreign_patches(model, node_package, [])[0] if foreign_patches else model
    (patched,) = model_node.patch(source, True, True, "original backend")
    (disabled,) = model_node.patch(patched, False, True, "original backend")
    source_options = source.model_options["transformer_options"]
    assert disabled.model_options["transformer_options"].get("patches_replace") == source_options.get("patches_replace")
    assert torch.equal(sample(disabled, "sd15"), sample(source, "sd15")) and fake_gpu.launches == []
    assert "patches_replace" in patched.model_options["transformer_options"]  # the patched clone keeps its own


@pytest.mark.parametrize("unsupported_calls", ["original backend", "pytorch attention"])
def test_old_comfyui_replace_patches_honour_unsupported_calls(unsupported_calls, old_comfyui, model_node, monkeypatch):
    from comfy.ldm.modules import attention

    model, reference, attention_calls = unpatched_run("sd15")  # on the CPU: every call falls back
    pytorch_calls = []
    original_pytorch = attention.attention_pytorch

    def pytorch_spy(*args, **kwargs):
        pytorch_calls.append(args[0].shape)
        return original_pytorch(*args, **kwargs)

    monkeypatch.delattr(attention, "get_attention_function")  # nor this registry
    monkeypatch.setattr(attention, "attention_pytorch", pytorch_spy)
    (patched,) = model_node.patch(model, True, True, unsupported_calls)
    latent = sample(patched, "sd15")
    if unsupported_calls == "original backend":
        assert torch.equal(latent, reference) and pytorch_calls == []
    else:
        torch.testing.assert_close(latent, reference, atol=1e-4, rtol=1e-4)
        assert len(pytorch_calls) == attention_calls
    assert rdna_flash_attn.stats()["fallback"] == attention_calls


def test_global_switch_routes_new_models_and_is_undone(node_package, fake_gpu, monkeypatch):
    reference = sample(build("sdxl"), "sdxl")
    monkeypatch.setenv(node_package.global_switch.GLOBAL_ENV, "1")
    assert node_package.global_switch.enable_from_environment()
    routed = build("sdxl")
    torch.testing.assert_close(sample(routed, "sdxl"), reference, **LATENT_TOLERANCE)
    launches = len(fake_gpu.launches)
    assert launches > 0
    node_package.disable_global()
    assert torch.equal(sample(routed, "sdxl"), reference)  # the override left behind passes through
    assert torch.equal(sample(build("sdxl"), "sdxl"), reference)
    assert len(fake_gpu.launches) == launches


def test_global_switch_bad_value_is_off_with_one_warning(node_package, monkeypatch, log_records):
    monkeypatch.setenv(node_package.global_switch.GLOBAL_ENV, "maybe")
    assert not node_package.global_switch.enable_from_environment()
    assert not node_package.global_switch.enable_from_environment()
    assert not node_package.global_enabled()
    (record,) = [r for r in log_records.records if r.levelno == logging.WARNING]
    assert "ignoring RDNA_FA_COMFYUI_GLOBAL='maybe'" in record.getMessage()
    assert record.getMessage().endswith("using 0 instead")


def test_the_nodes_attention_precision_reaches_the_dispatcher(model_node, fake_gpu):
    """8-bit QK+PV asked for by the node (not by settings), on an RDNA3 GPU: every call runs exact and
    says why; the option lasts the patched model's calls only."""
    model, reference, attention_calls = unpatched_run("sdxl")
    (patched,) = model_node.patch(model, True, True, "original backend", "8-bit QK+PV (RDNA4)")
    torch.testing.assert_close(sample(patched, "sdxl"), reference, **LATENT_TOLERANCE)
    reason = "8-bit attention needs RDNA4 (gfx12); gfx1100 has no faster 8-bit matrix rate"
    assert rdna_flash_attn.stats()["exact_not_8bit_reasons"] == {reason: attention_calls}
    assert settings.precision == "exact"
    (exact,) = model_node.patch(model, True, True, "original backend", "exact")
    sample(exact, "sdxl")
    assert rdna_flash_attn.stats()["kernel"] == 2 * attention_calls
    assert rdna_flash_attn.stats()["exact_not_8bit_reasons"] == {reason: attention_calls}
