"""Run a Python training script with torch's SDPA routed through rdna_flash_attn.

    python -m rdna_flash_attn.launch [options] script.py [script arguments...]
    python -m rdna_flash_attn.launch [options] -m module [module arguments...]
    accelerate launch [accelerate options] -m rdna_flash_attn.launch [options] script.py [arguments...]
    deepspeed [deepspeed options] --module rdna_flash_attn.launch [options] script.py [arguments...]

The script runs as `__main__` in this process, as `python script.py` would run it: the same
sys.argv, its folder first on sys.path, its exit code and its exceptions. Code that looks up
`torch.nn.functional.scaled_dot_product_attention` at call time (kohya sd-scripts with --sdpa,
diffusers' default processors and "native" backend, OneTrainer) then runs attention on the kernels
where supported, backward included unless --no-training.

--flash-attn also gives code written for Dao-AILab's flash-attn (`import flash_attn`, flash-attn 2.8.3's
API: HunyuanVideo, Wan, Lumina 2, sd-scripts' flash attention option, diffusers' "flash" backend)
rdna_flash_attn's stand-in for it, unless a real flash-attn is installed, which is then used.

The environment passes the choice on to child Python processes (RDNA_FA_PATCH_SDPA=1, and
RDNA_FA_TRAINING=0 with --no-training), which the installed package's .pth hook honours; with
--flash-attn also RDNA_FA_FLASH_ATTN=1 and the stand-in's folder first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import runpy
import sys
from pathlib import Path

from ..config import settings
from ..dispatch import router, sdpa_patch
from .autoload import ENV_VAR as PATCH_ENV_VAR, FLASH_ATTN_ENV_VAR, FLASH_ATTN_SHIM_DIR, provide_flash_attn

_OPTIONS_WITH_VALUE = ("--stats",)
# Distributed launchers put the worker's rank right after the module they run (DeepSpeed:
# `-m rdna_flash_attn.launch --local_rank=N script.py ...`): it belongs to the script, so it is handed on
# right after the script's name, where `deepspeed script.py` would have put it.
_RANK_OPTIONS = ("--local_rank", "--local-rank")
# kohya sd-scripts' SD1.x/SDXL trainers compute the U-Net's attention themselves unless told otherwise.
_SD_SCRIPTS_UNET_TRAINERS = ("train_network.py", "sdxl_train_network.py", "train_db.py", "fine_tune.py",
                             "sdxl_train.py", "train_textual_inversion.py", "sdxl_train_textual_inversion.py")
_SD_SCRIPTS_ATTENTION_OPTIONS = ("--sdpa", "--xformers", "--mem_eff_attn")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rdna_flash_attn.launch",
        usage="%(prog)s [--no-training] [--flash-attn] [--stats FILE] [--quiet] (script.py | -m module) [arguments...]",
        description=__doc__.split("\n\n")[0],
        epilog="Everything after the script (or -m module) is passed to it unchanged.",
    )
    parser.add_argument(
        "--no-training",
        action="store_true",
        help="calls that need gradients run on PyTorch SDPA (the same as RDNA_FA_TRAINING=0)",
    )
    parser.add_argument(
        "--flash-attn",
        action="store_true",
        help="`import flash_attn` gets rdna_flash_attn's flash-attn 2.8.3 API, unless flash-attn is installed "
             "(the same as RDNA_FA_FLASH_ATTN=1)",
    )
    parser.add_argument(
        "--stats",
        metavar="FILE",
        type=Path,
        help="at exit, write the dispatcher's counters of this process (rdna_flash_attn.stats()) to FILE as JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="no status line on stderr")
    return parser


def _write_stats(path: Path) -> None:
    record = dict(router.stats(), pid=os.getpid(), sdpa_patch_enabled=sdpa_patch.sdpa_patch_enabled(),
                  training=settings.training)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


def _split(argv: list[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    """(our options, the module for -m or None, the target's argv). Our options end at the first
    argument that is not one of them: the script, or -m and the module; all after is the target's."""
    parser = _parser()
    ours, rank, end = [], [], 0
    while end < len(argv) and argv[end].startswith("-") and argv[end] != "-m":
        taken = 2 if argv[end] in _OPTIONS_WITH_VALUE + _RANK_OPTIONS else 1
        (rank if argv[end].split("=")[0] in _RANK_OPTIONS else ours).extend(argv[end:end + taken])
        end += taken
    options = parser.parse_args(ours)
    target = argv[end:]
    if target[:1] == ["-m"]:
        if len(target) < 2:
            parser.error("-m needs a module name")
        return options, target[1], [target[1], *rank, *target[2:]]
    if not target:
        parser.error("a script to run (or -m module) is required")
    return options, None, [target[0], *rank, *target[1:]]


def sd_scripts_attention_hint(script: str, args: list[str]) -> str | None:
    """A line for kohya sd-scripts' SD1.x/SDXL trainers run without an attention option: their U-Net
    then computes attention itself (baddbmm, softmax, bmm), which no override reaches."""
    folder = Path(script).resolve().parent
    if Path(script).name not in _SD_SCRIPTS_UNET_TRAINERS or not (folder / "library" / "train_util.py").is_file():
        return None
    if any(arg.split("=")[0] in _SD_SCRIPTS_ATTENTION_OPTIONS for arg in args):
        return None
    for config in _option_values(args, "--config_file"):
        try:
            text = Path(config).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if re.search(r"^\s*(sdpa|xformers|mem_eff_attn)\s*=\s*true\b", text, re.MULTILINE | re.IGNORECASE):
            return None
    return ("rdna_flash_attn: this sd-scripts trainer computes the U-Net's attention itself unless given --sdpa "
            "(or sdpa = true in its config file), and the kernels cannot reach that: add --sdpa")


def _provide_flash_attn() -> str:
    """Make `import flash_attn` find the stand-in here and in child processes, unless a real flash-attn is
    importable; the status line's words for what `import flash_attn` gives."""
    os.environ[FLASH_ATTN_ENV_VAR] = "1"
    real = provide_flash_attn(position=1)  # right after the target's folder, as interpreter start puts it
    if real is not None:
        return f"`import flash_attn` gives the installed flash-attn ({real})"
    # Workers of DeepSpeed and accelerate are fresh interpreters: they find it through PYTHONPATH.
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if FLASH_ATTN_SHIM_DIR not in inherited:
        os.environ["PYTHONPATH"] = os.pathsep.join([FLASH_ATTN_SHIM_DIR, *inherited])
    return "`import flash_attn` gives rdna_flash_attn's flash-attn 2.8.3 API"


def _option_values(args: list[str], name: str) -> list[str]:
    """Every value of option `name` in `args`, as `name value` or `name=value`."""
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(name + "=")]
    values += [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values


def main(argv: list[str] | None = None) -> None:
    options, module, target = _split(sys.argv[1:] if argv is None else argv)
    if options.no_training:
        settings.training = False
        os.environ["RDNA_FA_TRAINING"] = "0"
    os.environ[PATCH_ENV_VAR] = "1"
    sdpa_patch.enable_sdpa_patch()
    if options.stats is not None:
        # At interpreter exit: after the script returns, calls sys.exit or raises, alike.
        atexit.register(_write_stats, options.stats.resolve())
    sys.argv = list(target)  # for -m, runpy puts the module's file path in argv[0], as python -m does
    # As `python script.py` / `python -m module`: the script's folder (or the working one) first, not ours.
    sys.path[0] = os.getcwd() if module is not None else os.path.dirname(os.path.abspath(target[0]))
    # Once sys.path[0] is the target's: a flash_attn package beside the script counts as installed.
    flash_attn = _provide_flash_attn() if options.flash_attn else None
    if not options.quiet:
        backward = "on" if settings.training else "off"
        print(
            f"rdna_flash_attn: torch SDPA routed through the dispatcher (kernels where supported, backward {backward})"
            + (f"; {flash_attn}" if flash_attn else ""),
            file=sys.stderr,
        )

    if module is not None:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        hint = sd_scripts_attention_hint(target[0], target[1:])
        if hint and not options.quiet:
            print(hint, file=sys.stderr)
        runpy.run_path(os.path.abspath(target[0]), run_name="__main__")
