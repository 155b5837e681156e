"""Run a Python training script with torch's SDPA routed through rdna_flash_attn.

    python -m rdna_flash_attn.launch [options] script.py [script arguments...]
    python -m rdna_flash_attn.launch [options] -m module [module arguments...]
    accelerate launch [accelerate options] -m rdna_flash_attn.launch [options] script.py [arguments...]

The script runs as `__main__` in this process, as `python script.py` would run it: the same
sys.argv, its folder first on sys.path, its exit code and its exceptions. Code that looks up
`torch.nn.functional.scaled_dot_product_attention` at call time (kohya sd-scripts with --sdpa,
diffusers' default processors and "native" backend, OneTrainer) then runs attention on the kernels
where supported, backward included unless --no-training.

The environment passes the choice on to child Python processes (RDNA_FA_PATCH_SDPA=1, and
RDNA_FA_TRAINING=0 with --no-training), which the installed package's .pth hook honours.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
from pathlib import Path

from ..config import settings
from ..dispatch import router, sdpa_patch
from .autoload import ENV_VAR as PATCH_ENV_VAR

_OPTIONS_WITH_VALUE = ("--stats",)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rdna_flash_attn.launch",
        usage="%(prog)s [--no-training] [--stats FILE] [--quiet] (script.py | -m module) [arguments...]",
        description=__doc__.split("\n\n")[0],
        epilog="Everything after the script (or -m module) is passed to it unchanged.",
    )
    parser.add_argument(
        "--no-training",
        action="store_true",
        help="calls that need gradients run on PyTorch SDPA (the same as RDNA_FA_TRAINING=0)",
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
    end = 0
    while end < len(argv) and argv[end].startswith("-") and argv[end] != "-m":
        end += 2 if argv[end] in _OPTIONS_WITH_VALUE else 1
    options = parser.parse_args(argv[:end])
    target = argv[end:]
    if target[:1] == ["-m"]:
        if len(target) < 2:
            parser.error("-m needs a module name")
        return options, target[1], target[1:]
    if not target:
        parser.error("a script to run (or -m module) is required")
    return options, None, target


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
    if not options.quiet:
        backward = "on" if settings.training else "off"
        print(
            f"rdna_flash_attn: torch SDPA routed through the dispatcher (kernels where supported, backward {backward})",
            file=sys.stderr,
        )

    if module is not None:
        sys.argv = list(target)  # runpy puts the module's file path in argv[0], as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(target[0])
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(script)  # as `python script.py`: the script's folder, not ours
        runpy.run_path(script, run_name="__main__")
