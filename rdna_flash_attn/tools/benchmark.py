"""`python -m rdna_flash_attn bench`: the kernels timed against PyTorch SDPA's backends where they run
(an RDNA GPU; an NVIDIA GPU with the emulation builds). The JSON and PNG go to a folder named on the
first line of output (default ./rdna_fa_results/<date>-<time>), checked writable before any work
(results_folder.py). Where the kernels do not run it says why, and names the repository's lab, which
shows the shipped code objects on a CPU interpreter and their expected speed instead.

The kernels against every SDPA backend the device offers, on the attention shapes of Stable
Diffusion-family models (DESIGN.md section 4), forward and backward. Reports the median time (CUDA
events), TFLOP/s (FlashAttention's convention: 4*B*H*Sq*Sk*D forward, 2.5 times that backward) and the
peak memory a call allocates beyond its inputs; writes JSON and a PNG plot.

Each row also carries the memory the call must allocate whatever the method (`linear_mib`: output
and LSE forward, dQ/dK/dV and the row deltas backward) and the size of one Sq x Sk score matrix
(`scores_mib`), so a peak close to `linear_mib` shows that nothing proportional to Sq x Sk was
allocated; `memory_sweep` does the same over growing sequence lengths and fits the growth exponent.
The end-to-end suite (UNet sampling, VAE decode) is the repository's bench/suite.py, built on this module.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch

from ..dispatch import router
from ..dispatch.sdpa_patch import patch_sdpa
from ..ops import attention, autograd, plans
from ..runtime import device as devices
from ..version import __version__
from . import results_folder
from .cli import lab_command

MIN_REPS, MAX_REPS = 3, 50
# What SDPA says when the one backend a probe allows cannot take the call: the error, and on a GPU the
# warnings before it (one per reason).
NO_VIABLE_BACKEND = "No viable backend for scaled_dot_product_attention"
SDPA_REFUSAL_WARNINGS = (r"(Memory efficient|Flash attention|CuDNN attention) kernel not used because",
                         NO_VIABLE_BACKEND)
MATH_MEMORY_FACTOR = {"forward": 3, "backward": 8}  # (Sq x Sk) buffers the math backend keeps alive


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    q_tokens: int
    k_tokens: int
    head_dim: int

    def flops(self, pass_: str) -> float:
        forward = 4.0 * self.batch * self.heads * self.q_tokens * self.k_tokens * self.head_dim
        return forward * 2.5 if pass_ == "backward" else forward

    def linear_bytes(self, pass_: str, element_size: int) -> int:
        """What any exact method allocates: output + float32 LSE forward; dQ, dK, dV + float32 row
        deltas backward. O(Sq + Sk)."""
        rows = self.batch * self.heads
        if pass_ == "backward":
            return rows * ((self.q_tokens + 2 * self.k_tokens) * self.head_dim * element_size + self.q_tokens * 4)
        return rows * self.q_tokens * (self.head_dim * element_size + 4)

    def scores_bytes(self, element_size: int) -> int:
        """One Sq x Sk score matrix in the input precision: the buffer flash attention never allocates."""
        return self.batch * self.heads * self.q_tokens * self.k_tokens * element_size


# Batch 2 where the model runs with classifier-free guidance, 1 where it does not (Flux, WAN, VAE).
SHAPES = (
    Shape("sd15-self-4096", 2, 8, 4096, 4096, 40),
    Shape("sd15-self-1024", 2, 8, 1024, 1024, 80),
    Shape("sd15-self-256", 2, 8, 256, 256, 160),
    Shape("sd15-mid-64", 2, 8, 64, 64, 160),
    Shape("sd15-cross-4096", 2, 8, 4096, 77, 40),
    Shape("sd15-cross-1024", 2, 8, 1024, 77, 80),
    Shape("sd2-self-9216", 2, 5, 9216, 9216, 64),
    Shape("sd2-self-2304", 2, 10, 2304, 2304, 64),
    Shape("sd2-self-576", 2, 20, 576, 576, 64),
    Shape("sd2-cross-9216", 2, 5, 9216, 77, 64),
    Shape("sdxl-self-4096", 2, 10, 4096, 4096, 64),
    Shape("sdxl-self-1024", 2, 20, 1024, 1024, 64),
    Shape("sdxl-cross-4096", 2, 10, 4096, 77, 64),
    Shape("sd3-joint-4250", 2, 24, 4250, 4250, 64),
    Shape("flux-joint-4608", 1, 24, 4608, 4608, 128),
    Shape("wan-self-32760", 1, 40, 32760, 32760, 128),
    Shape("wan-cross-32760", 1, 40, 32760, 512, 128),
    Shape("vae-mid-4096", 1, 1, 4096, 4096, 512),
    Shape("vae-mid-16384", 1, 1, 16384, 16384, 512),
)
_QUICK_NAMES = ("sd15-mid-64", "sd15-self-256", "sd15-cross-1024", "sd15-self-1024", "sdxl-self-1024")
QUICK_SHAPES = tuple(s for s in SHAPES if s.name in _QUICK_NAMES)

# One head geometry (SDXL's 10 x 64, CFG batch) at growing lengths: peak extra memory against tokens.
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SWEEP_TOKENS = (64, 128, 256)


def sweep_shapes(tokens: tuple[int, ...]) -> tuple[Shape, ...]:
    return tuple(Shape(f"sweep-self-{n}", 2, 10, n, n, 64) for n in tokens)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Provider:
    name: str
    run: Callable  # (q, k, v) -> out, differentiable
    context: Callable[[], ContextManager] = contextlib.nullcontext
    refusal: Callable = lambda q, k, v: None  # (q, k, v) -> why this provider cannot take them


def _sdpa_backend_context(backend: str) -> Callable[[], ContextManager] | None:
    """A context that limits SDPA to one backend, or None where this torch cannot select it."""
    attention = getattr(torch.nn, "attention", None)
    if attention is not None and hasattr(attention, "sdpa_kernel"):  # torch >= 2.3
        member = getattr(attention.SDPBackend, backend.upper(), None)
        return None if member is None else (lambda: attention.sdpa_kernel(member))
    flags = {"math": "enable_math", "flash_attention": "enable_flash", "efficient_attention": "enable_mem_efficient"}
    if backend not in flags:
        return None
    only = {flag: flag == flags[backend] for flag in flags.values()}
    return lambda: torch.backends.cuda.sdp_kernel(**only)


def _sdpa_providers() -> list[Provider]:
    names = {"math": "math", "flash_attention": "flash", "efficient_attention": "efficient", "cudnn_attention": "cudnn"}
    providers = []
    for backend, short in names.items():
        context = _sdpa_backend_context(backend)
        if context is not None:
            providers.append(Provider(f"sdpa-{short}", lambda q, k, v: router.torch_sdpa(q, k, v), context))
    return providers


def _kernels(q, k, v):
    """The kernels as the dispatcher calls them: the plain op unless autograd needs the differentiable one."""
    if torch.is_grad_enabled() and q.requires_grad:
        return autograd.flash_attention(q, k, v, False, None)
    return attention.flash_attention_forward(q, k, v, False, None)[0]


def kernel_provider(device: torch.device) -> Provider | str:
    refusal = router.device_refusal(device) or router.selftest_refusal(device)
    if refusal:
        return refusal
    return Provider("rdna_fa", _kernels, refusal=_kernels_refusal)


def _kernels_refusal(q, k, v) -> str | None:
    plan = plans.plan_forward(q, k, v)
    return plan.reason if isinstance(plan, plans.Refusal) else None


def available_providers(device: torch.device, dtype: torch.dtype, note: Callable[[str], None]) -> list[Provider]:
    """The kernels (when they run here) and each SDPA backend that accepts a tiny call on `device`."""
    providers = []
    kernels = kernel_provider(device)
    if isinstance(kernels, str):
        note(f"kernels not benchmarked: {kernels}")
    else:
        artifact = attention.artifact_info(device)
        note(f"kernels: {artifact['path']}{' (NVIDIA emulation build)' if artifact['emulated'] else ''}")
        providers.append(kernels)
    probe = [torch.randn(1, 1, 16, 64, device=device, dtype=dtype) for _ in range(3)]
    for provider in _sdpa_providers():
        try:
            with provider.context(), torch.no_grad(), warnings.catch_warnings():
                for message in SDPA_REFUSAL_WARNINGS:  # a backend that refuses says why in warnings first
                    warnings.filterwarnings("ignore", message=message)
                provider.run(*probe)
        except RuntimeError as exc:
            text = first_line(exc)
            note(f"{provider.name}: not offered for {device.type} {_dtype_name(dtype)}"
                 if text.startswith(NO_VIABLE_BACKEND) else f"{provider.name} not available: {text}")
            continue
        providers.append(provider)
    return providers


# --- measuring ------------------------------------------------------------------------------------


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def _time_ms(fn: Callable[[], object], device: torch.device, budget_s: float) -> tuple[float, float | None]:
    """(median milliseconds, peak MiB allocated beyond what existed before) of fn() on `device`.

    One untimed warm-up (lazy loading, autotuning, allocator growth), then calls until about
    `budget_s` is spent: at least MIN_REPS, or one when a single call already takes the budget (the
    largest emulated cases take seconds each)."""
    cuda = device.type == "cuda"
    fn()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = [_timed_call(fn, device)]
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    reps = MIN_REPS if times[0] * 1e-3 < budget_s else 1
    reps = max(reps, min(MAX_REPS, int(budget_s / max(times[0] * 1e-3, 1e-6))))
    times += [_timed_call(fn, device) for _ in range(reps - 1)]
    return statistics.median(times), peak


def _timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _inputs(shape: Shape, device: torch.device, dtype: torch.dtype, grad: bool) -> list[torch.Tensor]:
    return [
        torch.randn(shape.batch, shape.heads, n, shape.head_dim, device=device, dtype=dtype, requires_grad=grad)
        for n in (shape.q_tokens, shape.k_tokens, shape.k_tokens)
    ]


def measure(
    provider: Provider, shape: Shape, pass_: str, device: torch.device, dtype: torch.dtype, budget_s: float
) -> dict:
    """One result row; `error` says why a case has no time."""
    row = {"shape": shape.name, **asdict(shape), "provider": provider.name, "pass": pass_}
    element_size = torch.empty((), dtype=dtype).element_size()
    row.update(linear_mib=shape.linear_bytes(pass_, element_size) / 2**20,
               scores_mib=shape.scores_bytes(element_size) / 2**20)
    row.update(ms=None, tflops=None, peak_extra_mib=None, error=None)
    need = shape.batch * shape.heads * shape.q_tokens * shape.k_tokens * 4 * MATH_MEMORY_FACTOR[pass_]
    free = _free_bytes(device)
    if provider.name == "sdpa-math" and free is not None and need > 0.8 * free:
        return dict(row, error=f"skipped: needs ~{need / 2**30:.0f} GiB")
    try:
        q, k, v = _inputs(shape, device, dtype, grad=pass_ == "backward")
        refusal = provider.refusal(q, k, v)
        if refusal:
            return dict(row, error=f"unsupported: {refusal}")
        with provider.context():
            if pass_ == "forward":
                with torch.no_grad():
                    ms, peak = _time_ms(lambda: provider.run(q, k, v), device, budget_s)
            else:
                out = provider.run(q, k, v)
                grad_out = torch.randn_like(out)
                ms, peak = _time_ms(
                    lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True), device, budget_s
                )
    except RuntimeError as exc:  # out of memory, or a backend refusing this shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(row, error=first_line(exc))
    return dict(row, ms=ms, tflops=shape.flops(pass_) / (ms * 1e-3) / 1e12, peak_extra_mib=peak)


# --- output ---------------------------------------------------------------------------------------


def print_progress(done: int, total: int, text: str) -> None:
    bar = "#" * (20 * done // total)
    print(f"[{bar:<20}] {done:>3}/{total} {text}", file=sys.stderr, flush=True)


def _row_text(row: dict) -> str:
    if row["error"]:
        return row["error"]
    peak = "" if row["peak_extra_mib"] is None else f", +{row['peak_extra_mib']:.0f} MiB"
    return f"{row['ms']:.3f} ms, {row['tflops']:.2f} TFLOP/s{peak}"


def summary_table(rows: list[dict]) -> str:
    """Text table: one line per shape and pass, one column per provider (TFLOP/s)."""
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    widths = [max(10, len(p) + 2) for p in providers]
    cells = {(r["shape"], r["pass"], r["provider"]): r for r in rows}
    lines = [f"{'shape':<18}{'pass':<10}" + "".join(f"{p:>{w}}" for p, w in zip(providers, widths)) + "   (TFLOP/s)"]
    for shape, pass_ in dict.fromkeys((r["shape"], r["pass"]) for r in rows):
        values = []
        for p, w in zip(providers, widths):
            row = cells.get((shape, pass_, p))
            values.append(f"{row['tflops']:>{w}.3g}" if row and row["tflops"] is not None else f"{'-':>{w}}")
        lines.append(f"{shape:<18}{pass_:<10}" + "".join(values))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars of TFLOP/s per shape and provider, one panel per pass."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    passes = list(dict.fromkeys(r["pass"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cells = {(r["shape"], r["pass"], r["provider"]): r["tflops"] for r in rows}
    fig = Figure(figsize=(max(8.0, 0.8 * len(shapes) + 2), 4.2 * len(passes)))
    width = 0.8 / len(providers)
    for index, pass_ in enumerate(passes):
        ax = fig.add_subplot(len(passes), 1, index + 1)
        for i, provider in enumerate(providers):
            values = [cells.get((s, pass_, provider)) or 0.0 for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], values, width, label=provider)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], shapes, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(pass_)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- command --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="folder for the JSON and PNG (default: ./rdna_fa_results/<date>-<time>)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp16 on a GPU, fp32 on a CPU")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the small shape set (always on a CPU unless --full)")
    size.add_argument("--full", action="store_true", help="every shape, even on a CPU")
    parser.add_argument("--shapes", help="comma-separated shape names to keep (see the JSON for names)")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per case (default 0.5)")


def selected_shapes(args: argparse.Namespace, quick: bool) -> tuple[Shape, ...] | str:
    """The shapes to run, or an error message."""
    if not args.shapes:
        return QUICK_SHAPES if quick else SHAPES
    wanted = set(args.shapes.split(","))
    unknown = wanted - {s.name for s in SHAPES}
    if unknown:
        return f"unknown shapes: {', '.join(sorted(unknown))}"
    return tuple(s for s in SHAPES if s.name in wanted)


def measure_all(shapes, passes, device: torch.device, dtype: torch.dtype, budget_s: float,
                note: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
                progress: Callable[[int, int, str], None] = print_progress) -> list[dict]:
    """One row per shape, pass and provider available on `device` (see measure)."""
    with warnings.catch_warnings():  # SDPA warns why a backend refuses a shape; the rows say it once
        warnings.simplefilter("ignore", UserWarning)
        providers = available_providers(device, dtype, note)
        cases = [(s, p, prov) for s in shapes for p in passes for prov in providers]
        rows = []
        for done, (shape, pass_, provider) in enumerate(cases, 1):
            rows.append(measure(provider, shape, pass_, device, dtype, budget_s))
            progress(done, len(cases), f"{shape.name} {pass_} {provider.name}: {_row_text(rows[-1])}")
    return rows


def memory_growth(rows: list[dict]) -> list[dict]:
    """Per provider and pass over rows of one head geometry at several lengths: the peaks, and the
    exponent p of peak ~ tokens^p fitted between the two longest measured lengths (1: O(N), no
    Sq x Sk buffer; 2: a score matrix)."""
    growth = []
    for provider, pass_ in dict.fromkeys((r["provider"], r["pass"]) for r in rows):
        points = sorted((r["q_tokens"], r["peak_extra_mib"]) for r in rows
                        if (r["provider"], r["pass"]) == (provider, pass_) and r["peak_extra_mib"])
        exponent = None
        if len(points) >= 2:
            (n0, m0), (n1, m1) = points[-2:]
            exponent = math.log(m1 / m0) / math.log(n1 / n0)
        growth.append({"provider": provider, "pass": pass_, "tokens": [n for n, _ in points],
                       "peak_extra_mib": [m for _, m in points], "exponent": exponent})
    return growth


def run_meta(device: torch.device, dtype: torch.dtype) -> dict:
    """Versions, device and the kernels' state for a results file."""
    return {
        "rdna_flash_attn": __version__,
        "torch": torch.__version__,
        "hip": torch.version.hip,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": asdict(devices.describe(device)),
        "dtype": _dtype_name(dtype),
        # why the kernels were off, or which artifact ran (cached verdicts: nothing runs again)
        "kernels": router.device_refusal(device) or router.selftest_refusal(device) or attention.artifact_info(device),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flops_convention": "forward 4*B*H*Sq*Sk*D, backward 2.5x forward",
    }


# --- whole models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelProvider:
    """An attention provider for a whole model: a context under which its attention calls run."""

    name: str
    description: str
    context: Callable[[], ContextManager]


def model_providers(device: torch.device, note: Callable[[str], None]) -> list[ModelProvider]:
    """The kernels through the SDPA patch (where they run on `device`), SDPA's math backend (what
    ZLUDA users get) and PyTorch's own per-call choice of SDPA backend (the best SDPA here)."""
    providers = []
    kernels = kernel_provider(device)
    if isinstance(kernels, str):
        note(f"kernels not benchmarked: {kernels}")
    else:
        providers.append(ModelProvider(
            "rdna_fa", "rdna_flash_attn.patch_sdpa(): torch's SDPA routed through the dispatcher", patch_sdpa))
    math_only = _sdpa_backend_context("math")
    if math_only is not None:
        providers.append(ModelProvider("sdpa-math", "SDPA limited to its math backend (the ZLUDA default)", math_only))
    providers.append(ModelProvider(
        "sdpa-default", "SDPA as PyTorch dispatches it: its best available backend per call", contextlib.nullcontext))
    return providers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def open_results_folder(out: str | None) -> Path | None:
    """The results folder made and named on the first line of output, or None after one line saying why not."""
    try:
        folder = results_folder.prepare(out)
    except results_folder.FolderError as error:
        print(f"bench: {error}", file=sys.stderr)
        return None
    print(f"results: {folder}", flush=True)
    return folder


def run(args: argparse.Namespace) -> int:
    """The `bench` verb: the benchmark where the kernels run; elsewhere one line naming the lab's bench."""
    unknown = selected_shapes(args, False)
    if isinstance(unknown, str):
        print(unknown, file=sys.stderr)
        return 2
    device = default_device(args)
    kernels = kernel_provider(device)
    if isinstance(kernels, str):
        print(f"bench: the kernels do not run on {device}: {kernels}; the shipped code objects on the CPU "
              f"interpreter and their expected speed per RDNA GPU: {lab_command('bench')}", file=sys.stderr)
        return 2
    out_dir = open_results_folder(args.out)
    if out_dir is None:
        return 2
    return run_benchmark(args, device, out_dir)


def run_benchmark(args: argparse.Namespace, device: torch.device, out_dir: Path) -> int:
    """The kernels against SDPA's backends on `device`, where the kernels run."""
    dtype = DTYPES[args.dtype or ("fp32" if device.type == "cpu" else "fp16")]
    quick = args.quick or (device.type == "cpu" and not args.full)
    shapes = selected_shapes(args, quick)
    info = devices.describe(device)
    print(f"bench on {info.name} ({device}), {_dtype_name(dtype)}, {len(shapes)} shapes"
          f"{' (quick set)' if quick else ''}", file=sys.stderr)
    passes = ("forward",) if args.no_backward else ("forward", "backward")
    rows = measure_all(shapes, passes, device, dtype, args.budget)
    meta = dict(run_meta(device, dtype), quick=quick)
    stem = f"bench-{re.sub(r'[^A-Za-z0-9]+', '-', info.name).strip('-').lower()}-{meta['dtype']}"
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1), encoding="utf-8")
    print(summary_table(rows))
    print(f"wrote {json_path}")
    try:
        plot(rows, out_dir / f"{stem}.png", f"rdna_flash_attn {__version__}: {info.name}, {meta['dtype']}")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    else:
        print(f"wrote {out_dir / f'{stem}.png'}")
    return 0
