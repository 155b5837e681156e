"""SD.Next as a host, in this process: SD.Next's own attention set-up around the diffusers models it
runs. Used by the coverage benchmark (rdna_fa_lab/coverage.py).

What runs is SD.Next's code: `modules.devices.set_sdpa_params` at start-up (it saves torch's SDPA and
stacks the SDP overrides chosen, e.g. its dynamic attention), the defaults SD.Next's
`modules.shared_defaults` picks for the backend (ZLUDA, or ROCm on an RX 7900 XTX), and at each model
load what `sd_models.load_diffuser` calls: `attention.set_diffusers_attention` (which calls
`set_sdpa_params` again), `attention.set_attention_dispatcher` and `script_callbacks.model_loaded_callback`,
then `before_process_callback` before the job. This repository's WebUI extension starts as in SD.Next
(`extension.entry.setup()`, which finds SD.Next by its `modules.shared.url` and registers its callbacks
in SD.Next's own `script_callbacks`). The models are diffusers' (hosts/diffusers_harness.py), as SD.Next
loads them.

What is not SD.Next's: `modules.shared`, which starts the whole WebUI (Gradio, model loader, every
requirement); a stand-in holds its `url` and the options above, their values read from SD.Next's own
files (`shared_defaults`, `ui_definitions`). On the CPU the ROCm defaults need a GPU name: SD.Next's
`rocm.Agent` is given "gfx1100". With a diffusers newer than the commit SD.Next pins, `set_sdpa_params`
logs one warning per call (its last statement reads a flag diffusers no longer has), after its
overrides are in place: the attention set-up is complete. Not run: SD.Next's pipelines, offloading, samplers and model
loader; the "Attention method" settings other than its default (Scaled-Dot-Product); SD.Next's own
transformer classes in `pipelines/`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
import sys
import types
from pathlib import Path

import torch

from rdna_flash_attn.config import settings
from .comfyui_harness import put_first_on_path
from .host_code import extension_module

BACKENDS = ("zluda", "rocm")
ROCM_GPU = "gfx1100"  # the RX 7900 XTX, for the ROCm defaults (RDNA2 and older get dynamic attention)
# options SD.Next's attention code reads, whose defaults are literals in modules/ui_definitions.py
UI_DEFAULTS = ("attention_slicing", "hf_attention", "dynamic_attention_slice_rate", "dynamic_attention_trigger_rate",
               "diffusers_fuse_projections")
REQUIRED_FILES = ("modules/devices.py", "modules/attention.py", "modules/shared_defaults.py",
                  "modules/script_callbacks.py", "modules/ui_definitions.py", "modules/shared.py", "installer.py")


class NotSdNext(Exception):
    """The folder is not an SD.Next checkout this harness can run."""


def _source(folder: Path, relative: str) -> str:
    return (folder / relative).read_text(encoding="utf-8")


def _url(folder: Path) -> str:
    found = re.search(r"^url = '([^']+)'", _source(folder, "modules/shared.py"), re.MULTILINE)
    if found is None:
        raise NotSdNext(f"{folder}/modules/shared.py names no url: not an SD.Next this harness knows")
    return found.group(1)


def _ui_defaults(folder: Path) -> dict:
    """The default of each option in UI_DEFAULTS, as modules/ui_definitions.py declares it."""
    source = _source(folder, "modules/ui_definitions.py")
    defaults = {}
    for key in UI_DEFAULTS:
        found = re.search(rf'"{key}": OptionInfo\(([^,]+),', source)
        if found is None:
            raise NotSdNext(f"modules/ui_definitions.py declares no option {key}: the harness no longer fits this SD.Next")
        defaults[key] = ast.literal_eval(found.group(1).strip())
    return defaults


class SdNext:
    """SD.Next's attention modules, imported from `folder` with the defaults of `backend`."""

    def __init__(self, folder: Path, backend: str, device: torch.device):
        missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
        if missing:
            raise NotSdNext(f"{folder} is not an SD.Next folder (no {', '.join(missing)})")
        if backend not in BACKENDS:
            raise NotSdNext(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.folder, self.backend = folder, backend
        put_first_on_path(folder)
        self.shared = types.ModuleType("modules.shared")
        self.shared.url = _url(folder)
        self.shared.cmd_opts = types.SimpleNamespace(lowvram=False, medvram=False, device_id=None)
        self.shared.opts = types.SimpleNamespace(**_ui_defaults(folder))  # read as attributes
        sys.modules["modules.shared"] = self.shared
        with contextlib.redirect_stdout(sys.stderr):
            self.devices = importlib.import_module("modules.devices")
            self.attention = importlib.import_module("modules.attention")
            self.callbacks = importlib.import_module("modules.script_callbacks")
            defaults = importlib.import_module("modules.shared_defaults")
            rocm = importlib.import_module("modules.rocm")
        importlib.import_module("modules").shared = self.shared
        self.devices.opts, self.devices.backend, self.devices.device = self.shared.opts, backend, device
        self.devices.get_hip_agent = lambda: rocm.Agent(ROCM_GPU)
        (_, _, _, cross_attention, sdp_options, _, sdp_overrides, *_) = defaults.get_default_modes(
            cmd_opts=self.shared.cmd_opts, mem_stat={})
        self.shared.opts.cross_attention_optimization = cross_attention
        self.shared.opts.sdp_options, self.shared.opts.sdp_overrides = sdp_options, sdp_overrides
        self.extension_started = False
        self.devices.set_sdpa_params()  # SD.Next's start-up (devices.set_cuda_params), before extensions load

    @property
    def host_name(self) -> str:
        return "SD.Next (ZLUDA defaults)" if self.backend == "zluda" else f"SD.Next (ROCm defaults, {ROCM_GPU})"

    @property
    def result_name(self) -> str:
        return f"coverage-sdnext-{self.backend}"

    @property
    def settings(self) -> dict:
        """The attention settings in effect."""
        opts = self.shared.opts
        return dict(backend=self.backend, attention=opts.cross_attention_optimization, sdp_options=opts.sdp_options,
                    sdp_overrides=opts.sdp_overrides)

    def start_extension(self) -> None:
        """The extension's start, as SD.Next's script loader runs it (once)."""
        if not self.extension_started:
            if extension_module("entry").setup() != "sdnext":
                raise NotSdNext("the extension did not recognise SD.Next")
            self.extension_started = True

    def load(self, model: torch.nn.Module) -> types.SimpleNamespace:
        """What SD.Next does around a model it loads, on a pipeline holding `model`; the pipeline."""
        role = "unet" if "UNet" in type(model).__name__ else "vae" if "Autoencoder" in type(model).__name__ else "transformer"
        pipe = types.SimpleNamespace(**{role: model})
        with contextlib.redirect_stdout(sys.stderr):
            self.attention.set_diffusers_attention(pipe, quiet=True)
            self.attention.set_attention_dispatcher(pipe)
            self.callbacks.model_loaded_callback(pipe)
        return pipe

    def before_job(self) -> None:
        self.callbacks.before_process_callback(types.SimpleNamespace())


@contextlib.contextmanager
def own_attention():
    """Every attention call on SD.Next's own attention, nothing installed or re-installed: the dispatcher,
    where it is on top, hands each call to the function below it (as when the kernels are disabled)."""
    saved = settings.disable
    settings.disable = True
    try:
        yield
    finally:
        settings.disable = saved
