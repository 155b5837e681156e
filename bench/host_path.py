"""Host cost per attention call on a tiny shape: torch's own SDPA against the drop-in
`rdna_flash_attn.scaled_dot_product_attention`, end to end and by part (the dispatch decision alone,
`ops.flash_attention_forward` alone).

    RDNA_FA_FORCE=1 python -m bench.host_path --out bench/out     # NVIDIA: the emulation build

The shapes are so small that the GPU work is a few microseconds, so the time is the host's. Each
sample is a batch of calls timed up to the moment the last one returns (`host_us`: the Python and
launch cost, the launches queued but not waited for), then synchronised (`wall_us`: as host_us unless
the GPU is the slower side). Medians over the samples; the parts take turns within every sample, and
each part's ratio to torch's SDPA is the median of its per-sample ratios, so a host whose speed drifts
during the run does not skew the comparison. Writes host_path.json and host_path.png under
--out, with a progress line per measurement; --profile also writes cProfile tables of the drop-in.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import rdna_flash_attn as rfa
from rdna_flash_attn.dispatch import planner, router as dispatch
from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.runtime import device as _device

TARGET_US = 30.0  # issue 13: the drop-in within 30 us per call, about 1.2x torch's SDPA
# (name, batch, heads, tokens, head dim, layout): BHSD as allocated; BSHD a transposed view, as
# diffusers and ComfyUI hand attention its tensors.
SHAPES = (("tiny-bhsd", 1, 2, 64, 64, "bhsd"), ("tiny-bshd", 1, 2, 64, 64, "bshd"))


def _inputs(batch, heads, tokens, dim, layout, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    if layout == "bshd":
        return [torch.randn(batch, tokens, heads, dim, generator=gen, device=device, dtype=dtype).transpose(1, 2)
                for _ in range(3)]
    return [torch.randn(batch, heads, tokens, dim, generator=gen, device=device, dtype=dtype) for _ in range(3)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_parts(parts: dict, device: torch.device, calls: int, samples: int) -> dict[str, dict]:
    """Microseconds per call of each part: median and min of `samples` batches of `calls` calls. The
    parts take turns within every sample (in rotating order), so a host that speeds up or slows down
    during the run shifts them alike; `vs_first` is the median over samples of the part's time over
    the first part's in the same sample."""
    for fn in parts.values():  # warm-up: first-use work, allocator growth
        for _ in range(calls):
            fn()
    _sync(device)
    names = list(parts)
    host, wall = {n: [] for n in names}, {n: [] for n in names}
    for sample in range(samples):
        for name in names[sample % len(names):] + names[:sample % len(names)]:
            fn = parts[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            host[name].append((issued - start) / calls * 1e6)
            wall[name].append((done - start) / calls * 1e6)
    return {n: {"host_us": statistics.median(host[n]), "host_us_min": min(host[n]),
                "wall_us": statistics.median(wall[n]), "calls_per_sample": calls, "samples": samples,
                "vs_first": statistics.median(h / f for h, f in zip(host[n], host[names[0]]))} for n in names}


def parts(q, k, v) -> dict:
    """What is timed: name -> zero-argument call."""
    return {
        "torch sdpa": lambda: dispatch.torch_sdpa(q, k, v),
        "rdna_fa drop-in": lambda: rfa.scaled_dot_product_attention(q, k, v),
        "dispatch decision": lambda: planner.plan_attention(q, k, v),
        "ops forward": lambda: ops.flash_attention_forward(q, k, v),
    }


def profile_text(fn, calls: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = list(dict.fromkeys(r["part"] for r in rows))
    cells = {(r["shape"], r["part"]): r["host_us"] for r in rows}
    fig = Figure(figsize=(8.5, 1.2 + 0.9 * len(names) * len(shapes) / 2))
    ax = fig.add_subplot(1, 1, 1)
    height = 0.8 / len(shapes)
    for i, shape in enumerate(shapes):
        values = [cells.get((shape, name), 0.0) for name in names]
        bars = ax.barh([y + i * height for y in range(len(names))], values, height, label=shape)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(names))], names)
    ax.invert_yaxis()
    ax.axvline(TARGET_US, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_US:g} us")
    ax.set_xlabel("host microseconds per call (median)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample (below the launch queue depth)")
    parser.add_argument("--samples", type=int, default=25)
    parser.add_argument("--profile", action="store_true", help="also write cProfile tables of the drop-in")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    info = _device.describe(device)
    print(f"host path on {info.name} ({device}), {args.dtype}, torch {torch.__version__}", file=sys.stderr, flush=True)

    rows, profiles = [], {}
    with torch.no_grad():
        for name, batch, heads, tokens, dim, layout in SHAPES:
            q, k, v = _inputs(batch, heads, tokens, dim, layout, device, dtype)
            verdict = rfa.explain(q, k, v)
            print(f"{name}: {verdict}", file=sys.stderr, flush=True)
            on_kernels = verdict.startswith("runs on the kernels")
            timed = parts(q, k, v)
            if not on_kernels:
                del timed["ops forward"]  # the kernels cannot run here: nothing to time
            for part, result in time_parts(timed, device, args.calls, args.samples).items():
                rows.append({"shape": name, "part": part, "batch": batch, "heads": heads, "tokens": tokens,
                             "head_dim": dim, "layout": layout, "on_kernels": on_kernels, **result})
                print(f"[{len(rows):>2}] {name:<10} {part:<18} host {result['host_us']:7.2f} us "
                      f"(min {result['host_us_min']:.2f}), wall {result['wall_us']:7.2f} us, "
                      f"{result['vs_first']:.2f}x torch sdpa", file=sys.stderr, flush=True)
            if args.profile:
                profiles[name] = profile_text(parts(q, k, v)["rdna_fa drop-in"], args.calls * 10)

    meta = {
        "device": info.name, "backend": info.backend, "torch": torch.__version__, "python": platform.python_version(),
        "dtype": args.dtype, "stats": rfa.stats(), "target_us": TARGET_US,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    json_path = args.out / "host_path.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {json_path}", file=sys.stderr)
    for name, text in profiles.items():
        (args.out / f"host_path_profile_{name}.txt").write_text(text)
    for row in rows:
        print(f"{row['shape']:<10} {row['part']:<18} {row['host_us']:7.2f} us  {row['vs_first']:.2f}x torch sdpa")
    try:
        plot(rows, args.out / "host_path.png", f"host cost per call, {info.name}, {args.dtype}")
        print(f"wrote {args.out / 'host_path.png'}", file=sys.stderr)
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
