"""Fake of A1111 modules/sd_hijack_optimizations.py: the SdOptimization base class, whose undo
installs what A1111's does (the hypernetwork module's einsum forward on ldm's and sgm's
CrossAttention, each AttnBlock's own forward), and one built-in optimization ("sdp") as a stand-in
for the others."""

import ldm.modules.attention
import ldm.modules.diffusionmodules.model
import sgm.modules.attention
import sgm.modules.diffusionmodules.model

from modules.hypernetworks import hypernetwork

ldm_cross_attention_forward = ldm.modules.attention.CrossAttention.forward
ldm_attn_block_forward = ldm.modules.diffusionmodules.model.AttnBlock.forward
sgm_attn_block_forward = sgm.modules.diffusionmodules.model.AttnBlock.forward


class SdOptimization:
    name = None
    label = None
    cmd_opt = None
    priority = 0

    def title(self):
        return self.name if self.label is None else f"{self.name} - {self.label}"

    def is_available(self):
        return True

    def apply(self):
        pass

    def undo(self):
        ldm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = ldm_attn_block_forward
        sgm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = sgm_attn_block_forward


calls = {"cross_attention": 0, "attn_block": 0}


def sdp_cross_attention_forward(self, x, context=None, mask=None, **kwargs):
    calls["cross_attention"] += 1
    return ldm_cross_attention_forward(self, x, context, mask)


def sdp_attn_block_forward(self, x):
    calls["attn_block"] += 1
    return ldm_attn_block_forward(self, x)


class SdOptimizationSdp(SdOptimization):
    name = "sdp"
    label = "scaled dot product"
    cmd_opt = "opt_sdp_attention"
    priority = 70

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = sdp_cross_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = sdp_attn_block_forward


def list_optimizers(found):
    found.append(SdOptimizationSdp())
