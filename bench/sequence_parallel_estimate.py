"""Sequence-parallel attention at a long video shape, per GPU: memory and time of one self-attention call
(forward, and forward + backward for training) split over 1, 2, 4 and 8 cards with Ulysses (all-to-all
over heads) and ring attention (key/value chunks passed around, partial outputs merged by their lse).

Not a measurement: only single-GPU machines were available, no multi-GPU run was made. Memory and
communication are exact arithmetic on the tensors each scheme holds and sends (listed in `memory_terms`).
Kernel time is the attention FLOPs a card computes over the static estimator's expected throughput of
our kernels (rdna_fa_lab/expected_speed.py `load()`: the speed model's low and high figure, the ends of its
stall band, of the forward and backward at this head dim and dtype, estimated at 4096 tokens; long chunks
keep the grid as full).
Communication time assumes a link bandwidth (LINK_GBPS, PCIe between Radeon cards; no Infinity Fabric
link on RDNA boards); ring attention overlaps its transfers with the next chunk's kernel, Ulysses waits
for its all-to-alls. The lse merge of ring attention is counted as memory traffic at the card's bandwidth.

    python -m bench.sequence_parallel_estimate            # bench/results/sequence_parallel_estimate.{json,png}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rdna_fa_lab import expected_speed

RESULTS = Path(__file__).resolve().parent / "results"
# Wan 2.1/2.2 14B at 720p (1280x720), 81 frames: latent 21 x 90 x 160 (VAE /4 in time, /8 in space), patches
# 1x2x2: 21 x 45 x 80 tokens; 40 heads of 128, bfloat16; one batch entry (classifier-free guidance runs
# the other as a second call, or on other cards with xDiT's cfg parallelism).
SHAPE = {"model": "Wan 2.x 14B, 720p, 81 frames", "batch": 1, "tokens": 21 * 45 * 80, "heads": 40, "head_dim": 128,
         "dtype": "bf16", "bytes": 2}
CARDS = (1, 2, 4, 8)
# Device memory bandwidth (docs: DESIGN.md section 3) and memory size; the R9700 is the RX 9070 XT's chip
# (gfx1201, 64 CUs) with 32 GB, so it takes the 9070 XT's throughput estimate.
GPUS = {"gfx1201": {"name": "Radeon AI PRO R9700 / RX 9070 XT", "memory_gb": 32, "bandwidth_gbps": 640},
        "gfx1100": {"name": "RX 7900 XTX", "memory_gb": 24, "bandwidth_gbps": 960}}
LINK_GBPS = 25.0  # PCIe 4.0 x16 as all-to-all and send/recv reach it in practice (assumption; PCIe 5.0: ~2x)
BACKWARD_FLOPS = 2.5  # x the forward's, the estimator's convention


def _throughput(data: dict, target: str, key: str) -> list[float]:
    """[low, high] TFLOP/s of `key` (forward_by_head_dim / backward_by_head_dim): the stall band's two ends."""
    for row in data["gpus"][target][key]:
        if row["dtype"] == SHAPE["dtype"] and row["head_dim"] == SHAPE["head_dim"]:
            return row["tflops"]
    raise KeyError(f"{target} {key}: no {SHAPE['dtype']} d{SHAPE['head_dim']} estimate")


def memory_terms(scheme: str, cards: int) -> dict[str, int]:
    """Bytes one card holds for one attention call: its inputs, what the scheme adds, the output and the
    lse (kept for a training step's backward)."""
    b, s, h, d, e = SHAPE["batch"], SHAPE["tokens"], SHAPE["heads"], SHAPE["head_dim"], SHAPE["bytes"]
    shard = b * (s // cards) * h * d * e  # one of q, k, v as the card receives it (its tokens, every head)
    if scheme == "single" or cards == 1:
        return {"q, k, v": 3 * b * s * h * d * e, "out": b * s * h * d * e, "lse (float32)": b * h * s * 4}
    if scheme == "ulysses":
        heads = h // cards
        return {"q, k, v shards": 3 * shard,
                "q, k, v after all-to-all (every token, heads/N)": 3 * b * s * heads * d * e,
                "out before and after all-to-all": 2 * b * s * heads * d * e,
                "lse (float32)": b * heads * s * 4}
    return {"q, k, v shards": 3 * shard,
            "next k, v in flight": 2 * shard,
            "merged out (float32) and the chunk's out": shard * 2 + shard,
            "lse (float32), merged and the chunk's": 2 * b * h * (s // cards) * 4}


def communication_bytes(scheme: str, cards: int) -> dict[str, int]:
    """Bytes one card sends per attention call: forward, and the backward's."""
    if cards == 1 or scheme == "single":
        return {"forward": 0, "backward": 0}
    b, s, h, d, e = SHAPE["batch"], SHAPE["tokens"], SHAPE["heads"], SHAPE["head_dim"], SHAPE["bytes"]
    shard = b * (s // cards) * h * d * e
    if scheme == "ulysses":  # q, k, v in and out back (forward); dout in and dq, dk, dv back (backward)
        each = shard * (cards - 1) // cards
        return {"forward": 4 * each, "backward": 4 * each}
    # ring: k and v passed on N - 1 times; the backward passes k, v again and dk, dv (float32) N times
    return {"forward": (cards - 1) * 2 * shard, "backward": (cards - 1) * 2 * shard + cards * 2 * shard * 2}


def timing(scheme: str, cards: int, gpu: dict, forward_tflops: list[float], backward_tflops: list[float]) -> dict:
    """Seconds per call, [at the low figure, at the high figure]: kernel, communication and their total (ring
    overlaps each chunk's transfer with its kernel), forward and forward + backward."""
    b, s, h, d = SHAPE["batch"], SHAPE["tokens"], SHAPE["heads"], SHAPE["head_dim"]
    flops = 4 * b * h * s * s * d / cards  # both schemes split the (non-causal) work evenly
    sent = communication_bytes(scheme, cards)
    result = {}
    for name, pass_flops, tflops, sent_bytes in (
            ("forward", flops, forward_tflops, sent["forward"]),
            ("backward", BACKWARD_FLOPS * flops, backward_tflops, sent["backward"])):
        kernel = [pass_flops / (t * 1e12) for t in tflops]
        link = sent_bytes / (LINK_GBPS * 1e9)
        merge = 0.0
        if scheme == "ring" and cards > 1 and name == "forward":
            # per step: read the float32 out and the chunk's out, write the float32 out
            merge = cards * (b * (s // cards) * h * d * (4 + 2 + 4)) / (gpu["bandwidth_gbps"] * 1e9)
        if scheme == "ring":
            total = [max(k, link) + merge for k in kernel]
        else:
            total = [k + link for k in kernel]
        result[name] = {"kernel_s": kernel, "communication_s": link, "merge_s": merge, "total_s": total}
    result["training_s"] = [f + bwd for f, bwd in zip(result["forward"]["total_s"], result["backward"]["total_s"])]
    return result


def estimate() -> dict:
    data = expected_speed.load()
    rows = []
    for target, gpu in GPUS.items():
        forward_tflops = _throughput(data, target, "forward_by_head_dim")
        backward_tflops = _throughput(data, target, "backward_by_head_dim")
        for cards in CARDS:
            for scheme in (("single",) if cards == 1 else ("ulysses", "ring")):
                terms = memory_terms(scheme, cards)
                rows.append({"target": target, "gpu": gpu["name"], "cards": cards, "scheme": scheme,
                             "memory_terms_bytes": terms, "memory_gib": sum(terms.values()) / 2**30,
                             "sent_per_card_bytes": communication_bytes(scheme, cards),
                             "seconds": timing(scheme, cards, gpu, forward_tflops, backward_tflops)})
    return {"what": "per-GPU memory and time of one self-attention call split over N cards: an estimate, not a "
                    "measurement (only single-GPU machines were available; no multi-GPU run was made)",
            "shape": SHAPE, "link_gbps_assumed": LINK_GBPS,
            "throughput_source": "rdna_fa_lab.expected_speed.load(): forward_by_head_dim, backward_by_head_dim "
                                 "(static estimate of the kernels, [low, high] TFLOP/s: the speed model at the "
                                 "ends of its stall band)",
            "estimator_provenance": data.get("provenance"), "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory_axis, time_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"ulysses": "o-", "ring": "s--"}
    for target in GPUS:
        rows = [r for r in result["rows"] if r["target"] == target]
        single = next(r for r in rows if r["scheme"] == "single")
        for scheme, style in styles.items():
            chosen = [single] + [r for r in rows if r["scheme"] == scheme]
            cards = [r["cards"] for r in chosen]
            label = f"{target} {scheme}"
            memory_axis.plot(cards, [r["memory_gib"] for r in chosen], style, label=label)
            time_axis.plot(cards, [1e3 * r["seconds"]["training_s"][0] for r in chosen], style, label=label)
    memory_axis.set(xscale="log", xticks=CARDS, xticklabels=CARDS, xlabel="cards", ylabel="GiB per card",
                    title="attention memory per card (a call's inputs, output, lse)")
    time_axis.set(xscale="log", yscale="log", xticks=CARDS, xticklabels=CARDS, xlabel="cards",
                  ylabel="ms per card (at the low figure)", title="forward + backward of one call")
    for axis in (memory_axis, time_axis):
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"{SHAPE['model']}: {SHAPE['tokens']} tokens, {SHAPE['heads']} x {SHAPE['head_dim']} "
                 f"{SHAPE['dtype']}; estimate (no multi-GPU run), link {LINK_GBPS:.0f} GB/s assumed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=RESULTS / "sequence_parallel_estimate.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "sequence_parallel_estimate.png")
    args = parser.parse_args(argv)
    result = estimate()
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot(result, args.png)
    for row in result["rows"]:
        training = row["seconds"]["training_s"]
        print(f"{row['target']} {row['scheme']:8} x{row['cards']}: {row['memory_gib']:6.2f} GiB, "
              f"sent {row['sent_per_card_bytes']['forward'] / 2**20:7.1f} MiB fwd, "
              f"forward {1e3 * row['seconds']['forward']['total_s'][0]:7.1f} ms, "
              f"training {1e3 * training[0]:7.1f}-{1e3 * training[1]:.1f} ms")
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
