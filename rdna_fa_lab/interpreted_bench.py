"""`python -m rdna_fa_lab bench`, the main job: where the kernels run (an RDNA GPU; an NVIDIA GPU with
the emulation builds), the package's benchmark (`python -m rdna_flash_attn bench`: the kernels against
PyTorch SDPA's backends); anywhere else, a Stable Diffusion attention call goes through the shipped code
objects on the lab's CPU interpreter, and the expected speed on each RDNA GPU is shown. The JSON and PNG
go to a folder named on the first line of output (default ./rdna_fa_results/<date>-<time>), checked
writable before any work.

Without the kernels (no GPU, or one the kernels do not run on; the line says why), in well under two
minutes on two CPU cores: (1) a real Stable Diffusion attention call (interpreted.SD_CALL, float16,
forward and backward) through the shipped code objects of the RX 7900 XTX (gfx1100) and RX 9070 XT
(gfx1201) on the CPU interpreter of the RDNA ISA, its errors against float64 beside math SDPA's and the
interpreter's wall time (an interpreter's, not a speed); (2) the expected speed on each RDNA GPU the
static estimator models, beside published measurements of other kernels (expected_speed.py: a static
model, not a measurement). JSON and a PNG of both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rdna_flash_attn.runtime import artifacts
from rdna_flash_attn.tools import benchmark
from rdna_flash_attn.version import __version__
from . import expected_speed, interpreted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmark.add_arguments(parser.add_argument_group(
        "where the kernels run (an RDNA GPU, or NVIDIA with the emulation builds): the package's bench"))
    elsewhere = parser.add_argument_group("anywhere else (no RDNA GPU)")
    elsewhere.add_argument("--targets", default=",".join(interpreted.TARGET_GPUS),
                           help="code objects to run on the CPU interpreter (default: %(default)s)")
    elsewhere.add_argument("--no-interpret", action="store_true",
                           help="skip the interpreter: the expected speed only (a second)")


def run(args: argparse.Namespace) -> int:
    """The results folder first, then the package's benchmark where the kernels run, or run_without_kernels."""
    unknown = benchmark.selected_shapes(args, False)
    if isinstance(unknown, str):
        print(unknown, file=sys.stderr)
        return 2
    out_dir = benchmark.open_results_folder(args.out)
    if out_dir is None:
        return 2
    device = benchmark.default_device(args)
    kernels = benchmark.kernel_provider(device)
    if isinstance(kernels, str):
        return run_without_kernels(args, device, kernels, out_dir)
    return benchmark.run_benchmark(args, device, out_dir)


NO_GPU_STEM = "bench-no-rdna-gpu"
INTERPRETER_NOTE = ("wall time of a CPU interpreter executing the GPU's instructions one by one: it shows what "
                    "the code objects compute, not how fast a GPU runs them")


def _progress_line(text: str) -> None:
    sys.stdout.flush()  # in order with the results when both streams go to one log
    print(text, file=sys.stderr, flush=True)


def interpret_calls(targets: list[str], say: Callable[[str], None] = _progress_line) \
        -> tuple[list[dict], str | None, bool]:
    """interpreted.run_call on each target: (results, why not every target ran or None, whether the
    interpreter stopped on a code object: a failure, unlike a missing extra)."""
    results = []
    for target in targets:
        try:
            results.append(interpreted.run_call(target, say=say))
        except ImportError as error:  # numpy, or tinygrad's decoder tables (MissingDecoder is one)
            return results, f"the interpreter cannot run here: {error}; {interpreted.INTERPRETER_REQUIREMENTS}", False
        except artifacts.ArtifactError as error:
            return results, f"no shipped code object to interpret: {error}", False
        except RuntimeError as error:  # the interpreter refused an instruction or an access (it names them)
            return results, f"{target}: the interpreter stopped: {benchmark.first_line(error)}", True
    return results, None, False


def interpreted_lines(results: list[dict]) -> list[str]:
    """A table of the interpreted calls' checks, the rules, then their wall times."""
    lines = [f"  {'max error against float64':<30}{'ours':>10}{'math SDPA':>11}{'bound':>10}"]
    for result in results:
        for check in result["checks"]:
            lines.append(f"  {result['target'] + ' ' + check['pass'] + ' ' + check['tensor']:<30}{check['ours']:>10.2e}"
                         f"{check['sdpa_math']:>11.2e}{check['bound']:>10.2e}  {'ok' if check['passed'] else 'FAILED'}")
    if results:
        rules = {check["pass"]: check["rule"] for result in results for check in result["checks"]}
        lines.append("  bounds (DESIGN.md 2.4): " + "; ".join(f"{name} {rule}" for name, rule in rules.items()))
        times = "; ".join(f"{r['target']} forward {r['seconds']['forward']:.1f} s, backward "
                          f"{r['seconds']['backward']:.1f} s" for r in results)
        lines.append(f"  interpreter: {times}")
        lines.append(f"  ({INTERPRETER_NOTE})")
    return lines


def plot_without_kernels(interpreted_results: list[dict], expected: dict, path: Path, title: str) -> None:
    """The expected speed (forward and backward per GPU) and, when it ran, the interpreted call's errors."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    gpus = expected["gpus"]
    rows = 3 if interpreted_results else 2
    fig = Figure(figsize=(7.5 * len(gpus), 4.6 * rows))
    grid = fig.add_gridspec(rows, len(gpus), height_ratios=[1.35, 1, 0.9][:rows])
    for column, (target, gpu) in enumerate(gpus.items()):
        expected_speed.plot_forward(fig.add_subplot(grid[0, column]), target, gpu)
        expected_speed.plot_backward(fig.add_subplot(grid[1, column]), target, gpu)
    if interpreted_results:
        ax = fig.add_subplot(grid[2, :])
        labels, width = [], 0.27
        for i, (result, check) in enumerate((r, c) for r in interpreted_results for c in r["checks"]):
            for j, (key, name, color) in enumerate((("ours", "ours (interpreted code object)", "tab:blue"),
                                                     ("sdpa_math", "PyTorch math SDPA", "tab:orange"),
                                                     ("bound", "bound", "lightgray"))):
                ax.bar(i + (j - 1) * width, check[key], width, color=color, label=name if i == 0 else None)
            labels.append(f"{result['target']}\n{check['tensor']}")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("max error vs float64")
        times = ", ".join(f"{r['target']} {r['seconds']['forward'] + r['seconds']['backward']:.0f} s"
                          for r in interpreted_results)
        ax.set_title(f"{interpreted.SD_CALL.name}, {'x'.join(map(str, interpreted.SD_CALL.shape))} float16, on the "
                     f"CPU interpreter (wall time {times}: an interpreter's, not a GPU speed)", fontsize=8.5)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_without_kernels(args: argparse.Namespace, device: torch.device, refusal: str, out_dir: Path) -> int:
    """The code objects on the CPU interpreter, and the expected speed per RDNA GPU; 0, or 1 when an
    interpreted check failed."""
    started = time.perf_counter()
    print(f"the kernels do not run on {device}: {refusal}")
    print("showing them instead through the shipped code objects on the CPU interpreter, and their expected "
          "speed on RDNA GPUs")
    targets = [t for t in args.targets.split(",") if t]
    results, problem, stopped = [], None, False
    if not args.no_interpret:
        call = interpreted.SD_CALL
        print(f"\n[1/2] {call.name}: q, k, v {'x'.join(map(str, call.shape))} float16, forward + backward, "
              f"through {', '.join(f'rdna_fa_{t}.hsaco' for t in targets)} on the CPU interpreter, against float64",
              flush=True)
        results, problem, stopped = interpret_calls(targets)
        for line in interpreted_lines(results):
            print(line)
        if problem:
            print(f"  {problem}")
    expected = expected_speed.load()
    note = expected_speed.code_objects_note(expected, {t: interpreted.shipped_sha256(t) for t in expected["gpus"]})
    print(f"\n[2/2] expected speed on RDNA GPUs, TFLOP/s, a band: a static estimate (a model of the code objects' "
          f"instructions, fitted on published kernels), not a measurement")
    for line in expected_speed.table_lines(expected):
        print(f"  {line}")
    print("  measured (published), other kernels:")
    for line in expected_speed.published_lines(expected):
        print(f"  {line}")
    print(f"  not estimated: {expected['not_estimated']}")
    if note:
        print(f"  {note}")
    meta = {
        "rdna_flash_attn": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "device": str(device), "kernels": refusal,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "what": "no RDNA GPU: an SD attention call through the shipped code objects on the CPU interpreter, "
                "and the expected speed per RDNA GPU (static estimate)",
    }
    data = {"meta": meta,
            "interpreted": {"call": {"name": interpreted.SD_CALL.name, "shape_bhsd": list(interpreted.SD_CALL.shape),
                                     "dtype": "float16"},
                            "seconds_note": INTERPRETER_NOTE, "results": results, "problem": problem,
                            "skipped": bool(args.no_interpret)},
            "expected_speed": dict(expected, estimated_code_objects_note=note)}
    json_path = out_dir / f"{NO_GPU_STEM}.json"
    json_path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(f"\nwrote {json_path}")
    try:
        plot_without_kernels(results, expected, out_dir / f"{NO_GPU_STEM}.png",
                             f"rdna_flash_attn {__version__} without an RDNA GPU: expected speed (static estimate, "
                             "not measured) and the code objects on the CPU interpreter")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    else:
        print(f"wrote {out_dir / f'{NO_GPU_STEM}.png'}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 1 if stopped or any(not c["passed"] for r in results for c in r["checks"]) else 0
