"""Forge, reForge and Forge Classic as hosts, in this process: tiny random-weight models built from the
model code of a WebUI folder on this machine (Forge's `backend.nn`, or the `ldm_patched` of reForge and
Forge Classic), and this repository's WebUI extension's routing put in place as its adapter for that
WebUI does at start and at each model load (`extension.forge.rebind`, `extension.reforge.rebinding` and
`route_vae_blocks`). Used by the coverage benchmark (rdna_fa_lab/coverage.py).

The WebUI's own argument module is imported with PyTorch attention chosen (`--attention-pytorch`: its
attention then ends in PyTorch's SDPA, which the benchmark counts) and, on the CPU, `--always-cpu`;
nothing else of the WebUI starts (no Gradio, no settings, no sampler): each family's model is called
once, directly, on a CFG batch of 2. The tiny configs are ComfyUI's (comfyui_harness.MODELS), which
these WebUIs' model classes share, keeping the settings each class's constructor takes.

What it does not have: the WebUI's `modules` (settings, callbacks, scripts, sampler), so the
extension's own start (`setup`, which reads the settings and registers callbacks) is not run; masked
calls other than Flux's style-model bias, handed to the model as the WebUI's conditioning would hand
it (its text encoders and nodes, which make the others, are absent here); families a WebUI's folder
does not hold are skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import comfyui_harness
from .comfyui_harness import TEXT_WIDTH, initialise, put_first_on_path
from .host_code import extension_module

VAE = "vae"
# flux_masked: Flux with a style model's attention bias, a (B, L, L) float mask, where the WebUI's Flux
# takes one (reForge's, as ComfyUI's, from the conditioning's "attention_mask")
MASKED_VARIANTS = {"flux_masked": "flux"}
FAMILIES = ("sd15", "sdxl", "flux", "flux_masked", "chroma", "sd3", VAE)
TIMESTEP = {"sd15": 500.0, "sdxl": 500.0, "sd3": 500.0, "flux": 0.5, "chroma": 0.5}  # the model's own scale
LATENT = 16  # latent height and width
TEXT_TOKENS = 7
VAE_CHANNELS = (32, 64)


@dataclass(frozen=True)
class WebUI:
    name: str  # "Forge", "reForge", "Forge Classic"
    folder: Path
    args_module: str  # the WebUI's command-line arguments, read by its memory management at import
    adapter: str  # the extension's module for this WebUI
    classes: dict  # family -> "module:Class"
    operations: str | None  # ComfyUI-style layer operations the ldm_patched classes take

    @property
    def result_name(self) -> str:
        return "coverage-" + self.name.lower().replace(" ", "-")


FORGE_CLASSES = {
    "sd15": "backend.nn.unet:IntegratedUNet2DConditionModel",
    "sdxl": "backend.nn.unet:IntegratedUNet2DConditionModel",
    "flux": "backend.nn.flux:IntegratedFluxTransformer2DModel",
    "chroma": "backend.nn.chroma:IntegratedChromaTransformer2DModel",
    "sd3": "backend.nn.mmditx:MMDiTX",
    VAE: "backend.nn.vae:IntegratedAutoencoderKL",
}
LDM_PATCHED_CLASSES = {
    "sd15": "ldm_patched.ldm.modules.diffusionmodules.openaimodel:UNetModel",
    "sdxl": "ldm_patched.ldm.modules.diffusionmodules.openaimodel:UNetModel",
    "flux": "ldm_patched.ldm.flux.model:Flux",
    "chroma": "ldm_patched.ldm.chroma.model:Chroma",
    "sd3": "ldm_patched.ldm.modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper",
    VAE: "ldm_patched.ldm.modules.diffusionmodules.model:Decoder",
}
# Forge's Chroma takes the latent's channels (it patches them itself, as its Flux does), an unused pooled
# width, and names its guidance approximator's sizes differently from ComfyUI's (in_dim, hidden_dim ...)
FORGE_SETTINGS = {"chroma": dict(in_channels=16, vec_in_dim=TEXT_WIDTH, guidance_out_dim=64, guidance_hidden_dim=64,
                                 guidance_n_layers=2)}
FORGE_VAE = dict(block_out_channels=VAE_CHANNELS, down_block_types=("DownEncoderBlock2D",) * 2,
                 up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4)
LDM_DECODER = dict(ch=VAE_CHANNELS[0], out_ch=3, ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0,
                   in_channels=3, resolution=64, z_channels=4, double_z=True)


CLASSIC_VERSION = re.compile(r"""^version\s*=\s*["']classic["']""", re.MULTILINE)


class NotAWebUI(Exception):
    """The folder holds none of the WebUIs this harness knows."""


def detect(folder: Path) -> WebUI:
    """Which WebUI `folder` holds: Forge (`backend/attention.py`), or reForge / Forge Classic
    (`ldm_patched`; Forge Classic names itself "classic" in modules_forge/forge_version.py)."""
    if (folder / "backend" / "attention.py").is_file():
        return WebUI("Forge", folder, "backend.args", "forge", FORGE_CLASSES, None)
    if (folder / "ldm_patched" / "ldm" / "modules" / "attention.py").is_file():
        version = folder / "modules_forge" / "forge_version.py"
        classic = version.is_file() and CLASSIC_VERSION.search(version.read_text(encoding="utf-8")) is not None
        return WebUI("Forge Classic" if classic else "reForge", folder, "ldm_patched.modules.args_parser", "reforge",
                     LDM_PATCHED_CLASSES, "ldm_patched.modules.ops:disable_weight_init")
    raise NotAWebUI(f"{folder} holds no Forge (backend/attention.py), reForge or Forge Classic (ldm_patched/)")


def start(webui: WebUI, cpu: bool) -> None:
    """Put the WebUI's folder first on sys.path and set its arguments before its memory management
    reads them. Its start-up prints go to stderr, keeping stdout for the benchmark's table."""
    put_first_on_path(webui.folder)
    with contextlib.redirect_stdout(sys.stderr):
        arguments = importlib.import_module(webui.args_module).args
        arguments.attention_pytorch = True
        arguments.always_cpu = cpu


def _object(path: str):
    module, name = path.split(":")
    with contextlib.redirect_stdout(sys.stderr):
        return getattr(importlib.import_module(module), name)


def available_families(webui: WebUI) -> list[str]:
    """The families whose model code the WebUI's folder holds (Forge Classic has no Flux, Chroma or SD3),
    the masked variants where that code takes the mask."""
    return [family for family in FAMILIES if _source(webui, family).is_file()
            and (family not in MASKED_VARIANTS or "attention_mask" in _source(webui, family).read_text(encoding="utf-8"))]


def _source(webui: WebUI, family: str) -> Path:
    module = webui.classes[MASKED_VARIANTS.get(family, family)].split(":")[0]
    return webui.folder.joinpath(*module.split(".")).with_suffix(".py")


def _settings(webui: WebUI, family: str, model_class) -> dict:
    """ComfyUI's tiny config for `family`, with the settings the WebUI's class takes."""
    if family == VAE:
        return dict(FORGE_VAE if webui.operations is None else LDM_DECODER)
    _, _, extra, config, _, _ = comfyui_harness.MODELS[family]
    settings = {**config, **extra, **(FORGE_SETTINGS.get(family, {}) if webui.operations is None else {})}
    parameters = inspect.signature(model_class).parameters
    if webui.operations is not None and "operations" in parameters:
        settings["operations"] = _object(webui.operations)
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return {key: value for key, value in settings.items() if key != "image_model"}
    return {key: value for key, value in settings.items() if key in parameters}


def build(webui: WebUI, family: str, device: torch.device) -> nn.Module:
    family = MASKED_VARIANTS.get(family, family)
    model_class = _object(webui.classes[family])
    with contextlib.redirect_stdout(sys.stderr):
        model = model_class(**_settings(webui, family, model_class))
    initialise(model)  # every weight random: the WebUIs create some layers uninitialised, zero others
    # SD3's position embedding is a buffer its checkpoint fills (created empty)
    pos_embed = getattr(model, "pos_embed", None)
    if isinstance(pos_embed, torch.Tensor) and not isinstance(pos_embed, nn.Parameter):
        with torch.no_grad():
            pos_embed.copy_(torch.randn(pos_embed.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return model.eval().to(device)


def run(model: nn.Module, family: str, device: torch.device) -> torch.Tensor:
    """One call as the WebUI's sampler makes it: the model on a CFG batch of 2 (a 16 x 16 latent, 7
    text tokens, the pooled/label vector the family takes), or the VAE decoder on one 16 x 16 latent."""
    generator = torch.Generator().manual_seed(5)
    if family == VAE:
        latent = torch.randn(1, 4, LATENT, LATENT, generator=generator).to(device)
        return model.decode(latent) if hasattr(model, "decode") else model(latent)
    masked, family = family in MASKED_VARIANTS, MASKED_VARIANTS.get(family, family)
    channels = comfyui_harness.MODELS[family][4]
    latent = torch.randn(2, channels, LATENT, LATENT, generator=generator).to(device)
    context = torch.randn(2, TEXT_TOKENS, TEXT_WIDTH, generator=generator).to(device)
    timestep = torch.full((2,), TIMESTEP[family], device=device)
    extra = {}
    if family == "sdxl":
        extra["y"] = torch.randn(2, comfyui_harness.MODELS[family][3]["adm_in_channels"], generator=generator)
    elif family in ("flux", "sd3"):
        extra["y"] = torch.randn(2, TEXT_WIDTH, generator=generator)
    elif family == "chroma":
        extra["guidance"] = torch.zeros(2)
    if masked:
        bias = comfyui_harness.style_bias(TEXT_TOKENS, (LATENT // 2) ** 2, generator)
        extra["attention_mask"] = bias.expand(2, -1, -1)  # the CFG batch's two conditionings carry it
    return model(latent, timestep, context=context, **{k: v.to(device) for k, v in extra.items()})


@contextlib.contextmanager
def routed(webui: WebUI, model: nn.Module):
    """The extension's routing in place as its adapter puts it there (at start and at each model
    load), and the WebUI's own functions back afterwards."""
    adapter = extension_module(webui.adapter)
    if webui.adapter == "forge":
        adapter.rebind()
    else:
        adapter.rebinding.apply()
        adapter.route_vae_blocks(model)
    try:
        yield
    finally:
        adapter.restore()
