"""`python -m rdna_flash_attn doctor`: what is detected (PyTorch, runtime, GPU targets, code objects,
self-test verdicts, settings) and why anything is off."""

from __future__ import annotations

import argparse
import platform

import torch

from ..config import Settings, settings
from ..dispatch import router, selftest
from ..integrations import autoload
from ..ops import quantized
from ..runtime import artifacts, device as devices, loader, variants
from ..version import __version__
from . import comfyui_host, rebuild
from .cli import lab_command


def gpu_devices() -> list[torch.device]:
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _line(label: str, text: object) -> None:
    print(f"{label:<18}{text}")


def _code_object_lines(library: loader.KernelLibrary) -> None:
    artifact = library.artifact
    emulated = ", NVIDIA emulation build" if artifact.emulated else ""
    _line("  artifact", f"{artifact.path} ({artifact.target}{emulated})")
    _line("  sha256", artifact.sha256)
    if artifact.code_object_version is not None:
        preference = loader.code_object_preference(library.runtime_version)
        _line("  code object", f"v{artifact.code_object_version} loaded by HIP runtime "
                               f"{library.runtime_version or '(version unknown)'} "
                               f"(order tried: {', '.join(f'v{v}' for v in preference)})")


def _doctor_device(device: torch.device) -> None:
    info = devices.describe(device)
    print(f"{device}:")
    _line("  name", info.name)
    _line("  backend", info.backend)
    rdna4m = artifacts.rdna4m_refusal(info.gfx_target or "")
    _line("  gfx target", f"{info.gfx_target}: {rdna4m}" if rdna4m else info.gfx_target or "-")
    _line("  runtime", info.runtime_version or "-")
    try:  # loading checks the sha256 against the manifest
        library = loader.loaded_library(info)
    except loader.KernelUnavailable as exc:
        library = None
        _line("  artifact", f"none: {exc}")
        _line("  loadable", f"no: {exc}")
    else:
        _code_object_lines(library)
        _line("  loadable", "yes (sha256 verified)")
    refusal = router.device_refusal(device)
    if refusal is None:
        was_cached = selftest.cached(library) is not None
        refusal = router.selftest_refusal(device)
        verdict = "passed" if refusal is None else refusal
        _line("  self-test", f"{verdict} ({'cached' if was_cached else 'run now'})")
    else:
        _line("  self-test", "not run (the kernels are off before it)")
    if settings.disable:
        refusal = "disabled (RDNA_FA_DISABLE / settings.disable)"
    _line("  kernels", "ON" if refusal is None else f"OFF: {refusal}")
    if refusal is None:
        _line("  8-bit attention", _eight_bit_line(device, library))


def _eight_bit_line(device: torch.device, library: loader.KernelLibrary) -> str:
    """Whether this device's inference calls run in 8-bit attention (its self-test runs only when asked for)."""
    unavailable = quantized.target_refusal(library.artifact.target)
    if unavailable:
        return f"not available: {unavailable}"
    if settings.precision == "exact":
        return "available, not used (RDNA_FA_PRECISION=exact)"
    refusal = router.eight_bit_refusal(device)
    return "ON for inference calls without mask or causal, head dims 40-160 (self-test passed)" if refusal is None else (
        f"OFF: {refusal}")


def _doctor_code_objects() -> None:
    """Where the code objects are, whether each matches the manifest, local builds, and the compiler a
    local rebuild would use."""
    verified, problems = artifacts.verify_prebuilt()
    _line("prebuilt", f"{artifacts.prebuilt_dir()}: {len(verified)} targets sha256-verified ({', '.join(verified) or '-'})")
    for version, targets in sorted(artifacts.prebuilt_code_object_versions().items(), reverse=True):
        _line(f"  code object v{version}", ", ".join(targets))
    for problem in problems:
        _line("  PROBLEM", problem)
    built = artifacts.local_build_targets()
    where = artifacts.local_build_dir()
    _line("local builds", f"{where}: {', '.join(built)} (used instead of prebuilt)" if built else "none")
    try:
        compiler = rebuild.find_clang()
    except rebuild.BuildError as error:
        _line("compiler", f"none for a local rebuild (needed only for a GPU without a prebuilt code object): {error}")
    else:
        _line("compiler", f"{compiler.path} ({compiler.version})")


def _flash_attn_line() -> None:
    """Which `flash_attn` code written for Dao-AILab's package gets in this environment."""
    real = autoload.real_flash_attn()
    if real is not None:
        _line("flash_attn", f"a real flash-attn at {real} (the stand-in is never used over it)")
    elif autoload.flash_attn_requested():
        _line("flash_attn", f"the stand-in on the kernels ({autoload.FLASH_ATTN_ENV_VAR} is set)")
    else:
        _line("flash_attn", f"none: the launcher's --flash-attn or {autoload.FLASH_ATTN_ENV_VAR}=1 provides a stand-in "
                            "on the kernels")


def _comfyui_section(gpus: list[torch.device]) -> None:
    """What ComfyUI itself would pick on each AMD GPU here, and what the nodes change (tools/comfyui_host.py)."""
    for device in gpus:
        info = devices.describe(device)
        if not info.is_amd:
            continue
        probe = None if info.backend == "zluda" else comfyui_host.aotriton_probe_refusal(device)
        choice = comfyui_host.comfy_attention(info.backend, info.gfx_target, torch.__version__, torch.version.hip,
                                              probe)
        print(f"ComfyUI on {device}:")
        for label, text in comfyui_host.report_lines(choice):
            _line(label, text)

def run(_args: argparse.Namespace) -> int:
    """Everything detected, and why anything is off."""
    _line("rdna_flash_attn", __version__)
    _line("python", f"{platform.python_version()} on {platform.platform()}")
    _line("torch", f"{torch.__version__} (HIP {torch.version.hip or '-'}, CUDA {torch.version.cuda or '-'})")
    _line("backward", "kernels" if settings.training else "PyTorch SDPA (RDNA_FA_TRAINING=0)")
    _line("float32 inputs", "PyTorch SDPA" if settings.fp32_cast == "off" else f"kernels in {settings.fp32_cast}")
    _line("precision", "exact" if settings.precision == "exact" else
          "8-bit attention (int8 Q K^T, fp8 P V) for inference calls on RDNA4, exact elsewhere")
    _line("attention masks", f"kernels at head dims {variants.MASKED_HEAD_DIMS[0]}-{variants.MASKED_HEAD_DIMS[-1]}; "
                             "PyTorch SDPA at the others")
    _flash_attn_line()
    _line("CPU interpreter", f"of the code objects, without a GPU: {lab_command('selftest')}")
    _line("self-test cache", selftest.cache_dir() / selftest.CACHE_FILE_NAME)
    _doctor_code_objects()
    print("settings:")
    for name, env, default, _doc in Settings.options():
        value = getattr(settings, name)
        _line(f"  {name}", f"{value!r:<10} {env}{'' if value == default else '  (not the default)'}")
    gpus = gpu_devices()
    if not gpus:
        _line("devices", "none: torch sees no GPU, so every call runs on PyTorch SDPA")
    for device in gpus:
        _doctor_device(device)
    _comfyui_section(gpus)
    return 0
