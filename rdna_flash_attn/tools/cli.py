"""rdna_flash_attn's command line, `python -m rdna_flash_attn VERB` (or `rdna-flash-attn VERB`);
`VERB --help` gives a verb's options.

A verb's module is imported only when that verb runs: `--help`, no verb or a mistyped one answer
without importing torch (which alone takes seconds)."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType

# torch warns so at import when numpy is missing or broken; nothing the CLI runs needs numpy except the
# interpreter, which says so itself (doctor prints a line about numpy).
NUMPY_WARNING = "Failed to initialize NumPy"


@dataclass(frozen=True)
class Verb:
    help: str
    module: str  # in this package: add_arguments(parser) (optional) and run(args) -> exit code

    def load(self) -> ModuleType:
        """Imported only when the verb runs: `--help` and the other verbs never import torch."""
        return importlib.import_module(f"{__package__}.{self.module}")


VERBS = {
    "doctor": Verb("show what is detected and why anything is off", "doctor"),
    "selftest": Verb("re-run the kernels' self-test on each GPU, or (--interpret) on the CPU interpreter",
                     "selftest_cli"),
    "bench": Verb("the main job: kernels vs PyTorch SDPA on an RDNA GPU; without one, a Stable Diffusion "
                  "attention call through the shipped code objects on the CPU interpreter, and the "
                  "expected speed per RDNA GPU", "benchmark"),
    "coverage": Verb("the share of each model family's attention that reaches the kernels in a host: "
                     "ComfyUI, A1111, diffusers, Forge, reForge, Forge Classic, SD.Next or kohya sd-scripts",
                     "coverage"),
    "rebuild": Verb("build code objects for your GPU target locally (clang >= 19)", "rebuild"),
    # report parses its own command line: main() hands it everything after "report".
    "report": Verb("static resource report of the prebuilt code objects (see report --help)", "report"),
}


def load(verb: str) -> ModuleType:
    """The verb's module, torch's warning about numpy silenced while it imports (torch is imported then)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_WARNING)
        return VERBS[verb].load()


def _description(module: ModuleType) -> str:
    """The module docstring's first paragraph, without its "`python -m rdna_flash_attn VERB`:" heading."""
    first = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    first = re.sub(r"^`python -m [^`]*`[:,]\s*", "", first)
    return first[:1].upper() + first[1:]


def parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; only `verb`'s module is imported, to add its arguments."""
    top = argparse.ArgumentParser(prog="python -m rdna_flash_attn", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)
    for name, entry in VERBS.items():
        if name != verb:
            commands.add_parser(name, help=entry.help)
            continue
        module = load(name)
        sub = commands.add_parser(name, help=entry.help, description=_description(module))
        if hasattr(module, "add_arguments"):
            module.add_arguments(sub)
        sub.set_defaults(run=module.run, parser=sub)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:  # its own parser takes the rest of the line
        return load("report").main(argv[1:])
    verb = argv[0] if argv and argv[0] in VERBS else None
    args = parser(verb).parse_args(argv)
    return args.run(args)
