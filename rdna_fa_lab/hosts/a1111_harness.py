"""A1111's model code as a host, in this process: tiny random-weight SD1.5- and SD2-config UNets and
the SD VAE decoder from `ldm` (A1111's Stable Diffusion repository, as the stable-diffusion-sdkit
package ships it), where `sgm` is importable (Stability AI's generative-models, which A1111 clones
into repositories/generative-models for SDXL) an SDXL-config UNet and SDXL's VAE decoder from it, and
this repository's WebUI extension's forwards installed on ldm's and sgm's classes as A1111 installs an
optimization (`extension.a1111.ForwardPatch`, with no hypernetwork and no upcast). Used by the
coverage benchmark (rdna_fa_lab/coverage.py).

What it does not have: A1111's own modules (its sampler, hypernetworks, settings, SD3's
`modules.models.sd3`); no package CI installs ships `sgm`.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import nn

from .comfyui_harness import initialise
from .host_code import cross_attention_flops, extension_module

TEXT_WIDTH = 32
TEXT_TOKENS = 77
UNET_COMMON = dict(image_size=32, in_channels=4, out_channels=4, model_channels=64, attention_resolutions=[2, 1],
                   num_res_blocks=1, channel_mult=[1, 2], use_spatial_transformer=True, transformer_depth=1,
                   context_dim=TEXT_WIDTH, use_checkpoint=False, legacy=False)
UNETS = {
    # SD1.5: 8 heads whose dim doubles per level (8 x 8, 8 x 16 here; 8 x 40 ... 8 x 160 for real)
    "sd15": dict(UNET_COMMON, num_heads=8),
    # SD2.x: head dim 64 (1 and 2 heads here; 5 to 20 for real), linear projections
    "sd2": dict(UNET_COMMON, num_heads=-1, num_head_channels=64, use_linear_in_transformer=True),
}
VAE = "vae"
DECODER = dict(ch=32, out_ch=3, ch_mult=[1, 2], num_res_blocks=1, attn_resolutions=[], dropout=0.0, in_channels=3,
               resolution=64, z_channels=4, double_z=True)
FAMILIES = (*UNETS, VAE)
# SDXL as A1111 builds it from sgm (its sd_xl_base.yaml, scaled down): head dim 64, no attention at the
# first level, label vector, the "softmax-xformers" attention type (plain CrossAttention once xformers is
# switched off, as A1111 does in build())
SDXL_VAE = "sdxl_vae"
SGM_UNETS = {"sdxl": dict(in_channels=4, out_channels=4, model_channels=64, attention_resolutions=[2], num_res_blocks=1,
                          channel_mult=[1, 2], num_head_channels=64, use_linear_in_transformer=True,
                          transformer_depth=[1, 2], context_dim=TEXT_WIDTH, num_classes="sequential",
                          adm_in_channels=64, spatial_transformer_attn_type="softmax-xformers",
                          use_spatial_transformer=True, legacy=False)}  # the last two: older sgm only
SGM_FAMILIES = (*SGM_UNETS, SDXL_VAE)
RELEASED = {SDXL_VAE: VAE}  # whose released head dims a family has


# What A1111's ldm model code imports beyond torch when a model is built (its UNet reads omegaconf's
# ListConfig), and the package that brings each.
LDM_REQUIREMENTS = {"omegaconf": "omegaconf"}


def ldm_available() -> bool:
    return importlib.util.find_spec("ldm") is not None


def missing_requirements() -> list[str]:
    """The pip packages of LDM_REQUIREMENTS that cannot be imported here."""
    missing = []
    for module, package in LDM_REQUIREMENTS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
            found = False
        if not found:
            missing.append(package)
    return missing


def sgm_available() -> bool:
    return importlib.util.find_spec("sgm") is not None


def families() -> tuple[str, ...]:
    return (*FAMILIES, *(SGM_FAMILIES if sgm_available() else ()))


def extension_modules():
    """This repository's WebUI extension's (a1111, ldm_attention) modules."""
    return extension_module("a1111"), extension_module("ldm_attention")


def build(family: str, device: torch.device) -> nn.Module:
    if family in SGM_FAMILIES:
        import sgm.modules.attention
        from sgm.modules.diffusionmodules.model import Decoder
        from sgm.modules.diffusionmodules.openaimodel import UNetModel

        # as A1111 sets them (modules/sd_models_xl.py): the vanilla CrossAttention its optimizations replace
        sgm.modules.attention.SDP_IS_AVAILABLE = True
        sgm.modules.attention.XFORMERS_IS_AVAILABLE = False

        if family == SDXL_VAE:
            model = Decoder(**DECODER)
        else:  # the settings this sgm's UNet takes (A1111 pins a 2023 one; newer ones dropped two)
            accepted = inspect.signature(UNetModel).parameters
            model = UNetModel(**{key: value for key, value in SGM_UNETS[family].items() if key in accepted})
    else:
        from ldm.modules.diffusionmodules.model import Decoder
        from ldm.modules.diffusionmodules.openaimodel import UNetModel

        model = Decoder(**DECODER) if family == VAE else UNetModel(**UNETS[family])
    initialise(model)  # every weight random: ldm zero-initialises its output layers, which would hide attention
    return model.eval().to(device)


def run(model: nn.Module, family: str, device: torch.device) -> torch.Tensor:
    """One call as A1111 makes it: the UNet on a CFG batch of 2 (latent 16 x 16, 77 text tokens, SDXL's
    label vector), or the decoder on a 16 x 16 latent."""
    generator = torch.Generator().manual_seed(5)
    if family in (VAE, SDXL_VAE):
        return model(torch.randn(1, 4, 16, 16, generator=generator).to(device))
    latent = torch.randn(2, 4, 16, 16, generator=generator).to(device)
    context = torch.randn(2, TEXT_TOKENS, TEXT_WIDTH, generator=generator).to(device)
    extra = {}
    if family in SGM_UNETS:
        extra["y"] = torch.randn(2, SGM_UNETS[family]["adm_in_channels"], generator=generator).to(device)
    return model(latent, timesteps=torch.tensor([500, 500], device=device), context=context, **extra)


def attention_flops_of_call(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """The attention FLOPs (4 * batch * queries * keys * inner width) of a CrossAttention or AttnBlock
    call, from its inputs, whichever forward then runs."""
    x = args[0]
    if x.dim() == 4:  # AttnBlock: one head over the channels
        tokens = x.shape[2] * x.shape[3]
        return 4 * x.shape[0] * tokens * tokens * x.shape[1]
    return cross_attention_flops(module, args, kwargs)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's CrossAttention and AttnBlock modules, ldm's and (where importable) sgm's."""
    from ldm.modules.attention import CrossAttention
    from ldm.modules.diffusionmodules.model import AttnBlock

    classes = [CrossAttention, AttnBlock]
    if sgm_available():
        from sgm.modules.attention import CrossAttention as SgmCrossAttention
        from sgm.modules.diffusionmodules.model import AttnBlock as SgmAttnBlock

        classes += [SgmCrossAttention, SgmAttnBlock]
    return [m for m in model.modules() if isinstance(m, tuple(classes))]
