"""CPU model of 8-bit attention's arithmetic (issue 24) against float64, before any 8-bit kernel exists.

Decides what an RDNA4 8-bit path can ship: which 8-bit format for Q K^T, which scale granularity, and
whether P and V in fp8 can meet the issue's bars. Each scheme is the arithmetic a gfx12 kernel would do
(exact products of 8-bit values; sums in fp32, as the fp8 WMMA accumulates, and exact for int8, whose
WMMA sums in int32: below 2^24 here; scales applied in fp32)
on inputs with the statistics that make 8-bit attention hard in diffusion models (see `diffusion_like`).
Judged as SageAttention's own evaluation judges its kernels: cosine similarity and relative L1 of the
output against the same attention in float64.

    python3 -m bench.quantized_attention_accuracy --json bench/results/quantized_attention_accuracy.json \\
        --md bench/results/quantized_attention_accuracy.md --png bench/results/quantized_attention_accuracy.png

Schemes (Q and K per block: Q per query row, K per 16 keys, one WMMA fragment; see BLOCKINGS for others):
  exact                 today's kernels: Q K^T of the 16-bit inputs in fp32, P rounded to the input dtype
  qk-int8 / qk-fp8      8-bit QK: K smoothed (its per-channel mean over the sequence subtracted: softmax
                        does not change, as q.mean is the same for every key of a row), Q and K quantized
                        to int8 or fp8 e4m3 with fp32 scales; P and V as in `exact`
  qk-int8-raw           qk-int8 without the smoothing (what the smoothing buys)
  qkpv-int8-fp8         8-bit QK+PV: qk-int8, then P (<= 1 after the row max) as fp8 e4m3 with the static
                        scale 448 and V in fp8 e4m3 with a per-channel scale over the sequence; fp32 sums
  qkpv-int8-fp8-vsmooth the same with V's per-channel mean subtracted before it is quantized and added
                        back after the division by the row sum (rows of P / l sum to 1)

Not modelled: the online softmax's rescaling (P is taken relative to the row's final maximum; a kernel
takes it relative to the running one, which only rescales values <= 1 that fp8 holds to the same relative
precision), and the order of the hardware's fp32 sums.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from rdna_flash_attn.tools.benchmark import SHAPES as MODEL_SHAPES, Shape

BARS = {"8-bit QK": {"cosine_min": 0.9995, "rel_l1_max": 0.01},
        "8-bit QK+PV": {"cosine_min": 0.999, "rel_l1_max": 0.03}}
SCHEMES = {"exact": None, "qk-int8": "8-bit QK", "qk-fp8": "8-bit QK", "qk-int8-raw": "8-bit QK",
           "qkpv-int8-fp8": "8-bit QK+PV", "qkpv-int8-fp8-vsmooth": "8-bit QK+PV"}
# (Q rows, K rows) sharing one scale. 1 x 16 costs a gfx12 kernel nothing: a query is one lane of the
# S^T accumulator and 16 keys one fragment, so each fragment's exponent takes one multiplier per lane.
BLOCKINGS = {"per row / 16 keys": (1, 16), "16 rows / 64 keys": (16, 64), "per row / per key": (1, 1)}
DEFAULT_BLOCKING = "per row / 16 keys"
INT8_MAX = 127.0
FP8_MAX = 448.0  # OCP e4m3 (gfx12's fp8), torch.float8_e4m3fn


# The models' shapes (the benchmark's table); the model evaluates `heads_sampled` heads and
# `rows_sampled` query rows of each, against every key: a row's output depends on all keys and on no
# other row.
SHAPE_NAMES = ("sd15-self-4096", "sd15-self-1024", "sd15-self-256", "sd15-cross-4096", "sdxl-self-4096",
               "sd3-joint-4250", "flux-joint-4608", "wan-self-32760", "wan-cross-32760")
SHAPES = tuple(next(s for s in MODEL_SHAPES if s.name == name) for name in SHAPE_NAMES)


def diffusion_like(shape: Shape, heads: int, rows: int, dtype: torch.dtype, generator: torch.Generator,
                   q_norm: float = 2.0):
    """Q, K, V with the features that break naive 8-bit attention in diffusion transformers and UNets.

    Per head and channel c (all draws from `generator`):
      Q[t, c] = a * (mu_q[c] + s_q[c] * z),  mu_q ~ N(0, 0.5^2), s_q ~ LogNormal(0, 0.5), a = q_norm
                (2 by default): large-norm queries, logits spread over several units (peaked rows);
                how the schemes' errors grow with a is reported beside (`SENSITIVITY`)
      K[t, c] = mu_k[c] + s_k[c] * z,        s_k ~ LogNormal(0, 0.5), mu_k ~ N(0, 0.5^2) except on
                max(1, d // 32) outlier channels, where mu_k = +-U(8, 16): a large offset shared by every
                token, as SageAttention found in real models' K (it dominates a block's range)
      V[t, c] = mu_v[c] + s_v[c] * z,        mu_v ~ N(0, 1), s_v ~ LogNormal(0, 0.5), x6 on one
                channel in 32
    with z ~ N(0, 1) per element, then rounded to the attention's input dtype."""

    def channels(mean_std: float) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.randn(heads, 1, shape.head_dim, generator=generator, dtype=torch.float64) * mean_std
        std = torch.exp(torch.randn(heads, 1, shape.head_dim, generator=generator, dtype=torch.float64) * 0.5)
        return mean, std

    def tokens(n: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        return mean + std * torch.randn(heads, n, shape.head_dim, generator=generator, dtype=torch.float64)

    mu_q, s_q = channels(0.5)
    mu_k, s_k = channels(0.5)
    outliers = max(1, shape.head_dim // 32)
    for h in range(heads):
        picked = torch.randperm(shape.head_dim, generator=generator)[:outliers]
        sign = torch.randint(0, 2, (outliers,), generator=generator, dtype=torch.float64) * 2 - 1
        magnitude = 8 + 8 * torch.rand(outliers, generator=generator, dtype=torch.float64)
        mu_k[h, 0, picked] = sign * magnitude
    mu_v, s_v = channels(1.0)
    s_v[:, :, ::32] *= 6
    q = q_norm * tokens(rows, mu_q, s_q)
    k = tokens(shape.k_tokens, mu_k, s_k)
    v = tokens(shape.k_tokens, mu_v, s_v)
    return tuple(x.to(dtype) for x in (q, k, v))


def blockwise_quantize(x: torch.Tensor, rows: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (heads, n, d) in fp32 -> (the 8-bit values as fp32, one fp32 scale per `rows` rows), x ~ q * scale."""
    heads, n, d = x.shape
    padded = -(-n // rows) * rows
    blocks = torch.nn.functional.pad(x, (0, 0, 0, padded - n)).view(heads, padded // rows, rows, d)
    limit = INT8_MAX if fmt == "int8" else FP8_MAX
    amax = blocks.abs().amax(dim=(2, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    scaled = (blocks / scale).clamp(-limit, limit)
    codes = torch.round(scaled) if fmt == "int8" else scaled.to(torch.float8_e4m3fn).float()
    return (codes.view(heads, padded, d)[:, :n], scale.expand(-1, -1, rows, 1).reshape(heads, padded, 1)[:, :n])


def fp8_per_channel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (heads, n, d) in fp32 -> (e4m3 values as fp32, one scale per head and channel)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float(), scale


def reference(q, k, v, softmax_scale: float) -> tuple[torch.Tensor, dict]:
    """float64 attention of the (rounded) inputs, and how peaked its rows are."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * softmax_scale
    p = torch.softmax(scores, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=-1) / math.log(p.shape[-1])
    peakedness = {"logit_std": float(scores.std(dim=-1).mean()), "max_probability": float(p.amax(dim=-1).mean()),
                  "entropy_over_uniform": float(entropy.mean())}
    return p @ v.double(), peakedness


def scheme_output(scheme: str, q, k, v, softmax_scale: float, blocking: tuple[int, int]) -> torch.Tensor:
    """The output a kernel computing `scheme` would produce, in the input dtype."""
    dtype = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    if scheme == "exact":
        scores = qf @ kf.transpose(-1, -2)
    else:
        qk_format = "fp8" if scheme == "qk-fp8" else "int8"
        if scheme != "qk-int8-raw":
            kf = kf - kf.mean(dim=1, keepdim=True)
        q8, q_scale = blockwise_quantize(qf, blocking[0], qk_format)
        k8, k_scale = blockwise_quantize(kf, blocking[1], qk_format)
        scores = (q8 @ k8.transpose(-1, -2)) * (q_scale * k_scale.transpose(-1, -2))
    scores = scores * softmax_scale
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    row_sum = p.sum(dim=-1, keepdim=True)
    if scheme.startswith("qkpv"):
        mean = vf.mean(dim=1, keepdim=True) if scheme.endswith("vsmooth") else torch.zeros_like(vf[:, :1])
        v8, v_scale = fp8_per_channel(vf - mean)
        p8 = (p * FP8_MAX).to(torch.float8_e4m3fn).float()
        out = (p8 @ v8) * (v_scale / FP8_MAX) / row_sum + mean
    else:
        out = (p.to(dtype).float() @ vf) / row_sum
    return out.to(dtype)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double().flatten(), ref.flatten()
    return {"cosine": float(torch.dot(o, r) / (o.norm() * r.norm())),
            "rel_l1": float((o - r).abs().sum() / r.abs().sum()),
            "max_abs_over_rms": float((o - r).abs().max() / r.pow(2).mean().sqrt())}


def passes(scheme: str, e: dict) -> bool | None:
    mode = SCHEMES[scheme]
    if mode is None:
        return None
    bar = BARS[mode]
    return e["cosine"] >= bar["cosine_min"] and e["rel_l1"] <= bar["rel_l1_max"]


def evaluate_case(shape: Shape, dtype: torch.dtype, heads: int, rows: int, seed: int, blockings, schemes,
                  q_norm: float = 2.0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    n_heads, n_rows = min(heads, shape.heads), min(rows, shape.q_tokens)
    q, k, v = diffusion_like(shape, n_heads, n_rows, dtype, generator, q_norm)
    softmax_scale = 1 / math.sqrt(shape.head_dim)
    ref, peakedness = reference(q, k, v, softmax_scale)
    results = []
    for blocking_name in blockings:
        for scheme in schemes:
            if scheme == "exact" and blocking_name != blockings[0]:
                continue
            e = errors(scheme_output(scheme, q, k, v, softmax_scale, BLOCKINGS[blocking_name]), ref)
            results.append({"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."), "q_norm": q_norm,
                            "heads_sampled": n_heads, "rows_sampled": n_rows, "inputs": peakedness,
                            "scheme": scheme, "mode": SCHEMES[scheme],
                            "blocking": None if scheme == "exact" else blocking_name, **e,
                            "passes": passes(scheme, e)})
    return results


def evaluate(shapes, dtypes, heads: int, rows: int, seed: int, blockings, progress=None) -> list[dict]:
    results = []
    for shape in shapes:
        for dtype in dtypes:
            results += evaluate_case(shape, dtype, heads, rows, seed, blockings, tuple(SCHEMES))
            if progress:
                progress(f"{shape.name} {dtype}")
    return results


# How the errors grow with the queries' norm (the generator's one free knob), at Flux's shape.
SENSITIVITY_Q_NORMS = (1.0, 2.0, 3.0, 4.0)
SENSITIVITY_SCHEMES = ("exact", "qk-int8", "qkpv-int8-fp8-vsmooth")


def sensitivity(heads: int, rows: int, seed: int, progress=None) -> list[dict]:
    flux = next(s for s in SHAPES if s.name == "flux-joint-4608")
    results = []
    for q_norm in SENSITIVITY_Q_NORMS:
        results += evaluate_case(flux, torch.float16, heads, rows, seed, (DEFAULT_BLOCKING, "per row / per key"),
                                 SENSITIVITY_SCHEMES, q_norm)
        if progress:
            progress(f"{flux.name} float16, queries x{q_norm:g}")
    return results


def _verdict(r: dict) -> str:
    return {None: "-", True: "pass", False: "**fail**"}[r["passes"]]


def markdown(results: list[dict], swept: list[dict], seed: int) -> str:
    lines = ["# 8-bit attention: CPU model of the arithmetic against float64 (issue 24)", "",
             "No kernel ran: `bench/quantized_attention_accuracy.py` computes what each scheme's kernel would, on "
             "inputs from its `diffusion_like` generator (outlier channels in K, large-norm Q), and compares the "
             f"output with float64 attention (seed {seed}). Bars: "
             + "; ".join(f"{m}: cosine >= {b['cosine_min']}, relative L1 <= {b['rel_l1_max']:.0%}"
                         for m, b in BARS.items()) + ".", "",
             "## Summary: worst case over the shapes and both dtypes", "",
             "| scheme | scales (Q rows / K rows) | worst cosine | worst rel. L1 | shapes passing |",
             "|---|---|---|---|---|"]
    for scheme in SCHEMES:
        for blocking in (BLOCKINGS if scheme != "exact" else (None,)):
            rows = [r for r in results if r["scheme"] == scheme and r["blocking"] == blocking]
            passing = "-" if scheme == "exact" else f"{sum(r['passes'] for r in rows)} of {len(rows)}"
            lines.append(f"| {scheme} | {blocking or '16-bit'} | {min(r['cosine'] for r in rows):.6f} | "
                         f"{max(r['rel_l1'] for r in rows):.2e} | {passing} |")
    lines += ["", "## The inputs: how peaked the float64 softmax rows are", "",
              "| shape | dtype | logit std per row | mean max probability | entropy / log(keys) |",
              "|---|---|---|---|---|"]
    for r in results:
        if r["scheme"] == "exact":
            i = r["inputs"]
            lines.append(f"| {r['shape']['name']} | {r['dtype']} | {i['logit_std']:.2f} | "
                         f"{i['max_probability']:.3f} | {i['entropy_over_uniform']:.3f} |")
    for blocking in BLOCKINGS:
        rows = [r for r in results if r["blocking"] in (None, blocking)]
        lines += ["", f"## Scales: {blocking} (Q rows / K rows per scale)", "",
                  "| shape | dtype | scheme | cosine | rel. L1 | max err / RMS | bar |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']['name']} | {r['dtype']} | {r['scheme']} | {r['cosine']:.6f} | "
                  f"{r['rel_l1']:.2e} | {r['max_abs_over_rms']:.2e} | {_verdict(r)} |" for r in rows]
    lines += ["", "## Sensitivity: the queries' norm (Flux's shape, float16)", "",
              "| queries x | mean max probability | scheme | scales | cosine | rel. L1 | bar |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['q_norm']:g} | {r['inputs']['max_probability']:.3f} | {r['scheme']} | "
              f"{r['blocking'] or '16-bit'} | {r['cosine']:.6f} | {r['rel_l1']:.2e} | {_verdict(r)} |" for r in swept]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r["blocking"] in (None, DEFAULT_BLOCKING)]
    labels = list(dict.fromkeys((r["shape"]["name"], r["dtype"]) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    width = 0.8 / len(SCHEMES)
    for i, scheme in enumerate(SCHEMES):
        by_label = {(r["shape"]["name"], r["dtype"]): r for r in rows if r["scheme"] == scheme}
        xs = [j + i * width for j in range(len(labels))]
        axes[0].bar(xs, [1 - by_label[lab]["cosine"] for lab in labels], width, label=scheme)
        axes[1].bar(xs, [by_label[lab]["rel_l1"] for lab in labels], width, label=scheme)
    for ax, metric, key in ((axes[0], "1 - cosine similarity", "cosine_min"), (axes[1], "relative L1", "rel_l1_max")):
        for mode, style in zip(BARS, ("--", ":")):
            bar = BARS[mode][key]
            ax.axhline(1 - bar if key == "cosine_min" else bar, color="black", linestyle=style, label=f"{mode} bar")
        ax.set_yscale("log")
        ax.set_ylabel(metric)
        ax.set_xticks([j + 0.4 for j in range(len(labels))])
        ax.set_xticklabels([f"{name}\n{dtype}" for name, dtype in labels], rotation=60, ha="right", fontsize=7)
    fig.suptitle(f"8-bit attention schemes against float64, scales {DEFAULT_BLOCKING} (CPU model, no kernel)")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.95), ncol=8,
               fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=2, help="heads evaluated per shape")
    parser.add_argument("--rows", type=int, default=512, help="query rows evaluated per head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    done = []

    def progress(what: str) -> None:
        done.append(what)
        print(f"[{len(done)}/{2 * len(SHAPES) + len(SENSITIVITY_Q_NORMS)}] {what}", file=sys.stderr, flush=True)

    results = evaluate(SHAPES, (torch.float16, torch.bfloat16), args.heads, args.rows, args.seed, tuple(BLOCKINGS),
                       progress)
    swept = sensitivity(args.heads, args.rows, args.seed, progress)
    text = markdown(results, swept, args.seed)
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "bars": BARS, "results": results, "sensitivity": swept},
                                        indent=1) + "\n")
    if args.md:
        args.md.write_text(text)
    if args.png:
        plot(results, args.png)
    if not (args.json or args.md):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
