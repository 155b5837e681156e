"""Fake of A1111 modules/shared.py: the attributes the extension reads."""

from types import SimpleNamespace

from modules.options import OptionInfo, Options

opts = Options({
    "upcast_attn": OptionInfo(False, "Upcast cross attention layer to float32"),
    "training_xattention_optimizations": OptionInfo(False, "Use cross attention optimizations while training"),
    "cross_attention_optimization": OptionInfo("Automatic", "Cross attention optimization"),
})
cmd_opts = SimpleNamespace()
loaded_hypernetworks = []
