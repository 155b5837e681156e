"""bench/lora_training.py's verdict: the kernels' loss curve is judged against the disagreement of
SDPA's math and flash backends on the same run; LoRA weights are compared only after equal step
counts; the data depend only on the seed (each backend's run draws them with the same one)."""

from __future__ import annotations

import torch

from bench import lora_training


def runs(kernels, math, flash):
    weights = [torch.ones(4)]
    return {name: dict(losses=losses, lora=weights) for name, losses in
            (("kernels", kernels), ("math", math), ("flash", flash))}


def test_kernels_within_twice_the_math_flash_disagreement_agree():
    verdict = lora_training.agreement(runs([1.0, 0.9015], [1.0, 0.9], [1.0, 0.901]))
    assert verdict["loss_flash_vs_math"] == abs(0.901 - 0.9) / 0.9
    assert verdict["loss_kernels_vs_math"] <= verdict["loss_tolerance"] and verdict["loss_curves_agree"]


def test_kernels_further_off_disagree():
    verdict = lora_training.agreement(runs([1.0, 0.93], [1.0, 0.9], [1.0, 0.901]))
    assert verdict["judged"] and not verdict["loss_curves_agree"]


def test_curves_compared_over_common_steps_and_missing_backend_not_judged():
    verdict = lora_training.agreement(runs([1.0, 0.9, 5.0], [1.0, 0.9], [1.0, 0.9]))
    assert verdict["steps_compared"] == 2 and verdict["loss_curves_agree"]
    assert verdict["lora_weights"].startswith("not compared") and "lora_weights_kernels_vs_math" not in verdict
    assert lora_training.agreement({"math": {}, "flash": {}})["judged"] is False


def test_data_depend_only_on_the_seed():
    first = lora_training.make_data("sdxl", tiny=True, steps=2, latent_size=8, seed=3)
    again = lora_training.make_data("sdxl", tiny=True, steps=2, latent_size=8, seed=3)
    assert all(torch.equal(a["noisy"], b["noisy"]) and torch.equal(a["added"]["text_embeds"], b["added"]["text_embeds"])
               for a, b in zip(first, again))
    assert first[0]["context"].shape == (1, 77, 64) and first[0]["added"]["time_ids"].shape == (1, 6)
    full = lora_training.text_shapes("sdxl", tiny=False)
    assert full == dict(tokens=77, width=2048, pooled=1280)


def test_seed_spread_judges_the_kernels_mean_against_sdpas_range_over_seeds():
    sdpa = [[1.0, 0.8, 0.7], [1.2, 0.9, 0.6], [0.9, 0.85, 0.65]]
    close = [[x * 1.001 for x in curve] for curve in sdpa]
    verdict = lora_training.seed_spread({"kernels": close, "math": sdpa})
    assert verdict["judged"] and verdict["kernels_mean_inside_sdpa_seed_range"] and verdict["steps_inside"] == 3
    assert abs(verdict["same_seed_max_relative_gap"] - 1e-3) < 1e-9
    assert verdict["sdpa_seed_spread_median_relative"] > 0.1
    drifting = [curve[:2] + [curve[2] + 0.3] for curve in sdpa]  # a last step above every SDPA seed
    verdict = lora_training.seed_spread({"kernels": drifting, "flash": sdpa})
    assert verdict["reference"] == "flash" and not verdict["kernels_mean_inside_sdpa_seed_range"]
    assert verdict["steps_inside"] == 2
    assert not lora_training.seed_spread({"kernels": close, "math": sdpa[:1]})["judged"]
