"""What the coverage benchmark's hosts that run from a folder or count at attention modules share: the
git commit the folder is checked out at, this repository's WebUI extension's modules, and the
attention FLOPs of module calls. (A host's folder goes first on sys.path through comfyui_harness,
which a test loads by its path, before the package can be imported.)"""

from __future__ import annotations

import contextlib
import importlib
import subprocess
from pathlib import Path

from torch import nn


def commit(folder: Path) -> str | None:
    """The git commit the folder is checked out at (the folder itself a git work tree's top, not a
    folder inside another repository), or None."""
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != folder.resolve():
        return None
    return lines[1]


def extension_module(name: str):
    """This repository's WebUI extension's module `name` (extension/<name>.py): the repository's root, which
    holds the lab, is on sys.path whenever the lab is imported."""
    return importlib.import_module(f"extension.{name}")


def cross_attention_flops(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """4 * batch * queries * keys * inner width of a `CrossAttention(x, context=None)` call (ldm's, sgm's,
    sd-scripts'), from its inputs."""
    x = args[0]
    context = args[1] if len(args) > 1 else kwargs.get("context")
    keys = x.shape[1] if context is None else context.shape[1]
    return 4 * x.shape[0] * x.shape[1] * keys * module.to_q.out_features


class ModuleCalls:
    """Attention FLOPs and calls counted at `modules`' calls, whichever forward then runs."""

    def __init__(self):
        self.flops = self.calls = 0


@contextlib.contextmanager
def counted_at(modules: list[nn.Module], flops_of_call):
    """Yields a ModuleCalls counting every call of `modules` (flops_of_call(module, args, kwargs)) until
    the block ends."""
    counted = ModuleCalls()

    def count(module, args, kwargs):
        counted.flops += flops_of_call(module, args, kwargs)
        counted.calls += 1

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in modules]
    try:
        yield counted
    finally:
        for hook in hooks:
            hook.remove()
