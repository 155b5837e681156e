"""The kernels' expected speed on each RDNA GPU the static estimator models, beside published
measurements of other kernels: expected_speed.json (made by bench/expected_speed.py from the
estimators' records), as text and as plot panels.

Every figure of ours is a static estimate, not a measurement: the forward and the backward from the speed
model in named cycle terms (its stall allowance fitted on published kernels), given at the two ends of the
stall band."""

from __future__ import annotations

import json
from pathlib import Path

DATA_FILE = Path(__file__).with_name("expected_speed.json")


def load(path: Path = DATA_FILE) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def band(values: list[float]) -> str:
    low, high = values
    return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"


def _shape(shape: list[int] | None) -> str:
    return "x".join(map(str, shape)) if shape else "shape not published"


def gpu_label(target: str, gpu: dict) -> str:
    return f"{gpu['gpu']} ({target})"


def table_lines(data: dict, backward_dtype: str = "f16") -> list[str]:
    """Our estimates per workload and GPU, then the backward per head dim."""
    gpus = data["gpus"]
    labels = [gpu_label(t, g) for t, g in gpus.items()]
    width = max(map(len, labels)) + 2
    head = f"{'':<48}" + "".join(f"{label:>{width}}" for label in labels)
    lines = [head]
    first = next(iter(gpus.values()))
    for index, workload in enumerate(first["forward_workloads"]):
        name = f"forward  {workload['workload']}"
        shape = f"{_shape(workload['shape'])} {workload['dtype']}"
        cells = "".join(f"{band(g['forward_workloads'][index]['tflops']):>{width}}" for g in gpus.values())
        lines.append(f"{name:<48}{cells}   {shape}")
    for index, row in enumerate(r for r in first["backward_by_head_dim"] if r["dtype"] == backward_dtype):
        cells = []
        for g in gpus.values():
            match = next(r for r in g["backward_by_head_dim"] if (r["dtype"], r["head_dim"]) == (backward_dtype,
                                                                                                 row["head_dim"]))
            cells.append(f"{band(match['tflops']):>{width}}")
        lines.append(f"{'backward d' + str(row['head_dim']) + ' ' + backward_dtype + ' (training)':<48}{''.join(cells)}"
                     f"   {data['by_head_dim'].split(',')[0]}")
    return lines


def published_lines(data: dict) -> list[str]:
    """The published measurements of other kernels, per GPU, with our estimate at the same shape."""
    lines = []
    for target, gpu in data["gpus"].items():
        lines.append(f"  {gpu_label(target, gpu)}:")
        for row in gpu["published"]:
            what = " ".join(str(x) for x in (row["pass"], row["dtype"] or "", f"d{row['head_dim']}" if row["head_dim"]
                                             else "") if x)
            ours = f"; ours there {band(row['ours'])}" if row["ours"] else ""
            lines.append(f"    {band(row['tflops']):>7}  {row['kernel']}: {what}, {_shape(row['shape'])}{ours}")
    return lines


def code_objects_note(data: dict, shipped: dict[str, str | None]) -> str | None:
    """One line when the estimates were made from other code objects than the shipped ones
    (`shipped`: target -> sha256), else None."""
    made = data["provenance"]["code_objects"]
    differ = sorted(t for t in made if shipped.get(t) and shipped[t] != made[t]["sha256"])
    if not differ:
        return None
    return (f"estimated on an earlier build of the {', '.join(differ)} code objects than the shipped ones "
            f"(sha256 {', '.join(made[t]['sha256'][:12] for t in differ)}; see provenance in the JSON)")


# --- plot --------------------------------------------------------------------------------------------


OURS, OURS_BAND, MEASURED = "tab:blue", "lightsteelblue", "tab:red"


def _ours_bar(ax, x: float, values: list[float], width: float, label: str | None) -> None:
    low, high = values
    ax.bar(x, low, width, color=OURS, label=label)
    ax.bar(x, high - low, width, bottom=low, color=OURS_BAND,
           label="the stall band's low end" if label else None)
    ax.text(x, high + 1.5, band(values), ha="center", fontsize=7)


SHAPELESS = ("darkred", "darkviolet", "saddlebrown", "darkgreen")  # published figures without a shape: lines


def _published_lines(ax, rows: list[dict]) -> None:
    """Published figures without a shape we could price ours at: a band (or line) each, in the legend."""
    for row, color in zip(rows, SHAPELESS):
        low, high = row["tflops"]
        where = f"d{row['head_dim']}, " if row["head_dim"] else ""
        label = f"measured (published): {row['kernel']}, {where}{band(row['tflops'])}"
        if high - low < 0.5:
            ax.axhline(low, color=color, ls="--", lw=1.2, label=label)
        else:
            ax.axhspan(low, high, color=color, alpha=0.25, label=label)


def plot_forward(ax, target: str, gpu: dict) -> None:
    """Our forward at the models' shapes, then each published kernel measured at a shape, beside ours at
    that shape where it was priced; published figures without a shape as lines."""
    labels, x, width = [], 0.0, 0.38
    for i, workload in enumerate(gpu["forward_workloads"]):
        _ours_bar(ax, x, workload["tflops"], width * 1.6, "ours: estimate (the stall band's high end)" if i == 0
                  else None)
        labels.append((x, f"{workload['workload'].split(',')[0]}\nd{workload['head_dim']} {workload['dtype']}"))
        x += 1
    ax.axvline(x - 0.5, color="gray", lw=0.8)
    first_measured = True
    for row in gpu["published"]:
        if row["pass"] != "forward" or not row["shape"]:
            continue
        if row["ours"]:
            _ours_bar(ax, x - width / 2, row["ours"], width, None)
        where = x + (width / 2 if row["ours"] else 0)
        ax.bar(where, row["tflops"][1], width, color=MEASURED, alpha=0.75, hatch="//",
               label="measured, other kernels (published)" if first_measured else None)
        ax.text(where, row["tflops"][1] + 1.5, band(row["tflops"]), ha="center", fontsize=7)
        first_measured = False
        labels.append((x, f"{row['kernel'].split(' (')[0]}\n{_shape(row['shape'])} {row['dtype'] or ''}"))
        x += 1
    _published_lines(ax, [r for r in gpu["published"] if r["pass"] == "forward" and not r["shape"]])
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=6.5, rotation=30, ha="right")
    ax.set_ylim(0, gpu["peak_tflops"] * 1.12)
    ax.axhline(gpu["peak_tflops"], color="black", lw=0.8)
    ax.text(x - 0.6, gpu["peak_tflops"] + 1.5, f"peak {gpu['peak_tflops']:g} (dense f16 WMMA)", fontsize=6.5,
            ha="right")
    ax.set_ylabel("TFLOP/s")
    low, high = gpu["speed_model"]["stall_band"]
    stall = f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"
    ax.set_title(f"{gpu_label(target, gpu)} forward, speed model (stall {stall} of the non-WMMA work): the "
                 "models' shapes | other kernels' shapes", fontsize=8.5)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    ax.grid(axis="y", alpha=0.3)


def plot_backward(ax, target: str, gpu: dict, dtype: str = "f16") -> None:
    rows = [r for r in gpu["backward_by_head_dim"] if r["dtype"] == dtype]
    for i, row in enumerate(rows):
        _ours_bar(ax, i, row["tflops"], 0.6, "ours: estimate (the stall band's high end)" if i == 0 else None)
    published = [r for r in gpu["published"] if r["pass"] == "backward"]
    _published_lines(ax, published)
    top = max([r["tflops"][1] for r in rows] + [r["tflops"][1] for r in published])
    ax.set_xticks(range(len(rows)), [f"d{r['head_dim']}" for r in rows], fontsize=7.5)
    ax.set_ylim(0, top * 1.35)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{gpu_label(target, gpu)} backward ({dtype}, as training runs it), estimate, 4096 tokens",
                 fontsize=8.5)
    ax.legend(fontsize=6, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
