"""Fake of A1111 modules/sd_hijack.py's optimizer selection: list the available optimizations by
priority, undo (A1111's undo_optimizations, then the current one's undo), apply the one chosen as
A1111 1.10 chooses ("Automatic": the first whose command-line flag is set, else the first; a title
not among the available ones: silently the first; "None": none), printing the line A1111 prints."""

import ldm.modules.attention
import ldm.modules.diffusionmodules.model
import sgm.modules.attention
import sgm.modules.diffusionmodules.model

from modules import script_callbacks, sd_hijack_optimizations, shared
from modules.hypernetworks import hypernetwork

diffusionmodules_model_AttnBlock_forward = ldm.modules.diffusionmodules.model.AttnBlock.forward

optimizers = []
current_optimizer = None


def list_optimizers():
    script_callbacks.on_list_optimizers(sd_hijack_optimizations.list_optimizers)
    found = [x for x in script_callbacks.list_optimizers_callback() if x.is_available()]
    script_callbacks.callbacks["list_optimizers"].remove(sd_hijack_optimizations.list_optimizers)
    optimizers[:] = sorted(found, key=lambda x: x.priority, reverse=True)


def undo_optimizations():
    # As A1111's: the einsum forward on both CrossAttentions, ldm's AttnBlock forward on both AttnBlocks.
    ldm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
    ldm.modules.diffusionmodules.model.AttnBlock.forward = diffusionmodules_model_AttnBlock_forward
    sgm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
    sgm.modules.diffusionmodules.model.AttnBlock.forward = diffusionmodules_model_AttnBlock_forward


def apply_optimizations(option=None):
    global current_optimizer
    undo_optimizations()
    if current_optimizer is not None:
        current_optimizer.undo()
        current_optimizer = None
    selection = option or shared.opts.cross_attention_optimization
    if selection == "None" or not optimizers:
        return ""
    if selection == "Automatic":
        flagged = [x for x in optimizers if x.cmd_opt and getattr(shared.cmd_opts, x.cmd_opt, False)]
        chosen = (flagged or optimizers)[0]
    else:
        chosen = next(iter([x for x in optimizers if x.title() == selection]), optimizers[0])
    print(f"Applying attention optimization: {chosen.name}... ", end="")
    chosen.apply()
    print("done.")
    current_optimizer = chosen
    return chosen.name
