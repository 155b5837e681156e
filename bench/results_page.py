"""The results page users read, generated from recorded suite runs (bench/suite.py JSON):

    python -m bench.results_page                       # bench/results/suite-*.json -> bench/README.md + plots

Every number on the page comes from a JSON file named next to it; the page says on which GPU each
was measured, whether the kernels ran as the NVIDIA emulation (correctness and memory, not speed),
and that RDNA throughput is an estimate until someone measures it on RDNA hardware.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.design_targets import TARGETS, static_summary
from rdna_flash_attn.tools import benchmark

REPO = Path(__file__).resolve().parent.parent
GIB = 1024.0
RDNA_BACKENDS = ("rocm", "zluda")
SD15_1024 = "sd15 1024x1024 batch 1"
SHARE = """\
## Run it on your Radeon and share the numbers

Nobody on the project has measured these kernels on an RDNA GPU yet: your run is the first real data.
On Windows (ZLUDA or ROCm) or Linux (ROCm), in the Python environment your UI uses, from a clone of
this repository:

```sh
pip install diffusers==0.42.1        # only for the generation and VAE parts; without it they are skipped
python -m rdna_flash_attn doctor     # the kernels should say ON for your GPU
python -m bench.suite --size tiny --out my-results   # a one-minute check of the setup
python -m bench.suite --out my-results
```

The full run writes `my-results/suite-<your gpu>-float16.json`, one PNG per part and
`suite-<your gpu>-float16.md` with the same tables as this page; progress is shown as it goes. How
long it takes on RDNA is not known yet (minutes, mostly the SDPA math runs). A configuration whose
SDPA-math score buffers cannot fit in your VRAM is skipped and says so, and one that runs out of
memory anyway is recorded as skipped rather than ending the run; on Windows the driver may instead
spill into shared system memory and crawl, so close other GPU programs first. For a subset, run the
suite script directly, e.g. `python -m bench.suite --parts kernels,memory,vae --out my-results`
(`--help` lists the options).

To share: open an issue titled "bench: <GPU>, <OS>, <ZLUDA or ROCm version>", attach the JSON (and
the PNGs if you like) and paste the output of `python -m rdna_flash_attn doctor`. The JSON holds the
device name, gfx target, runtime, PyTorch, Python and package versions, the OS string and the
numbers; nothing else about your machine.
"""

# --- derived numbers -------------------------------------------------------------------------------


def _rows(data: dict, part: str) -> list[dict]:
    return (data.get(part) or {}).get("rows", [])


def _cell(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _emulated(data: dict) -> bool:
    kernels = data["meta"].get("kernels")
    return isinstance(kernels, dict) and bool(kernels.get("emulated"))


def _on_rdna(data: dict) -> bool:
    device = data["meta"]["device"]
    return device.get("backend") in RDNA_BACKENDS and bool(device.get("gfx_target")) and not _emulated(data)


def sd15_1024_comparison(data: dict) -> dict | None:
    """Kernels against SDPA math at SD1.5 1024 px batch 1: peak VRAM ratio and speed-up, where both ran."""
    rows = _rows(data, "generation")
    kernels = _cell(rows, config=SD15_1024, provider="rdna_fa")
    math = _cell(rows, config=SD15_1024, provider="sdpa-math")
    if not kernels or not math or kernels.get("skipped") or math.get("skipped"):
        return None
    ratio = None
    if kernels.get("peak_allocated_mib") and math.get("peak_allocated_mib"):
        ratio = kernels["peak_allocated_mib"] / math["peak_allocated_mib"]
    return {"vram_ratio": ratio, "speedup": kernels["it_per_s"] / math["it_per_s"],
            "kernels_gib": (kernels.get("peak_allocated_mib") or 0) / GIB or None,
            "math_gib": (math.get("peak_allocated_mib") or 0) / GIB or None}


def kernel_memory_check(data: dict) -> dict | None:
    """The kernels' largest peak extra memory relative to the O(N) minimum (outputs + LSE / gradients)
    over every kernel-level shape, and the growth exponents of the memory sweep."""
    rows = [r for r in _rows(data, "kernels") + _rows(data, "memory")
            if r["provider"] == "rdna_fa" and r.get("peak_extra_mib") is not None]
    growth = {(g["provider"], g["pass"]): g["exponent"] for g in (data.get("memory") or {}).get("growth", [])}
    if not rows:
        return None
    worst = max(rows, key=lambda r: r["peak_extra_mib"] / r["linear_mib"])
    return {"worst_ratio": worst["peak_extra_mib"] / worst["linear_mib"],
            "worst_shape": f"{worst['shape']} {worst['pass']}",
            "worst_scores_share": worst["peak_extra_mib"] / worst["scores_mib"],
            "exponents": {f"{p} {pass_}": e for (p, pass_), e in growth.items() if e is not None}}


def _estimate_basis(estimates: list[dict]) -> str:
    """What a run's recorded estimates rest on: the speed model, or (runs recorded before it) the pipe model."""
    if all(e.get("basis") == "speed model" for e in estimates):
        return ("static estimate from instruction counts in named cycle terms, its stall band fitted on published "
                "measurements of other kernels (results/speed_model.md); not measured")
    if all(e.get("calibrated") for e in estimates):
        return ("static estimate from instruction counts, calibrated against published measurements of external "
                "kernels (results/estimator_calibration.md); not measured")
    return "static estimate from instruction counts, not calibrated (recorded before the calibration); not measured"


def _range(estimates: list[dict], dtype: str = "f16") -> str:
    parts = [f"{e['tflops_pessimistic']:.0f}-{e['tflops_optimistic']:.0f} (d{e['head_dim']})"
             for e in estimates if e["target"] == "gfx1100" and e["dtype"] == dtype]
    return ", ".join(parts) or "-"


def evaluate_targets(data: dict) -> list[dict]:
    """DESIGN.md section 5's targets with where this run (and the recorded estimates) stand."""
    static = data.get("static") or {}
    device = data["meta"]["device"]["name"]
    basis_run = f"measured on {device}" + (" (kernels through the NVIDIA emulation)" if _emulated(data) else "")
    result = {}
    if static.get("forward_estimate"):
        result["forward"] = (f"estimate {_range(static['forward_estimate'])} TFLOP/s f16",
                             _estimate_basis(static["forward_estimate"]))
    if static.get("backward_estimate"):
        result["backward"] = (f"estimate {_range(static['backward_estimate'])} TFLOP/s f16",
                              _estimate_basis(static["backward_estimate"]))
    memory = kernel_memory_check(data)
    if memory:
        exponents = ", ".join(f"{k} {v:.2f}" for k, v in sorted(memory["exponents"].items()))
        result["memory"] = (f"kernels' peak extra memory <= {memory['worst_ratio']:.2f}x outputs + LSE / gradients "
                            f"(worst: {memory['worst_shape']}); growth exponent vs tokens: {exponents or '-'}",
                            basis_run + "; allocations are made by the same Python layer on every GPU")
    comparison = sd15_1024_comparison(data)
    if comparison and comparison["vram_ratio"] is not None:
        speed = f"speed {comparison['speedup']:.2f}x"
        speed += " (emulation: says nothing about RDNA)" if _emulated(data) else ""
        result["sd15_1024"] = (f"peak VRAM {comparison['kernels_gib']:.2f} vs {comparison['math_gib']:.2f} GiB = "
                               f"{comparison['vram_ratio']:.2f}x; {speed}", basis_run)
    if static.get("static"):
        s = static["static"]
        met = s["scratch_bytes"] == 0 and s["spills"] == 0 and s["max_lds_bytes"] <= 65536 and not s["problems"]
        result["static"] = (f"{'met' if met else 'NOT met'}: {s['kernels']} kernels, {len(s['targets'])} targets, "
                            f"scratch {s['scratch_bytes']} B, spills {s['spills']}, max LDS {s['max_lds_bytes']} B",
                            "static report of the prebuilt code objects")
    return [dict(t, result=result.get(t["id"], ("not in this run", ""))[0], basis=result.get(t["id"], ("", ""))[1])
            for t in data.get("targets", [])]


def kernel_calls(data: dict, part: str) -> str:
    """How many of the model's attention calls the kernels took, and why the others fell back."""
    kernel = fallback = 0
    reasons: dict[str, int] = {}
    for row in _rows(data, part):
        calls = row.get("attention_calls") or {}
        kernel += calls.get("kernel", 0)
        fallback += calls.get("fallback", 0)
        for reason, count in calls.get("fallback_reasons", {}).items():
            reasons[reason] = reasons.get(reason, 0) + count
    if not kernel + fallback:
        return ""
    why = "; ".join(f"{count} x {reason}" for reason, count in sorted(reasons.items()))
    return f"With `rdna_fa`, {kernel} of {kernel + fallback} attention calls ran on the kernels" + (
        f", {fallback} fell back to SDPA ({why})." if fallback else ", none fell back.")


def headline(data: dict) -> str:
    """A few lines for the console at the end of a run."""
    lines = [f"suite on {data['meta']['device']['name']}: {data['meta'].get('seconds', 0):.0f} s"]
    comparison = sd15_1024_comparison(data)
    if comparison and comparison["vram_ratio"] is not None:
        lines.append(f"SD1.5 1024px batch 1: peak VRAM kernels / SDPA math = {comparison['vram_ratio']:.2f} "
                     f"(target <= 0.33), speed {comparison['speedup']:.2f}x")
    memory = kernel_memory_check(data)
    if memory:
        lines.append(f"kernels' peak extra memory: at most {memory['worst_ratio']:.2f}x the O(N) outputs "
                     f"({memory['worst_shape']})")
    if _emulated(data):
        lines.append("kernels ran through the NVIDIA emulation build: their times are not RDNA speed")
    return "\n".join(lines)


# --- tables ----------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _speed(row: dict | None, key: str, spec: str) -> str:
    if row is None:
        return "-"
    return "skipped" if row.get("skipped") else _fmt(row.get(key), spec)


def _gib(row: dict | None) -> str:
    peak = (row or {}).get("peak_allocated_mib")
    return _fmt(None if peak is None else peak / GIB)


def _providers(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["provider"] for r in rows))


def generation_table(data: dict) -> str:
    rows = _rows(data, "generation")
    providers = _providers(rows)
    header = ["configuration", "UNet batch"] + [f"{p} it/s" for p in providers] + [f"{p} peak GiB" for p in providers]
    header.append("VRAM kernels / math")
    body = []
    for config in dict.fromkeys(r["config"] for r in rows):
        cells = {r["provider"]: r for r in rows if r["config"] == config}
        first = next(iter(cells.values()))
        speed = [_speed(cells.get(p), "it_per_s", ".2f") for p in providers]
        memory = [_gib(cells.get(p)) for p in providers]
        k, m = cells.get("rdna_fa", {}), cells.get("sdpa-math", {})
        ratio = (k["peak_allocated_mib"] / m["peak_allocated_mib"]
                 if k.get("peak_allocated_mib") and m.get("peak_allocated_mib") else None)
        body.append([config, str(first.get("unet_batch", 2 * first["batch"]))] + speed + memory + [_fmt(ratio)])
    skipped = [f"- {r['config']}, {r['provider']}: {r['skipped']}" for r in rows if r.get("skipped")]
    return _table(header, body) + ("\n\n" + "\n".join(skipped) if skipped else "")


def vae_table(data: dict) -> str:
    rows = _rows(data, "vae")
    providers = _providers(rows)
    header = ["decode", "attention tokens"] + [f"{p} ms" for p in providers] + [f"{p} peak GiB" for p in providers]
    body = []
    for config in dict.fromkeys(r["config"] for r in rows):
        cells = {r["provider"]: r for r in rows if r["config"] == config}
        first = next(iter(cells.values()))
        body.append([config, str(first["attention_tokens"])]
                    + [_speed(cells.get(p), "ms", ".1f") for p in providers] + [_gib(cells.get(p)) for p in providers])
    return _table(header, body)


def kernel_table(data: dict) -> str:
    rows = _rows(data, "kernels")
    providers = _providers(rows)
    header = (["shape", "B x H x Sq x Sk x D", "pass"] + [f"{p} TFLOP/s" for p in providers]
              + ["kernels peak extra MiB", "O(N) minimum MiB", "one Sq x Sk matrix MiB", "math peak extra MiB"])
    body = []
    for shape, pass_ in dict.fromkeys((r["shape"], r["pass"]) for r in rows):
        cells = {r["provider"]: r for r in rows if (r["shape"], r["pass"]) == (shape, pass_)}
        first = next(iter(cells.values()))
        dims = f"{first['batch']}x{first['heads']}x{first['q_tokens']}x{first['k_tokens']}x{first['head_dim']}"
        tflops = [_fmt(cells[p]["tflops"], ".3g", "n/a" if cells[p]["error"] else "-") if p in cells else "-"
                  for p in providers]
        kernels, math = cells.get("rdna_fa", {}), cells.get("sdpa-math", {})
        body.append([shape, dims, pass_] + tflops + [
            _fmt(kernels.get("peak_extra_mib"), ".1f"), _fmt(first["linear_mib"], ".1f"),
            _fmt(first["scores_mib"], ".0f"), _fmt(math.get("peak_extra_mib"), ".0f")])
    notes = sorted({f"- {r['provider']} {r['shape']} {r['pass']}: {r['error']}" for r in rows if r["error"]})
    return _table(header, body) + ("\n\n<details><summary>cases without a time</summary>\n\n" + "\n".join(notes)
                                   + "\n</details>" if notes else "")


def memory_table(data: dict) -> str:
    memory = data.get("memory") or {}
    rows, growth = memory.get("rows", []), [g for g in memory.get("growth", []) if g["tokens"]]
    tokens = sorted({r["q_tokens"] for r in rows})
    header = ["provider", "pass"] + [f"{n} tokens" for n in tokens] + ["growth exponent"]
    body = []
    for g in growth:
        peaks = dict(zip(g["tokens"], g["peak_extra_mib"]))
        body.append([g["provider"], g["pass"]] + [_fmt(peaks.get(n), ".1f") for n in tokens] + [_fmt(g["exponent"])])
    if not body:
        return "No memory figures: this device has no allocator statistics (CPU)."
    first = rows[0]
    return (f"Peak extra memory in MiB, B x H x D = {first['batch']} x {first['heads']} x {first['head_dim']}, "
            f"Sq = Sk = tokens; exponent p of peak ~ tokens^p between the two longest lengths "
            f"(1: O(N); 2: an Sq x Sk buffer).\n\n" + _table(header, body))


def targets_table(data: dict) -> str:
    return _table(["what", "target (DESIGN.md section 5)", "where it stands", "basis"],
                  [[t["what"], t["target"], t["result"], t["basis"]] for t in evaluate_targets(data)])


def _device_statement(data: dict) -> str:
    meta = data["meta"]
    device = meta["device"]
    kernels = meta.get("kernels")
    where = f"Measured on **{device['name']}** ({device['backend']}"
    where += f", {device['gfx_target']}" if device.get("gfx_target") else ""
    where += f"), PyTorch {meta['torch']}, {meta['dtype']}, {meta['time']}, suite size `{meta.get('size')}`."
    if isinstance(kernels, str):
        return where + f" The kernels did not run: {kernels}."
    if _emulated(data):
        return where + (" The kernels ran through the **NVIDIA emulation build** (`" + Path(kernels["path"]).name
                        + "`): their times and it/s show that whole models run correctly on them and what memory they "
                        "use, **not RDNA speed**. The SDPA columns are this NVIDIA GPU's own backends.")
    if _on_rdna(data):
        name, digest = Path(kernels["path"]).name, kernels["sha256"][:12]
        return where + f" The kernels ran natively (`{name}`, sha256 {digest}…)."
    return where


def run_section(data: dict, images: list[str], json_name: str, level: str = "##") -> str:
    """Everything about one run: where it was measured, its tables and its plots."""
    sections = [f"{level} {data['meta']['device']['name']} ({json_name})", _device_statement(data)]
    titles = {"kernels": "Attention kernels", "memory": "Attention working memory against sequence length",
              "generation": "UNet sampling", "vae": "VAE decode", "static": "Targets"}
    describers = {"kernels": kernel_table, "memory": memory_table, "generation": generation_table, "vae": vae_table,
                  "static": targets_table}
    for part in data["meta"].get("parts", []):
        section = data.get(part) or {}
        sections.append(f"{level}# {titles[part]}")
        if section.get("skipped"):
            sections.append(section["skipped"])
            continue
        if part == "generation" and section.get("sampler"):
            sections.append(f"{section['sampler']}; peak = most memory allocated while sampling, weights included. "
                            + "; ".join(f"`{k}`: {v}" for k, v in section.get("providers", {}).items()) + ".")
        if part in ("generation", "vae") and kernel_calls(data, part):
            sections.append(kernel_calls(data, part))
        if part == "vae" and section.get("providers"):
            sections.append("; ".join(f"`{k}`: {v}" for k, v in section["providers"].items()) + ".")
        if part == "kernels":
            sections.append(f"Median time per call; TFLOP/s by {data['meta']['flops_convention']}. Peak extra = "
                            "memory a call allocates beyond its inputs; O(N) minimum = output + LSE (forward), dQ, dK, "
                            "dV + row deltas (backward).")
        sections.append(describers[part](data))
        sections += [f"![{part}]({name})" for name in images if name.endswith(f"-{part}.png")]
    return "\n\n".join(sections) + "\n"


# --- plots -----------------------------------------------------------------------------------------


def _bars(ax, rows: list[dict], value, label_key: str, ylabel: str, title: str) -> None:
    providers = _providers(rows)
    labels = list(dict.fromkeys(r[label_key] for r in rows))
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        cells = {r[label_key]: r for r in rows if r["provider"] == provider}
        heights = [value(cells[label]) if label in cells else 0 for label in labels]
        ax.bar([x + i * width for x in range(len(labels))], heights, width, label=provider)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _figure(panels: int):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    return Figure(figsize=(11, 4.2 * panels))


def write_plots(data: dict, out_dir: Path, stem: str) -> list[Path]:
    """`<stem>-<part>.png` for each part with numbers; raises ImportError without matplotlib."""
    import matplotlib  # noqa: F401

    device = data["meta"]["device"]["name"]
    device += " (kernels: NVIDIA emulation, not RDNA speed)" if _emulated(data) else ""
    written = []
    kernels = [r for r in _rows(data, "kernels") if r["tflops"] is not None]
    if kernels:
        path = out_dir / f"{stem}-kernels.png"
        benchmark.plot(kernels, path, f"attention, {device}")
        written.append(path)
    growth = [g for g in (data.get("memory") or {}).get("growth", []) if len(g["tokens"]) >= 2]
    if growth:
        fig = _figure(1)
        ax = fig.add_subplot(1, 1, 1)
        for g in growth:
            style = "-" if g["provider"] == "rdna_fa" else "--"
            ax.loglog(g["tokens"], g["peak_extra_mib"], marker="o", linestyle=style,
                      label=f"{g['provider']} {g['pass']} (exponent {_fmt(g['exponent'])})")
        ax.set_xlabel("tokens (Sq = Sk)")
        ax.set_ylabel("peak extra memory, MiB")
        ax.set_title(f"attention working memory, {device}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}-memory.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    for part, speed, speed_label in (("generation", "it_per_s", "it/s"), ("vae", "ms", "ms per decode")):
        rows = [r for r in _rows(data, part) if not r.get("skipped")]
        if not rows:
            continue
        fig = _figure(2)
        speed_axis = fig.add_subplot(2, 1, 1)
        _bars(speed_axis, rows, lambda r, k=speed: r.get(k) or 0, "config", speed_label, f"{part}, {device}")
        speed_axis.set_yscale("log")  # 512 px batch 1 and 1536x1024 batch 4 differ by two orders
        _bars(fig.add_subplot(2, 1, 2), rows, lambda r: (r.get("peak_allocated_mib") or 0) / GIB, "config",
              "peak memory, GiB", "peak memory allocated (weights included)")
        fig.tight_layout()
        path = out_dir / f"{stem}-{part}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


# --- the page --------------------------------------------------------------------------------------


def page(runs: list[tuple[dict, str, list[str]]]) -> str:
    """bench/README.md from (data, JSON path relative to bench/, image paths relative to bench/) per run."""
    measured = [f"{d['meta']['device']['name']}" + (" (kernels through the NVIDIA emulation)" if _emulated(d) else "")
                for d, _, _ in runs]
    rdna = [d["meta"]["device"]["name"] for d, _, _ in runs if _on_rdna(d)]
    intro = [
        "# Benchmark results",
        "<!-- Generated by bench/results_page.py from the JSON files named below; edit those, not this page. -->",
        "What the kernels do to speed and memory in Stable Diffusion workloads, from recorded runs of "
        "`bench/suite.py`.",
        "**Which GPU measured what.** " + ("Runs on this page: " + "; ".join(measured) + ". " if runs else
                                           "No suite run is recorded yet. ")
        + ("RDNA runs: " + ", ".join(rdna) + "." if rdna else
           "**No number on this page was measured on an RDNA GPU.** Kernel times and it/s from NVIDIA come from the "
           "emulation build that runs the RDNA kernel code on an NVIDIA GPU: they prove correctness and memory use, "
           "not speed. RDNA throughput figures are estimates from the code objects' instruction counts "
           "(bench/results/*_estimate_gfx1100.md) until measured on RDNA hardware.")
        + " Memory figures carry over: the kernels' allocations (output, LSE, gradients) are made by the same "
          "Python layer on every GPU, while SDPA's math backend (what ZLUDA users get) holds Sq x Sk buffers "
          "everywhere.",
        "Older recorded runs (kernel grids, sanitizers, LoRA training) are in [results/README.md](results/README.md).",
    ]
    body = []
    for data, json_rel, images in runs:
        body.append(run_section(data, images, json_rel).strip())
    if not runs:
        body.append("## Targets\n\n" + targets_table({"meta": {"device": {"name": "-"}, "kernels": None},
                                                       "targets": _default_targets(), "static": _static_only()}))
    return "\n\n".join(intro + body + [SHARE.strip()]) + "\n"


def _default_targets() -> list[dict]:
    return list(TARGETS)


def _static_only() -> dict:
    return static_summary(REPO / "bench" / "results")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path,
                        help="suite JSON files (default: bench/results/suite-*.json)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "README.md",
                        help="the page (default: bench/README.md)")
    args = parser.parse_args(argv)
    paths = args.runs or sorted((REPO / "bench" / "results").glob("suite-*.json"))
    runs = []
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        # The static report and estimates recorded beside the run may be newer than the run's copy.
        recorded = {k: v for k, v in static_summary(path.parent).items() if k != "missing"}
        data["static"] = {**(data.get("static") or {}), **recorded}
        images = write_plots(data, path.parent, path.stem)
        relative = [_relative(p, args.out.parent) for p in images]
        runs.append((data, _relative(path, args.out.parent), relative))
    args.out.write_text(page(runs), encoding="utf-8")
    print(f"wrote {args.out} from {len(runs)} run(s)")
    return 0


def _relative(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


if __name__ == "__main__":
    sys.exit(main())
