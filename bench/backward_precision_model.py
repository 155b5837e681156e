"""CPU model of the backward kernels' arithmetic against the GPU grid's precision criterion.

Runs in seconds on a CPU, before any kernel change reaches the GPU. Each scheme is the kernels'
arithmetic with fp32 accumulation and 16-bit rounding exactly where the scheme rounds. A case passes
FlashAttention-2's criterion, the GPU grid's (tests/gpu/test_backward.py, whose reference module this
imports, so the two cannot drift), when every gradient's max error against float64 is at most 2x that
of the same attention computed in the input dtype, plus 1e-5. The earlier, stricter criterion (2x math
SDPA's error, which upcasts to fp32, or 1e-6) is counted beside it.

    python3 -m bench.backward_precision_model --cases 300 --seed 2
    python3 -m bench.backward_precision_model --cases 300 --seed 1 --large-inputs

Schemes:
  exact-delta-split  delta = rowsum(P dP) / rowsum(P) in fp32, P and dS as two 16-bit parts (the kernels)
  exact-delta-p-single   the same delta, P rounded once to 16 bits for dV, dS in two parts
  exact-delta-ds-single  the same delta, P in two parts, dS rounded once to 16 bits for dQ and dK
  o16-delta-split    delta = rowsum(dO O), O the forward's 16-bit output; P and dS in two parts
  o16-delta-single   the same delta, P and dS rounded once to 16 bits (FlashAttention-2)
  exact-delta-single delta = rowsum(P dP) / rowsum(P) in fp32, P and dS rounded once to 16 bits
  o32-delta-split    delta = rowsum(dO O) with the forward's fp32 O; P and dS in two parts
  o32-delta-single   the same delta, P and dS rounded once to 16 bits
  opair-delta-single delta = rowsum(dO (O + O_low)), O and its remainder O_low each rounded to 16 bits
                     (what the forward saves for training); P and dS rounded once to 16 bits (the kernels'
                     one-sweep path)
  oexact-delta-split delta = rowsum(dO O) with an fp32 O whose P V took P unrounded (what a training
                     forward with two-part P, saving O's remainder, would give); P and dS in two parts
Results: bench/results/backward_precision_fa2.md (and, for the earlier criterion,
bench/results/backward_estimate_gfx1100.md).
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from rdna_fa_lab.attention_reference import backward_bound, grads_fp64, grads_input_dtype, grads_sdpa_math, max_error

SCHEMES = ("exact-delta-split", "exact-delta-p-single", "exact-delta-ds-single", "exact-delta-single",
           "o16-delta-split", "o16-delta-single", "o32-delta-split", "o32-delta-single", "opair-delta-single",
           "oexact-delta-split")
P_SINGLE = ("o16-delta-single", "exact-delta-p-single", "exact-delta-single", "o32-delta-single",
            "opair-delta-single")
DS_SINGLE = ("o16-delta-single", "exact-delta-ds-single", "exact-delta-single", "o32-delta-single",
             "opair-delta-single")
SEQ_LENGTHS = (1, 2, 7, 16, 17, 33, 64, 65, 77, 100, 128)
HEAD_DIMS = (8, 16, 40, 64, 80, 128, 160)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def causal_mask(scores: torch.Tensor) -> torch.Tensor:
    return torch.ones(scores.shape[-2:], dtype=torch.bool).tril()


def kernel_forward(q, k, v, causal, scale):
    """(16-bit output, fp32 output, fp32 output of unrounded P, lse) as the forward kernel makes the
    first two (rounded probabilities in P V)."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(scores), float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    exact = torch.exp(scores - row_max)
    p = rounded(exact, q.dtype)
    out = (p @ v.float()) / p.sum(-1, keepdim=True)
    out_exact_p = (exact @ v.float()) / exact.sum(-1, keepdim=True)
    return out.to(q.dtype), out, out_exact_p, row_max + torch.log(exact.sum(-1, keepdim=True))


def kernel_backward(scheme, q, k, v, dout, outputs, lse, causal, scale):
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    p = torch.exp(qf @ kf.transpose(-1, -2) * scale - lse)
    if causal:
        p = p.masked_fill(~causal_mask(p), 0.0)
    # Sums of exact 16-bit products: in double, rounded once, so equal inputs give equal sums (WMMA).
    dp = (df.double() @ vf.double().transpose(-1, -2)).float()
    if scheme.startswith("exact-delta"):
        delta = (p * dp).sum(-1, keepdim=True) / p.sum(-1, keepdim=True)
    else:
        o = outputs[scheme.split("-")[0]]
        delta = (df.double() * o.double()).sum(-1, keepdim=True).float()
    ds = p * (dp - delta)
    if scheme in P_SINGLE:
        p = rounded(p, q.dtype)
    if scheme in DS_SINGLE:
        ds = rounded(ds, q.dtype)
    dq = scale * ds @ kf
    dk = scale * ds.transpose(-1, -2) @ qf
    dv = p.transpose(-1, -2) @ df
    return tuple(g.to(q.dtype) for g in (dq, dk, dv))


def run(cases: int, seed: int, large_inputs: bool) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    fails, fails_sdpa = dict.fromkeys(SCHEMES, 0), dict.fromkeys(SCHEMES, 0)
    worst = {s: dict.fromkeys(("dq", "dk", "dv"), (0.0, None)) for s in SCHEMES}
    for index in range(cases):
        dtype = (torch.float16, torch.bfloat16)[index % 2]
        d = rng.choice(HEAD_DIMS)
        seq_q, seq_k = rng.choice(SEQ_LENGTHS), 1 if index % 7 == 0 else rng.choice(SEQ_LENGTHS)
        causal = rng.random() < 0.35
        scale = 1 / math.sqrt(d) if rng.random() < 0.7 else rng.uniform(0.02, 0.5)
        magnitude = rng.choice((4.0, 16.0)) if large_inputs and index % 5 == 0 else 1.0
        q, k, v = ((torch.randn(1, 2, s, d) * magnitude).to(dtype) for s in (seq_q, seq_k, seq_k))
        dout = torch.randn(1, 2, seq_q, d).to(dtype)
        reference = grads_fp64(q, k, v, dout, causal, scale)
        baseline = grads_sdpa_math(q, k, v, dout, causal, scale)
        input_dtype = grads_input_dtype(q, k, v, dout, causal, scale)
        out16, out32, out_exact_p, lse = kernel_forward(q, k, v, causal, scale)
        low = (out32 - out16.float()).to(dtype).float()
        outputs = {"o16": out16.float(), "o32": out32, "opair": out16.float() + low, "oexact": out_exact_p}
        case = (index, str(dtype), d, seq_q, seq_k, causal, round(scale, 3), magnitude)
        for scheme in SCHEMES:
            grads = kernel_backward(scheme, q, k, v, dout, outputs, lse, causal, scale)
            failed = failed_sdpa = False
            for name, grad, ref, base, low in zip(("dq", "dk", "dv"), grads, reference, baseline, input_dtype):
                error = max_error(grad, ref)
                ratio = error / backward_bound(max_error(low, ref))
                failed |= ratio > 1
                failed_sdpa |= error > max(2 * max_error(base, ref), 1e-6)
                if ratio > worst[scheme][name][0]:
                    worst[scheme][name] = (ratio, case)
            fails[scheme] += failed
            fails_sdpa[scheme] += failed_sdpa
    return {"fails": fails, "fails_sdpa_math": fails_sdpa, "worst": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--large-inputs", action="store_true", help="one case in five with inputs x4 or x16")
    args = parser.parse_args()
    result = run(args.cases, args.seed, args.large_inputs)
    for scheme in SCHEMES:
        print(f"{scheme}: {result['fails'][scheme]} of {args.cases} cases fail FlashAttention-2's criterion "
              f"({result['fails_sdpa_math'][scheme]} the earlier 2x-math-SDPA one)")
        for name, (ratio, case) in result["worst"][scheme].items():
            print(f"  {name} worst error / bound {ratio:.3f}  (index, dtype, d, seq_q, seq_k, causal, scale, x) {case}")


if __name__ == "__main__":
    main()
