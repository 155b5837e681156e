"""`python -m rdna_flash_attn.launch`: the script runs as __main__ with the SDPA override on, in
this process or under `accelerate launch`, and the dispatcher's counters of that process show
that its attention calls went through the dispatcher."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.integrations import launch
from rdna_flash_attn.dispatch import sdpa_patch
from rdna_flash_attn.dispatch.router import scaled_dot_product_attention as dispatcher_sdpa

from .conftest import SCRIPTS, run_child

CPU_REASON = "CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"


@pytest.fixture
def launcher_sandbox(monkeypatch):
    """main() rewrites sys.argv, sys.path[0] and the environment, as it should in its own process;
    give them back after an in-process run."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("RDNA_FA_PATCH_SDPA", "RDNA_FA_TRAINING"):
        monkeypatch.setenv(name, "")  # records the value before, so teardown removes what main() sets
        monkeypatch.delenv(name)


def launch_in_process(argv: list[str]):
    """launch.main(argv) in this process; the exit code the script asked for (0 when it returned)."""
    try:
        launch.main(argv)
    except SystemExit as exited:
        return exited.code
    return 0


def write_script(tmp_path, body: str):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_unet_lora_training_in_a_child_process_goes_through_the_dispatcher(tmp_path, child_env):
    result, stats = tmp_path / "result.json", tmp_path / "stats.json"
    child = run_child(
        [sys.executable, "-m", "rdna_flash_attn.launch", "--stats", str(stats),
         str(SCRIPTS / "train_unet_lora.py"), "--steps", "3", "--out", str(result)],
        child_env,
    )
    assert child.returncode == 0, child.stderr
    trained, counters = json.loads(result.read_text()), json.loads(stats.read_text())
    assert len(trained["losses"]) == 3 and all(math.isfinite(loss) for loss in trained["losses"])
    assert trained["attention_calls"] > 0
    # Every attention layer call of the child was one dispatcher call; on the CPU each falls back.
    assert counters == dict(kernel=0, kernel_8bit=0, fallback=trained["attention_calls"],
                            fallback_reasons={CPU_REASON: trained["attention_calls"]}, exact_not_8bit_reasons={},
                            pid=counters["pid"], sdpa_patch_enabled=True, training=True)
    assert counters["pid"] != os.getpid()
    assert "torch SDPA routed through the dispatcher" in child.stderr


def test_unet_lora_training_runs_forward_and_backward_on_the_kernels(fake_gpu, tmp_path, launcher_sandbox):
    result = tmp_path / "result.json"
    assert launch_in_process(["--quiet", str(SCRIPTS / "train_unet_lora.py"), "--steps", "2",
                              "--autocast", "bf16", "--out", str(result)]) == 0
    trained = json.loads(result.read_text())
    assert trained["name"] == "__main__"
    assert rdna_flash_attn.stats()["fallback"] == 0, rdna_flash_attn.stats()
    assert fake_gpu.differentiable_launches == trained["attention_calls"] > 0

    # The same run on PyTorch SDPA (same seed, same data): the same training, to bf16 rounding.
    rdna_flash_attn.settings.disable = True
    assert launch_in_process(["--quiet", str(SCRIPTS / "train_unet_lora.py"), "--steps", "2",
                              "--autocast", "bf16", "--out", str(result)]) == 0
    reference = json.loads(result.read_text())["losses"]
    assert trained["losses"] == pytest.approx(reference, rel=2e-2)
    assert fake_gpu.differentiable_launches == trained["attention_calls"]


def test_no_training_flag_keeps_backward_off_the_kernels(fake_gpu, tmp_path, launcher_sandbox):
    result = tmp_path / "result.json"
    assert launch_in_process(["--quiet", "--no-training", str(SCRIPTS / "train_unet_lora.py"), "--steps", "1",
                              "--autocast", "bf16", "--out", str(result)]) == 0
    calls = json.loads(result.read_text())["attention_calls"]
    assert fake_gpu.differentiable_launches == 0 and not fake_gpu.launches
    assert rdna_flash_attn.stats()["fallback_reasons"] == {"gradients needed and RDNA_FA_TRAINING=0": calls}
    assert os.environ["RDNA_FA_TRAINING"] == "0" and os.environ["RDNA_FA_PATCH_SDPA"] == "1"


def test_script_sees_what_python_script_py_would_give_it(tmp_path, launcher_sandbox):
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    script = write_script(tmp_path, """
        import json, sys
        import torch.nn.functional as F
        import sibling  # found through sys.path[0], the script's folder
        json.dump(dict(argv=sys.argv, name=__name__, path0=sys.path[0], value=sibling.VALUE,
                       patched=F.scaled_dot_product_attention.__module__), open(sys.argv[1], "w"))
        sys.exit(int(sys.argv[2]))
    """)
    out = tmp_path / "seen.json"
    assert launch_in_process(["--quiet", str(script), str(out), "5", "--stats", "not ours"]) == 5
    seen = json.loads(out.read_text())
    assert seen == dict(argv=[str(script), str(out), "5", "--stats", "not ours"], name="__main__",
                        path0=str(tmp_path), value=7, patched="rdna_flash_attn.dispatch.router")
    assert sdpa_patch.sdpa_patch_enabled()


def test_module_form_runs_the_module_as_main(tmp_path, launcher_sandbox, monkeypatch):
    package = tmp_path / "trainer_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(textwrap.dedent("""
        import json, sys
        if __name__ == "__main__":
            json.dump(sys.argv[1:], open(sys.argv[1], "w"))
    """))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "argv.json"
    launch.main(["--quiet", "-m", "trainer_pkg.train", str(out), "--flag"])
    assert json.loads(out.read_text()) == [str(out), "--flag"]


def test_script_exception_gives_its_traceback_and_exit_status(tmp_path, child_env):
    script = write_script(tmp_path, """
        def train():
            raise RuntimeError("out of data at step 3")
        train()
    """)
    child = run_child([sys.executable, "-m", "rdna_flash_attn.launch", "--quiet", str(script)], child_env)
    assert child.returncode == 1
    assert child.stderr.rstrip().endswith("RuntimeError: out of data at step 3")
    assert f'File "{script}", line 3, in train' in child.stderr


@pytest.mark.parametrize("rank", [["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=1"]])
def test_a_distributed_launchers_rank_goes_to_the_script(rank, tmp_path, child_env):
    # DeepSpeed runs `python -u -m rdna_flash_attn.launch --local_rank=N script.py args` on each worker.
    script = write_script(tmp_path, """
        import json, sys
        print(json.dumps(sys.argv[1:]))
    """)
    child = run_child([sys.executable, "-m", "rdna_flash_attn.launch", *rank, "--quiet", str(script), "--deepspeed"],
                      child_env)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == [*rank, "--deepspeed"]


def test_a_distributed_launchers_rank_goes_to_a_module_too():
    options, module, target = launch._split(["--local_rank=0", "--no-training", "-m", "trainer.train", "--x"])
    assert options.no_training and module == "trainer.train" and target == ["trainer.train", "--local_rank=0", "--x"]


@pytest.fixture
def sd_scripts(tmp_path):
    """A folder laid out as kohya sd-scripts: library/train_util.py beside the trainers."""
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "train_util.py").write_text("")
    return tmp_path


@pytest.mark.parametrize("args, config, hinted", [
    ([], None, True),
    (["--sdpa"], None, False),
    (["--xformers"], None, False),
    (["--config_file", "cfg.toml"], "sdpa = true\n", False),
    (["--config_file=cfg.toml"], "sdpa = false\n", True),
])
def test_sd_scripts_without_sdpa_is_told_to_add_it(sd_scripts, args, config, hinted):
    if config is not None:
        (sd_scripts / "cfg.toml").write_text(config)
    args = [arg.replace("cfg.toml", str(sd_scripts / "cfg.toml")) for arg in args]
    hint = launch.sd_scripts_attention_hint(str(sd_scripts / "train_network.py"), args)
    assert (hint is not None and "add --sdpa" in hint) is hinted
    assert launch.sd_scripts_attention_hint(str(sd_scripts / "flux_train_network.py"), []) is None
    assert launch.sd_scripts_attention_hint(str(sd_scripts.parent / "train_network.py"), []) is None


def test_usage_errors_exit_2(capsys):
    assert launch_in_process(["--quiet"]) == 2
    assert "a script to run" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's command line is not installed")
def test_accelerate_launch_runs_a_kohya_style_trainer_through_the_launcher(tmp_path, child_env):
    result, stats = tmp_path / "calls.json", tmp_path / "stats.json"
    child = run_child(
        ["accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1",
         "-m", "rdna_flash_attn.launch", "--stats", str(stats),
         str(SCRIPTS / "train_kohya_like.py"), "--steps", "4", "--out", str(result)],
        child_env,
    )
    assert child.returncode == 0, child.stderr
    calls, counters = json.loads(result.read_text()), json.loads(stats.read_text())
    # Masked or not, every call reaches the device check (CPU here).
    assert counters["fallback_reasons"] == {CPU_REASON: calls["unmasked"] + calls["masked"]}
    assert calls["masked"] == 2 and counters["kernel"] == 0 and counters["sdpa_patch_enabled"]


def test_dispatcher_is_what_the_launched_script_calls(tmp_path, launcher_sandbox, fake_gpu):
    script = write_script(tmp_path, """
        import torch, torch.nn.functional as F
        q = torch.randn(1, 2, 16, 8, dtype=torch.float16)
        F.scaled_dot_product_attention(q, q, q)
    """)
    launch.main(["--quiet", str(script)])
    assert torch.nn.functional.scaled_dot_product_attention is dispatcher_sdpa
    assert len(fake_gpu.launches) == 1
