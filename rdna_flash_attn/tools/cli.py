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

# torch warns so at import when numpy is missing or broken; nothing the CLI runs needs numpy.
NUMPY_WARNING = "Failed to initialize NumPy"


@dataclass(frozen=True)
class Verb:
    help: str
    module: str  # dotted name: add_arguments(parser) (optional) and run(args) -> exit code
    own_parser: bool = False  # the module's main(argv) parses everything after the verb

    def load(self) -> ModuleType:
        """The verb's module, torch's warning about numpy silenced while it imports (torch is imported then)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NUMPY_WARNING)
            return importlib.import_module(self.module)


class CommandLine:
    """`prog VERB ...`: one sub-command per verb, each verb's module imported only when that verb runs."""

    def __init__(self, prog: str, description: str, verbs: dict[str, Verb]):
        self.prog, self.description, self.verbs = prog, description, verbs

    def parser(self, verb: str | None = None) -> argparse.ArgumentParser:
        """The command line's parser; only `verb`'s module is imported, to add its arguments."""
        top = argparse.ArgumentParser(prog=self.prog, description=self.description)
        commands = top.add_subparsers(dest="command", required=True)
        for name, entry in self.verbs.items():
            if name != verb:
                commands.add_parser(name, help=entry.help)
                continue
            module = entry.load()
            sub = commands.add_parser(name, help=entry.help, description=_description(module))
            if hasattr(module, "add_arguments"):
                module.add_arguments(sub)
            sub.set_defaults(run=module.run, parser=sub)
        return top

    def main(self, argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else list(argv)
        verb = argv[0] if argv and argv[0] in self.verbs else None
        if verb is not None and self.verbs[verb].own_parser:
            return self.verbs[verb].load().main(argv[1:])
        args = self.parser(verb).parse_args(argv)
        return args.run(args)


def _description(module: ModuleType) -> str:
    """The module docstring's first paragraph, without its "`python -m PACKAGE VERB`:" heading."""
    first = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
    first = re.sub(r"^`python -m [^`]*`[:,]\s*", "", first)
    return first[:1].upper() + first[1:]


def lab_command(verb: str) -> str:
    """How to run `verb` of the repository's lab, which the installed package does not hold."""
    return f"python -m rdna_fa_lab {verb}, from a clone of the repository (the lab is not part of the installed package)"


VERBS = {
    "doctor": Verb("show what is detected and why anything is off", f"{__package__}.doctor"),
    "selftest": Verb("re-run the kernels' self-test on each GPU", f"{__package__}.selftest_cli"),
    "bench": Verb("the kernels against PyTorch SDPA's backends where they run (an RDNA GPU)",
                  f"{__package__}.benchmark"),
    "rebuild": Verb("build code objects for your GPU target locally (clang >= 19)", f"{__package__}.rebuild"),
}
COMMAND_LINE = CommandLine("python -m rdna_flash_attn", __doc__.split("\n\n")[0], VERBS)


def main(argv: list[str] | None = None) -> int:
    return COMMAND_LINE.main(argv)
