"""`python -m rdna_flash_attn selftest`: the first-use self-test re-run on each GPU, ignoring its
cached verdict."""

from __future__ import annotations

import argparse

import torch

from ..dispatch import router, selftest
from ..runtime import device as devices, loader
from .cli import lab_command
from .doctor import gpu_devices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="one torch device, e.g. cuda:1 (default: every GPU)")


def run(args: argparse.Namespace) -> int:
    """Re-run the self-test (ignoring the cache) on each GPU; 0 passed, 1 failed, 2 nothing tested."""
    gpus = [torch.device(args.device)] if args.device else gpu_devices()
    if not gpus:
        print(f"no GPU visible to torch: nothing to test; the self-test on the CPU interpreter: {lab_command('selftest')}")
        return 2
    failed = untested = False
    for device in gpus:
        info = devices.describe(device)
        try:
            library = loader.loaded_library(info)
        except loader.KernelUnavailable as unavailable:
            print(f"{device} ({info.name}): no kernels to test: {unavailable}")
            untested = True
            continue
        record = selftest.run(device, library)
        for check in record["checks"]:
            mark = "ok  " if check["passed"] else "FAIL"
            print(f"  {mark} {check['name']}: error {check['error']:.3g} (tolerance {check['tolerance']:.3g})")
        print(f"{device} ({info.name}): {'passed' if record['passed'] else record['reason']}")
        failed = failed or not record["passed"]
    router.forget_devices()
    return 1 if failed else 2 if untested else 0
