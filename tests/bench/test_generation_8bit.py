"""bench/generation_8bit.py on the CPU at its tiny size: the procedural data, the comparison, the record it
writes, and its refusal to compare a kernel path whose calls fell back or ran at another precision."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import generation_8bit as generation

CPU = torch.device("cpu")


def test_procedural_images_are_in_range_and_reproducible():
    first = generation.procedural_images(64, 32, torch.Generator().manual_seed(3), CPU)
    again = generation.procedural_images(64, 32, torch.Generator().manual_seed(3), CPU)
    other = generation.procedural_images(64, 32, torch.Generator().manual_seed(4), CPU)
    assert first.shape == (64, 3, 32, 32)
    assert first.min() >= -1.0 and first.max() <= 1.0
    assert torch.equal(first, again) and not torch.equal(first, other)
    # a shape is drawn on every image: some pixel differs from its neighbour by more than a gradient step
    steps = (first[..., 1:] - first[..., :-1]).abs().flatten(1).max(1).values
    assert (steps > 0.2).all()


def test_psnr_of_known_differences():
    image = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    shifted = image.clone()
    shifted[1] += 0.1  # mean squared error 0.01: 20 dB
    values = generation.psnr(image, shifted)
    assert values[0] == math.inf and values[1] == pytest.approx(20.0)


def test_tiny_run_writes_its_record(tmp_path):
    assert generation.main(["--tiny", "--providers", "reference,sdpa", "--out", str(tmp_path / "run")]) == 0
    record = json.loads((tmp_path / "run.json").read_text())
    (row,) = record["comparisons"]
    assert row["pair"] == "reference vs sdpa" and len(row["psnr_db"]) == generation.TINY.images
    assert record["tokens"] == 16 and record["head_dim"] == 64
    assert (tmp_path / "run.png").stat().st_size > 0


def test_the_exact_path_runs_every_call_on_the_kernels_and_8bit_refuses_a_target_without_it(fake_gpu):
    model, _ = generation.train(generation.TINY, CPU, lambda line: None)
    images, counts = generation.generate(model, generation.TINY, CPU, lambda line: None, ("sdpa", "exact"))
    calls = generation.TINY.sample_steps * generation.TINY.depth
    assert len(fake_gpu.launches) == calls
    assert counts == {"exact": {"kernel": calls, "kernel_8bit": 0, "fallback": 0, "fallback_reasons": {},
                                "exact_not_8bit_reasons": {}}}
    (row,) = generation.compare(images)
    assert row["pair"] == "sdpa vs exact" and row["min_db"] > 40.0
    # the fake GPU is an RX 7900 XTX (gfx1100): its calls run exact, so the 8-bit run must not be compared
    with pytest.raises(RuntimeError, match="did not all reach the kernels as asked"):
        generation.generate(model, generation.TINY, CPU, lambda line: None, ("8bit",))
