"""Trains the kohya-style block for a few steps, half of them with an attention mask on the
cross-attention; writes the number of masked and unmasked SDPA calls to --out."""

import argparse
import json

import torch
from kohya_like import KohyaStyleBlock  # beside this script: its folder is first on sys.path, as for any script


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    block = KohyaStyleBlock()
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    calls = dict(masked=0, unmasked=0)
    for step in range(args.steps):
        x, context = torch.randn(2, 12, 32), torch.randn(2, 7, 24)
        mask = torch.rand(2, 1, 12, 7) > 0.2 if step % 2 else None
        loss = block(x, context, mask).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        calls["unmasked"] += 1 if mask is not None else 2
        calls["masked"] += 1 if mask is not None else 0
    with open(args.out, "w") as out:
        json.dump(calls, out)


if __name__ == "__main__":
    main()
