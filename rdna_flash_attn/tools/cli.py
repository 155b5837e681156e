"""`python -m rdna_flash_attn doctor | selftest | bench | coverage | rebuild | report`."""

from __future__ import annotations

import argparse
import sys

from . import benchmark, coverage, rebuild, report
from .doctor import doctor
from .selftest_cli import INTERPRETER_DURATION, INTERPRETER_EXTRA, run_selftest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rdna_flash_attn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="show what is detected and why anything is off").set_defaults(run=doctor)
    test = commands.add_parser("selftest", help="re-run the kernels' self-test on each GPU")
    test.add_argument("--device", help="one torch device, e.g. cuda:1 (default: every GPU)")
    test.add_argument("--interpret", action="store_true",
                      help="no GPU needed: run a shipped code object on the CPU, instruction by instruction "
                           f"({INTERPRETER_DURATION}; needs {INTERPRETER_EXTRA})")
    test.add_argument("--target", help="with --interpret: the GPU target's code object (default gfx1100)")
    test.set_defaults(run=run_selftest, parser=test)
    bench = commands.add_parser("bench", help="time the kernels against PyTorch SDPA's backends")
    benchmark.add_arguments(bench)
    bench.set_defaults(run=benchmark.run)
    measure = commands.add_parser(
        "coverage", help="the share of each ComfyUI model family's attention that reaches the kernels")
    coverage.add_arguments(measure)
    measure.set_defaults(run=coverage.run)
    local_build = commands.add_parser("rebuild", help="build code objects for your GPU target locally (clang >= 19)")
    rebuild.add_arguments(local_build)
    local_build.set_defaults(run=rebuild.run)
    # Listed for --help only: main() hands everything after "report" to report.main.
    commands.add_parser("report", help="static resource report of the prebuilt code objects (see report --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:  # its own parser takes the rest of the line
        return report.main(argv[1:])
    args = _parser().parse_args(argv)
    return args.run(args)
