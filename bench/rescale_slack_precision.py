"""FlashAttention-4's conditional rescale against the forward's precision rule: a CPU model, no kernel.

The forward rescales O on every key tile where a row of the wave meets a new maximum (the traits'
skips_rescale). FlashAttention-4 waits instead until a row's maximum rises past a slack (2^8 in base 2)
over the one its probabilities are taken against, which would leave almost every tile without a rescale.
This models the forward's arithmetic both ways and judges each case by the forward's rule: the error
against float64 within 2x that of math SDPA.

The arithmetic, as kernels/fa_fwd.h does it: float32 scores of the 16-bit inputs, 64-key tiles (32 past
d144), waves of 16 query rows that rescale together, base-2 exponents from one fused multiply-add, bf16
probabilities shifted by 2^-shift (and 2^-slack more) and rounded half up, f16 ones to nearest, O and the
row sum of the rounded probabilities accumulated in float32, O divided by that sum and rounded to the
inputs' dtype. Cases are drawn as tests/gpu/test_forward.py's grid draws them (head dims, lengths, causal,
scale), at lengths up to 1024 and batch x heads up to 6, the inputs on the CPU.

    python3 -m bench.rescale_slack_precision --json bench/results/rescale_slack_precision.json \\
        --png bench/results/rescale_slack_precision.png          # 4000 cases, about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from rdna_fa_lab.attention_reference import attention_fp64, max_error, sdpa_math

RESULTS = Path(__file__).resolve().parent / "results"
SLACKS = (0, 8)  # 0: the shipped rule (a rescale on every new maximum)
SEQ_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 77, 100, 127, 128, 129, 154, 231, 256, 257, 333, 512,
               1000, 1024)
HEAD_DIMS = (40, 64, 80, 128, 160)
DTYPES = (torch.float16, torch.bfloat16)
WAVE_ROWS = 16


def rounded_probabilities(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """p (float32, >= 0) rounded as the kernel packs it: f16 to nearest, bf16 half up (platform.h)."""
    if dtype == torch.float16:
        return p.to(dtype).float()
    return ((p.view(torch.int32) + 0x8000) & ~0xFFFF).view(torch.float32)


def probability_shift(dtype: torch.dtype, seq_k: int, slack: int) -> int:
    """fa_fwd.h's probability_shift, with room for the slack's 2^slack."""
    if dtype != torch.bfloat16:
        return 0
    shift = 1
    while (1 << (shift - 1)) < seq_k and shift < 31:
        shift += 1
    return shift + slack


def modelled_forward(q, k, v, causal: bool, scale: float, slack: int) -> torch.Tensor:
    """The forward's output for (B, H, S, D) inputs, its online softmax rescaling O on a wave's tile once a
    row rises more than `slack` (base 2) over the maximum its probabilities are taken against."""
    dtype, seq_q, seq_k, head_dim = q.dtype, q.shape[2], k.shape[2], q.shape[3]
    block_n = 32 if head_dim > 144 else 64
    scores = q.float() @ k.float().transpose(-1, -2)
    if causal:
        scores = scores.masked_fill(~torch.ones(seq_q, seq_k, dtype=torch.bool).tril(), -math.inf)
    scale_log2 = torch.tensor(scale * math.log2(math.e), dtype=torch.float32)
    shift = probability_shift(dtype, seq_k, slack)
    out = torch.empty(q.shape, dtype=torch.float32)
    for row0 in range(0, seq_q, WAVE_ROWS):
        wave = scores[:, :, row0:row0 + WAVE_ROWS]
        reference = torch.full(wave.shape[:3], -math.inf)
        acc = torch.zeros(*wave.shape[:3], head_dim)
        row_sum = torch.zeros(wave.shape[:3])
        for key0 in range(0, seq_k, block_n):
            tile = wave[..., key0:key0 + block_n]
            top = tile.amax(-1) * scale_log2
            rises = (top - reference > slack).any(-1, keepdim=True) if slack else torch.ones_like(top, dtype=torch.bool)
            new = torch.where(rises, torch.maximum(reference, top), reference)
            factor = torch.where(rises, torch.exp2(reference - new.nan_to_num(neginf=0.0)), torch.ones_like(top))
            reference = new
            bias = reference.nan_to_num(neginf=0.0) + shift
            p = torch.exp2(torch.addcmul(-bias[..., None], tile, scale_log2)).nan_to_num(nan=0.0)
            p = rounded_probabilities(p, dtype)
            row_sum = row_sum * factor + p.sum(-1)
            acc = acc * factor[..., None] + p @ v[:, :, key0:key0 + block_n].float()
        out[:, :, row0:row0 + WAVE_ROWS] = acc / torch.where(row_sum > 0, row_sum, 1.0)[..., None]
    return out.to(dtype)


def draw_case(rng: random.Random, index: int) -> dict:
    """One case as the GPU forward grid draws them (its SD head dims and lengths; no long cases)."""
    return dict(index=index, dtype=DTYPES[index % 2], head_dim=rng.choice(HEAD_DIMS), seq_q=rng.choice(SEQ_LENGTHS),
                seq_k=rng.choice(SEQ_LENGTHS), batch=rng.randint(1, 2), heads=rng.randint(1, 3),
                causal=rng.random() < 0.35, scale=None if rng.random() < 0.7 else rng.uniform(0.02, 0.5))


def run_case(case: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed * 100003 + case["index"])
    q, k, v = (torch.randn(case["batch"], case["heads"], n, case["head_dim"], generator=generator).to(case["dtype"])
               for n in (case["seq_q"], case["seq_k"], case["seq_k"]))
    scale = case["scale"] if case["scale"] is not None else 1 / math.sqrt(case["head_dim"])
    reference, _ = attention_fp64(q, k, v, case["causal"], case["scale"])
    baseline = max_error(sdpa_math(q, k, v, case["causal"], case["scale"]), reference)
    ratios = {str(slack): max_error(modelled_forward(q, k, v, case["causal"], scale, slack), reference)
              / max(baseline, 1e-12) for slack in SLACKS}
    return {**case, "dtype": str(case["dtype"]).removeprefix("torch."), "sdpa_math_error": baseline,
            "ratio_by_slack": ratios}


def summary(rows: list[dict]) -> dict:
    out = {}
    for slack in map(str, SLACKS):
        ratios = sorted((r["ratio_by_slack"][slack] for r in rows), reverse=True)
        out[slack] = {"worst": ratios[0], "over_1_5": sum(x > 1.5 for x in ratios),
                      "over_2": sum(x > 2 for x in ratios), "median": ratios[len(ratios) // 2]}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    for dtype, colour in (("float16", "tab:blue"), ("bfloat16", "tab:orange")):
        chosen = [r for r in rows if r["dtype"] == dtype]
        ax.scatter([r["ratio_by_slack"]["0"] for r in chosen], [r["ratio_by_slack"]["8"] for r in chosen], s=9,
                   color=colour, label=dtype)
    top = max(2.2, max(max(r["ratio_by_slack"].values()) for r in rows) * 1.05)
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.axhline(2, color="red", linewidth=0.8, label="the rule's limit (2x math SDPA)")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("error / math SDPA's: a rescale on every new maximum (shipped)")
    ax.set_ylabel("error / math SDPA's: rescale past a 2^8 slack (FA-4)")
    ax.set_title(f"Forward arithmetic, CPU model, {len(rows)} cases")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS / "rescale_slack_precision.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "rescale_slack_precision.png")
    args = parser.parse_args(argv)
    rng, rows, start = random.Random(args.seed), [], time.time()
    for index in range(args.cases):
        rows.append(run_case(draw_case(rng, index), args.seed))
        if (index + 1) % 25 == 0 or index + 1 == args.cases:
            print(f"{index + 1}/{args.cases} cases, {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    result = {"what": __doc__.split("\n\n")[0], "cases": args.cases, "seed": args.seed, "slacks": list(SLACKS),
              "summary": summary(rows), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(rows, args.png)
    for slack, s in result["summary"].items():
        print(f"slack {slack}: worst {s['worst']:.3f}, median {s['median']:.3f}, over 1.5: {s['over_1_5']}, "
              f"over 2: {s['over_2']} of {args.cases}")


if __name__ == "__main__":
    main()
