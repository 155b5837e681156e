"""The end-to-end benchmark suite, one command:

    python -m bench.suite --out DIR                   # from a clone of the repository, in the host's Python

1. kernels: forward and backward on the attention shapes of DESIGN.md section 4, the kernels against
   every SDPA backend the device offers (time, TFLOP/s, peak extra memory);
2. memory: one head geometry at growing sequence lengths, peak extra memory and its growth exponent
   (1 = O(N); 2 = a Sq x Sk buffer);
3. generation: UNet sampling (SD1.5 at 512/768/1024 px, SDXL at 1024 and 1536x1024, batch 1 and 4)
   with the kernels, SDPA math and PyTorch's default SDPA: it/s and peak VRAM (bench/generation.py);
4. vae: VAE decode at 512 and 1024 px, the same providers plus diffusers' sliced attention
   (bench/vae_decode.py);
5. static: the static report of the code objects and the gfx1100 throughput estimates, next to the
   targets of DESIGN.md section 5 (from bench/results/).

Writes one JSON (`suite-<gpu>-<dtype>.json`), one PNG per part with numbers and `<stem>.md`, the
tables of the results page for this run. Parts 3 and 4 need diffusers and are skipped with a message
without it. On a CPU (or with --size tiny) everything runs at tiny sizes in a minute or two.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bench import design_targets, generation, results_page, vae_decode
from rdna_flash_attn.tools import benchmark

REPO = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
PARTS = ("kernels", "memory", "generation", "vae", "static")
TINY_KERNEL_SHAPES = ("sd15-mid-64", "sd15-cross-1024")
DIFFUSERS_HINT = "pip install diffusers (the suite was written against diffusers 0.42.1)"



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="folder for the JSON, PNGs and tables (default: current folder)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(benchmark.DTYPES), help="default fp16 on a GPU, fp32 on a CPU")
    parser.add_argument("--size", choices=("full", "tiny"), help="full on a GPU, tiny on a CPU (default)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of timing per kernel case (default 0.3)")
    parser.add_argument("--steps", type=int, help="timed denoising steps per generation run (full 4, tiny 1)")
    parser.add_argument("--vae-repeats", type=int, help="timed decodes per VAE run (full 3, tiny 1)")
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results",
                        help="where the static report and estimates are (default: bench/results)")
    return parser


class Progress:
    """Part headers and one bar line per case on stderr (a results table follows on stdout)."""

    def __init__(self, parts: list[str]):
        self.parts = parts
        self.started = time.perf_counter()

    def part(self, name: str, text: str = "") -> None:
        index = self.parts.index(name) + 1
        elapsed = time.perf_counter() - self.started
        print(f"== part {index}/{len(self.parts)}: {name} {text} ({elapsed:.0f} s so far) ==", file=sys.stderr,
              flush=True)

    @staticmethod
    def case(done: int, total: int, text: str) -> None:
        benchmark.print_progress(done, total, text)

    @staticmethod
    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def _diffusers_skip(progress: Progress) -> dict | None:
    """The part's result when diffusers is not installed (noted in the progress), else None."""
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        missing = f"skipped: diffusers is not installed ({exc}); {DIFFUSERS_HINT}"
        progress.note(missing)
        return {"skipped": missing, "rows": []}
    return None


def run_kernels(device, dtype, size: str, budget: float, progress: Progress) -> dict:
    shapes = benchmark.SHAPES if size == "full" else tuple(s for s in benchmark.SHAPES if s.name in TINY_KERNEL_SHAPES)
    rows = benchmark.measure_all(shapes, ("forward", "backward"), device, dtype, budget, progress.note, progress.case)
    return {"rows": rows}


def run_memory(device, dtype, size: str, progress: Progress) -> dict:
    tokens = benchmark.SWEEP_TOKENS if size == "full" else benchmark.QUICK_SWEEP_TOKENS
    shapes = benchmark.sweep_shapes(tokens)
    # memory, not time, is the point: the shortest timing budget
    rows = benchmark.measure_all(shapes, ("forward", "backward"), device, dtype, 0.0, progress.note, progress.case)
    return {"rows": rows, "growth": benchmark.memory_growth(rows)}


def run_generation(device, dtype, size: str, steps: int, progress: Progress) -> dict:
    skipped = _diffusers_skip(progress)
    if skipped:
        return skipped
    providers = benchmark.model_providers(device, progress.note)
    rows = generation.run(generation.configs(size), providers, device, dtype, steps, progress.case)
    return {"rows": rows, "providers": {p.name: p.description for p in providers},
            "sampler": f"Euler, {steps} timed steps after 1 warm-up step, CFG {generation.GUIDANCE}, "
                       f"random {generation.TEXT_TOKENS}-token text embeddings, random weights"}


def run_vae(device, dtype, size: str, repeats: int, progress: Progress) -> dict:
    skipped = _diffusers_skip(progress)
    if skipped:
        return skipped
    providers = benchmark.model_providers(device, progress.note)
    rows = vae_decode.run(size, providers, device, dtype, repeats, progress.case)
    descriptions = {p.name: p.description for p in providers}
    descriptions[vae_decode.SLICED_NAME] = vae_decode.SLICED_DESCRIPTION
    return {"rows": rows, "providers": descriptions}


def file_stem(meta: dict) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "-", meta["device"]["name"]).strip("-").lower()
    return f"suite-{name}-{meta['dtype']}"


def write_json(data: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{file_stem(data['meta'])}.json"
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return path


def write_outputs(data: dict, out_dir: Path, note: Callable[[str], None]) -> list[Path]:
    """The JSON, a PNG per part with numbers (when matplotlib is there) and the Markdown tables."""
    stem = file_stem(data["meta"])
    json_path = write_json(data, out_dir)
    written = [json_path]
    try:
        images = results_page.write_plots(data, out_dir, stem)
    except ImportError:
        note("matplotlib is not installed: no plots")
        images = []
    written += images
    markdown = out_dir / f"{stem}.md"
    markdown.write_text(results_page.run_section(data, [p.name for p in images], json_path.name), encoding="utf-8")
    return written + [markdown]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"unknown parts: {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = benchmark.DTYPES[args.dtype or ("fp16" if device.type == "cuda" else "fp32")]
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    steps = args.steps or (4 if size == "full" else 1)
    repeats = args.vae_repeats or (3 if size == "full" else 1)
    progress = Progress(parts)
    meta = dict(benchmark.run_meta(device, dtype), size=size, parts=parts, budget_s=args.budget)
    progress.note(f"suite on {meta['device']['name']} ({device}), {meta['dtype']}, {size} size, "
                  f"parts: {', '.join(parts)}")
    data: dict = {"schema": SCHEMA_VERSION, "meta": meta, "targets": list(design_targets.TARGETS)}
    runners = {
        "kernels": lambda: run_kernels(device, dtype, size, args.budget, progress),
        "memory": lambda: run_memory(device, dtype, size, progress),
        "generation": lambda: run_generation(device, dtype, size, steps, progress),
        "vae": lambda: run_vae(device, dtype, size, repeats, progress),
        "static": lambda: design_targets.static_summary(args.results_dir),
    }
    for part in parts:
        progress.part(part)
        start = time.perf_counter()
        data[part] = dict(runners[part](), seconds=time.perf_counter() - start)
        write_json(data, Path(args.out))  # a run cut short keeps the parts it finished
    meta["seconds"] = time.perf_counter() - progress.started
    for path in write_outputs(data, Path(args.out), progress.note):
        print(f"wrote {path}")
    print(results_page.headline(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
