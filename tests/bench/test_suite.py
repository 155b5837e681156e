"""bench/suite.py end to end at tiny sizes on the CPU, through the CLI, with the fake kernels."""

from __future__ import annotations

import builtins
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bench import suite
from rdna_flash_attn import settings

TORCH_SDPA = F.scaled_dot_product_attention
ROW_KEYS = {
    "kernels": {"shape", "batch", "heads", "q_tokens", "k_tokens", "head_dim", "provider", "pass", "ms", "tflops",
                "peak_extra_mib", "linear_mib", "scores_mib", "error"},
    "generation": {"config", "model", "width", "height", "batch", "unet_batch", "provider", "steps", "it_per_s",
                   "seconds", "peak_allocated_mib", "peak_reserved_mib", "peak_above_weights_mib", "weights_mib",
                   "attention_tflop_per_step", "finite", "attention_calls", "skipped"},
    "vae": {"config", "size", "attention_tokens", "provider", "repeats", "ms", "peak_allocated_mib",
            "peak_above_weights_mib", "weights_mib", "finite", "attention_calls", "skipped"},
}


def test_the_full_suite_at_tiny_size(fake_gpu, tmp_path, capsys):
    pytest.importorskip("diffusers")
    settings.fp32_cast = "bf16"  # float32 CPU models; their attention runs on the (fake) kernels in bf16
    out_dir = tmp_path / "out"
    code = suite.main(["--size", "tiny", "--budget", "0", "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert code == 0
    (json_path,) = out_dir.glob("suite-*.json")
    data = json.loads(json_path.read_text())
    assert data["schema"] == suite.SCHEMA_VERSION and data["meta"]["size"] == "tiny"
    assert data["meta"]["parts"] == list(suite.PARTS) and data["meta"]["torch"] == torch.__version__
    assert data["meta"]["device"]["gfx_target"] == "gfx1100" and data["meta"]["kernels"]["target"] == "gfx1100"
    assert [t["id"] for t in data["targets"]] == ["forward", "backward", "memory", "sd15_1024", "static"]
    for part, keys in ROW_KEYS.items():
        assert data[part]["rows"] and all(keys <= set(row) for row in data[part]["rows"]), part
    # float32 calls are not the kernels' (the kernel-level part calls them directly, without the cast)
    kernels = [r for r in data["kernels"]["rows"] if r["provider"] == "rdna_fa"]
    assert len(kernels) == 4 and all(r["error"].startswith("unsupported: ") for r in kernels)
    assert all(r["ms"] > 0 for r in data["kernels"]["rows"] if r["provider"] == "sdpa-math")
    for part, providers in (("generation", ["rdna_fa", "sdpa-math", "sdpa-default"]),
                            ("vae", ["rdna_fa", "sdpa-math", "sdpa-default", "diffusers-sliced"])):
        rows = data[part]["rows"]
        assert list(dict.fromkeys(r["provider"] for r in rows)) == providers
        assert all(r["skipped"] is None and r["finite"] for r in rows)
        calls = [r["attention_calls"] for r in rows if r["provider"] == "rdna_fa"]
        assert all(c["kernel"] > 0 and c["fallback"] == 0 for c in calls), calls
    assert fake_gpu.launches and F.scaled_dot_product_attention is TORCH_SDPA
    assert data["static"]["static"]["kernels"] > 0 and data["static"]["forward_estimate"]
    # the compact output set: one JSON, a PNG per part with numbers (no memory figures on a CPU), the tables
    names = sorted(p.name for p in out_dir.iterdir())
    stem = json_path.stem
    assert names == sorted([f"{stem}.json", f"{stem}.md", f"{stem}-kernels.png", f"{stem}-generation.png",
                            f"{stem}-vae.png"])
    tables = (out_dir / f"{stem}.md").read_text()
    assert re.search(r"With `rdna_fa`, \d+ of \d+ attention calls ran on the kernels, none fell back", tables)
    assert "### UNet sampling" in tables and "sd15-tiny 64x64 batch 1" in tables and f"({stem}.json)" in tables
    assert "== part 3/5: generation" in err and "[####################]" in err and "wrote" in out


def test_kernel_parts_time_the_kernels_and_sweep_their_memory(fake_gpu, tmp_path):
    assert suite.main(["--parts", "kernels,memory", "--dtype", "bf16", "--budget", "0", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("suite-*.json")).read_text())
    rows = [r for r in data["kernels"]["rows"] + data["memory"]["rows"] if r["provider"] == "rdna_fa"]
    assert [(r["shape"], r["pass"]) for r in rows] == [
        (shape, pass_) for shape in (*suite.TINY_KERNEL_SHAPES, "sweep-self-64", "sweep-self-128", "sweep-self-256")
        for pass_ in ("forward", "backward")]
    assert all(r["error"] is None and r["ms"] > 0 and r["tflops"] > 0 for r in rows)
    assert len(fake_gpu.launches) > 0 and fake_gpu.differentiable_launches > 0
    assert data["meta"]["dtype"] == "bfloat16" and set(data) >= {"kernels", "memory", "targets", "meta"}


def test_without_diffusers_the_model_parts_are_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_diffusers(name, *args, **kwargs):
        if name == "diffusers" or name.startswith("diffusers."):
            raise ImportError("No module named 'diffusers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_diffusers)
    assert suite.main(["--parts", "generation,vae,static", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("suite-*.json")).read_text())
    for part in ("generation", "vae"):
        assert data[part]["rows"] == [] and "diffusers is not installed" in data[part]["skipped"]
    assert "pip install diffusers" in capsys.readouterr().err
    assert "diffusers is not installed" in next(tmp_path.glob("suite-*.md")).read_text()


def test_unknown_parts_are_refused(capsys):
    assert suite.main(["--parts", "kernels,unet"]) == 2
    assert "unknown parts: unet" in capsys.readouterr().err


def test_the_suite_runs_from_the_repository(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bench.suite", "--parts", "static", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=suite.REPO)
    assert result.returncode == 0, result.stderr
    assert "== part 1/1: static" in result.stderr and len(list(tmp_path.glob("suite-cpu-float32.*"))) == 2
