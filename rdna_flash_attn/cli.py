"""`python -m rdna_flash_attn doctor | selftest | bench | report`."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__, artifacts, benchmark, dispatch, ops, selftest
from . import rebuild, runtime
from . import device as _device
from .config import Settings, settings


def _gpu_devices() -> list[torch.device]:
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _line(label: str, text: object) -> None:
    print(f"{label:<18}{text}")


def _doctor_device(device: torch.device) -> None:
    info = _device.describe(device)
    print(f"{device}:")
    _line("  name", info.name)
    _line("  backend", info.backend)
    _line("  gfx target", info.gfx_target or "-")
    _line("  runtime", info.runtime_version or "-")
    try:
        artifact = ops.artifact_info(device)
    except ops.KernelUnavailable as exc:
        _line("  artifact", f"none: {exc}")
    else:
        emulated = ", NVIDIA emulation build" if artifact["emulated"] else ""
        _line("  artifact", f"{artifact['path']} ({artifact['target']}{emulated})")
        _line("  sha256", artifact["sha256"])
        if artifact.get("code_object_version") is not None:
            preference = runtime.code_object_preference(artifact.get("runtime_version"))
            _line("  code object", f"v{artifact['code_object_version']} loaded by HIP runtime "
                                   f"{artifact.get('runtime_version') or '(version unknown)'} "
                                   f"(order tried: {', '.join(f'v{v}' for v in preference)})")
    unloadable = ops.availability(device)  # loading checks the sha256 against the manifest
    _line("  loadable", f"no: {unloadable}" if unloadable else "yes (sha256 verified)")
    refusal = dispatch.device_refusal(device)
    if refusal is None:
        was_cached = selftest.cached(device) is not None
        refusal = dispatch.selftest_refusal(device)
        verdict = "passed" if refusal is None else refusal
        _line("  self-test", f"{verdict} ({'cached' if was_cached else 'run now'})")
    else:
        _line("  self-test", "not run (the kernels are off before it)")
    if settings.disable:
        refusal = "disabled (RDNA_FA_DISABLE / settings.disable)"
    _line("  kernels", "ON" if refusal is None else f"OFF: {refusal}")


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


def doctor(_args: argparse.Namespace) -> int:
    """Everything detected, and why anything is off."""
    _line("rdna_flash_attn", __version__)
    _line("python", f"{platform.python_version()} on {platform.platform()}")
    _line("torch", f"{torch.__version__} (HIP {torch.version.hip or '-'}, CUDA {torch.version.cuda or '-'})")
    _line("backward", "kernels" if settings.training else "PyTorch SDPA (RDNA_FA_TRAINING=0)")
    _line("float32 inputs", "PyTorch SDPA" if settings.fp32_cast == "off" else f"kernels in {settings.fp32_cast}")
    _line("self-test cache", selftest.cache_dir() / selftest.CACHE_FILE_NAME)
    _doctor_code_objects()
    print("settings:")
    for name, env, default, _doc in Settings.options():
        value = getattr(settings, name)
        _line(f"  {name}", f"{value!r:<10} {env}{'' if value == default else '  (not the default)'}")
    devices = _gpu_devices()
    if not devices:
        _line("devices", "none: torch sees no GPU, so every call runs on PyTorch SDPA")
    for device in devices:
        _doctor_device(device)
    return 0


def run_interpreted_selftest(target: str) -> int:
    """The shipped code object for `target`, run on the CPU by the ISA interpreter; 0 passed,
    1 failed, 2 nothing tested (no decoder or no code object)."""
    from .interpreter import InterpreterError, MissingDecoder

    try:
        checks, seconds, path = selftest.run_interpreted(target)
    except (MissingDecoder, artifacts.ArtifactError) as error:
        print(f"cannot interpret the {target} code object: {error}")
        return 2
    except InterpreterError as error:  # the kernel did something the interpreter refuses (message names kernel and pc)
        print(f"{target} code object FAILED under the interpreter: {error}")
        return 1
    for check in checks:
        mark = "ok  " if check.passed else "FAIL"
        print(f"  {mark} {check.name}: error {check.error:.3g} (tolerance {check.tolerance:.3g})")
    passed = all(check.passed for check in checks)
    print(f"{target} code object {path}, interpreted on the CPU in {seconds:.1f} s: {'passed' if passed else 'FAILED'}")
    return 0 if passed else 1


def run_selftest(args: argparse.Namespace) -> int:
    """Re-run the self-test (ignoring the cache) on each GPU; 0 passed, 1 failed, 2 nothing tested."""
    if args.interpret:
        return run_interpreted_selftest(args.target or "gfx1100")
    if args.target:  # a GPU's target is detected, not chosen: only a code object run on the CPU takes one
        args.parser.error("--target needs --interpret")
    devices = [torch.device(args.device)] if args.device else _gpu_devices()
    if not devices:
        print("no GPU visible to torch: nothing to test")
        return 2
    failed = untested = False
    for device in devices:
        name = _device.describe(device).name
        unavailable = ops.availability(device)
        if unavailable:
            print(f"{device} ({name}): no kernels to test: {unavailable}")
            untested = True
            continue
        record = selftest.run(device)
        for check in record["checks"]:
            mark = "ok  " if check["passed"] else "FAIL"
            print(f"  {mark} {check['name']}: error {check['error']:.3g} (tolerance {check['tolerance']:.3g})")
        print(f"{device} ({name}): {'passed' if record['passed'] else record['reason']}")
        failed = failed or not record["passed"]
    dispatch.forget_devices()
    return 1 if failed else 2 if untested else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rdna_flash_attn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="show what is detected and why anything is off").set_defaults(run=doctor)
    test = commands.add_parser("selftest", help="re-run the kernels' self-test on each GPU")
    test.add_argument("--device", help="one torch device, e.g. cuda:1 (default: every GPU)")
    test.add_argument("--interpret", action="store_true",
                      help="no GPU needed: run a shipped code object on the CPU, instruction by instruction "
                           "(needs pip install tinygrad==0.14.0)")
    test.add_argument("--target", help="with --interpret: the GPU target's code object (default gfx1100)")
    test.set_defaults(run=run_selftest, parser=test)
    bench = commands.add_parser(
        "bench", help="time the kernels against PyTorch SDPA's backends (--suite full: UNet, VAE, memory too)")
    benchmark.add_arguments(bench)
    bench.set_defaults(run=benchmark.run)
    local_build = commands.add_parser("rebuild", help="build code objects for your GPU target locally (clang >= 19)")
    rebuild.add_arguments(local_build)
    local_build.set_defaults(run=rebuild.run)
    # Listed for --help only: main() hands everything after "report" to report.main.
    commands.add_parser("report", help="static resource report of the prebuilt code objects (see report --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:  # its own parser takes the rest of the line
        from . import report

        return report.main(argv[1:])
    args = _parser().parse_args(argv)
    return args.run(args)
