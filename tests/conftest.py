"""Shared fixtures: isolated settings and caches for every test, and a CPU stand-in for an RDNA GPU."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from pathlib import Path
from types import SimpleNamespace

from rdna_flash_attn import environment
from rdna_flash_attn.config import LOGGER_NAME, Settings, settings
from rdna_flash_attn.dispatch import router as dispatch, sdpa_patch, selftest
from rdna_flash_attn.dispatch.state import state
from rdna_flash_attn.ops import autograd, attention as ops, plans
from rdna_flash_attn.runtime import artifacts, device, loader

from . import seeds

ZLUDA_NAME = "AMD Radeon RX 7900 XTX [ZLUDA]"
FAKE_ARTIFACT = {"target": "gfx1100", "path": "/fake/prebuilt/gfx1100.hsaco", "sha256": "ab" * 32, "emulated": False}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Fresh settings, counters, per-device verdicts and log memory; a private self-test cache."""
    saved = Settings(**dataclasses.asdict(settings))
    settings.load(Settings())
    settings.cache_dir = str(tmp_path / "cache")
    dispatch.forget_devices()
    dispatch.reset_stats()
    monkeypatch.setattr(state, "logged", set())
    monkeypatch.setattr(environment, "_warned", set())
    yield
    sdpa_patch.disable_sdpa_patch()
    settings.load(saved)
    dispatch.forget_devices()


class _CudaLooking(torch.Tensor):
    """A CPU tensor that reports a GPU device, so ops' real checks can judge CPU test tensors."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _as_gpu(t):
    return t.as_subclass(_CudaLooking) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t


def _math_attention(q, k, v, is_causal=False, scale=None, attn_mask=None, bottom_right=False):
    """Attention in float32 (as a kernel accumulates), out in q's dtype, plus the log-sum-exp: SDPA's
    masks, key/value heads shared by groups of query heads, rows that see no key give zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if is_causal:
        shift = k.shape[-2] - q.shape[-2] if bottom_right else 0
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(shift)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    sees_no_key = (scores == float("-inf")).all(-1, keepdim=True)  # zeros there; NaN inputs stay NaN
    lse = scores.logsumexp(-1).masked_fill(sees_no_key[..., 0], float("inf"))  # the kernels' mark of such rows
    probs = scores.softmax(-1).masked_fill(sees_no_key, 0.0)
    return (probs @ v.float()).to(q.dtype), lse


def _math_gradients_from_output(dout, q, k, v, out, lse, is_causal=False, scale=None, attn_mask=None,
                                bottom_right=False):
    """(dq, dk, dv) in float32 from a given out and lse, as flash-attn's backward computes them (the
    probabilities from lse, rowsum(dout * out) from out), in the inputs' dtypes; a row whose lse is not
    finite gets zero gradients."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ k_full.transpose(-2, -1)) * scale
    if is_causal:
        shift = k.shape[-2] - q.shape[-2] if bottom_right else 0
        scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(shift), float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.float())
    lse = lse.float().masked_fill(~torch.isfinite(lse), float("inf"))[..., None]
    probs = (scores - lse).exp()
    dscores = probs * (dout.float() @ v_full.transpose(-2, -1) - (dout.float() * out.float()).sum(-1, keepdim=True))
    dq = dscores @ k_full * scale
    dk, dv = dscores.transpose(-2, -1) @ q.float() * scale, probs.transpose(-2, -1) @ dout.float()
    dk, dv = (g.unflatten(1, (k.shape[1], group)).sum(2) for g in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FakeDevices:
    """device.describe's double: every device is the one these attributes describe (counts calls)."""

    def __init__(self):
        self.info = dict(backend="zluda", name=ZLUDA_NAME, gfx_target="gfx1100", runtime_version="6.2.41512")
        self.calls = 0
        self.loads = 0  # loaded_library calls
        self.sha256 = FAKE_ARTIFACT["sha256"]  # of the code object loaded_library gives

    def describe(self, dev):
        self.calls += 1
        return device.DeviceInfo(index=torch.device(dev).index, **self.info)

    def loaded_library(self, info: device.DeviceInfo):
        """loader.loaded_library's double: the code object and device description a library carries."""
        self.loads += 1
        artifact = artifacts.Artifact(FAKE_ARTIFACT["target"], Path(FAKE_ARTIFACT["path"]), self.sha256,
                                      emulated=False)
        return SimpleNamespace(artifact=artifact, device_info=info, runtime_version=info.runtime_version)


_real_plan_forward = plans.plan_forward
_real_plan_varlen = plans.plan_varlen


def _plain(t):
    """A mask view the fakes' planning made of a GPU-looking tensor, as the plain CPU tensor it is."""
    return None if t is None else t.as_subclass(torch.Tensor)


class FakeKernels:
    """The kernels' double on the CPU: the real plans (their checks), float32 math for the result."""

    def __init__(self):
        self.devices = FakeDevices()
        self.launches = []  # (q, k, v, is_causal, scale) of each plain forward launch
        self.differentiable_launches = 0
        self.varlen_launches = 0
        self.backward_from_output_launches = 0
        self.prepared_launches = 0  # forward_launcher calls: one per plan of a forward-only call
        self.error = 0.0  # added to every output: a broken kernel
        self.raises: Exception | None = None

    def plan_forward(self, q, k, v, is_causal=False, scale=None, attn_mask=None, **kwargs):
        return _real_plan_forward(_as_gpu(q), _as_gpu(k), _as_gpu(v), is_causal, scale, _as_gpu(attn_mask), **kwargs)

    def plan_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        return _real_plan_varlen(*(_as_gpu(t) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)), *args, **kwargs)

    def _forward(self, q, k, v, is_causal, scale, attn_mask, bottom_right):
        if self.raises is not None:
            raise self.raises
        self.launches.append((q, k, v, is_causal, scale))
        out, lse = _math_attention(q, k, v, is_causal, scale, attn_mask, bottom_right)
        return out + self.error, lse.detach()  # the op marks it non-differentiable

    def flash_attention_forward(self, q, k, v, is_causal=False, scale=None, *, attn_mask=None, bottom_right=False):
        """ops' own entry point, as the self-test calls it."""
        plan = self.plan_forward(q, k, v, is_causal, scale, attn_mask, bottom_right=bottom_right)
        assert isinstance(plan, plans.ForwardPlan), "launched on refused input"
        return self._forward(q, k, v, is_causal, scale, attn_mask, bottom_right)

    def forward_launcher(self, plan, device):
        self.prepared_launches += 1
        return lambda args, buffers: None

    def launch_forward(self, plan, q, k, v, *, out=None, lse=None, saved=None, launcher=None):
        """A plan's launch, as the dispatcher makes it: a plan without a launcher prepares one."""
        assert isinstance(plan, plans.ForwardPlan)
        if launcher is None:
            ops.forward_launcher(plan, q.device)
        return self._forward(q, k, v, plan.is_causal, plan.scale, _plain(plan.mask), plan.bottom_right)

    def flash_attention_with_lse(self, q, k, v, is_causal=False, scale=None, *, attn_mask=None, bottom_right=False):
        plan = self.plan_forward(q, k, v, is_causal, scale, attn_mask, bottom_right=bottom_right)
        assert isinstance(plan, plans.ForwardPlan), "launched on refused input"
        self.differentiable_launches += 1
        out, lse = _math_attention(q, k, v, is_causal, scale, _plain(attn_mask), bottom_right)
        return out + self.error, lse.detach()  # the op marks it non-differentiable

    def flash_attention(self, q, k, v, is_causal=False, scale=None, *, attn_mask=None, bottom_right=False):
        return self.flash_attention_with_lse(q, k, v, is_causal, scale, attn_mask=attn_mask,
                                             bottom_right=bottom_right)[0]

    def launch_backward_from_output(self, dout, q, k, v, out, lse, is_causal=False, scale=None, *, attn_mask=None,
                                    bottom_right=False):
        self.backward_from_output_launches += 1
        return _math_gradients_from_output(dout, q, k, v, out, lse, is_causal, scale, _plain(attn_mask), bottom_right)

    def varlen_attention(self, plan, q, k, v, cu_seqlens_q, cu_seqlens_k):
        """Packed batches: each entry through _math_attention, causal bottom-right; (out, lse (H, total_q))."""
        assert isinstance(plan, plans.VarlenPlan)
        self.varlen_launches += 1
        out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"))
        offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(offsets_q) - 1):
            rows, keys = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
            if rows.stop > rows.start and keys.stop > keys.start:
                entry = (t[span].transpose(0, 1)[None] for t, span in ((q, rows), (k, keys), (v, keys)))
                entry_out, entry_lse = _math_attention(*entry, plan.is_causal, plan.scale, bottom_right=True)
                out[rows], lse[:, rows] = entry_out[0].transpose(0, 1), entry_lse[0]
        return out + self.error, lse


@pytest.fixture
def untested_fake_gpu(monkeypatch) -> FakeKernels:
    """The CPU plays an RX 7900 XTX under ZLUDA whose kernels compute attention in float32 math;
    its self-test has not run yet."""
    kernels = FakeKernels()
    monkeypatch.setattr(device, "describe", kernels.devices.describe)
    monkeypatch.setattr(loader, "loaded_library", kernels.devices.loaded_library)
    monkeypatch.setattr(ops, "artifact_info", lambda dev: dict(FAKE_ARTIFACT))
    monkeypatch.setattr(plans, "plan_forward", kernels.plan_forward)
    monkeypatch.setattr(plans, "plan_varlen", kernels.plan_varlen)
    monkeypatch.setattr(ops, "flash_attention_forward", kernels.flash_attention_forward)
    monkeypatch.setattr(ops, "forward_launcher", kernels.forward_launcher)
    monkeypatch.setattr(ops, "launch_forward", kernels.launch_forward)
    monkeypatch.setattr(ops, "launch_backward_from_output", kernels.launch_backward_from_output)
    monkeypatch.setattr(autograd, "flash_attention", kernels.flash_attention)
    monkeypatch.setattr(autograd, "flash_attention_with_lse", kernels.flash_attention_with_lse)
    monkeypatch.setattr(autograd, "varlen_attention", kernels.varlen_attention)
    return kernels


@pytest.fixture
def fake_gpu(untested_fake_gpu, monkeypatch) -> FakeKernels:
    """untested_fake_gpu with a passed self-test already cached, so no test launch is counted."""
    with monkeypatch.context() as patch:
        patch.setattr(selftest, "run_checks", lambda dev, gradients=None: [])
        gpu = torch.device("cuda", 0)
        selftest.run(gpu, loader.loaded_library(device.describe(gpu)))
    return untested_fake_gpu


@pytest.fixture
def log_records(caplog):
    """caplog capturing everything the package logs."""
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    return caplog


def pytest_configure(config):
    seeds.draw_run_seed()


def pytest_terminal_summary(terminalreporter):
    seed = seeds.draw_run_seed()
    terminalreporter.write_line(f"random inputs: run seed {seed} ({seeds.RUN_SEED_VARIABLE}={seed} gives them again)")
