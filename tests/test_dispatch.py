"""The support matrix: which calls reach the kernels, every fallback reason, counters and logging."""

from __future__ import annotations

import io
import logging
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.dispatch import router as dispatch, selftest
from rdna_flash_attn.ops import attention as ops, autograd, plans
from rdna_flash_attn.runtime import loader as runtime
from rdna_flash_attn.config import settings


def qkv(batch=2, heads=3, q_len=40, k_len=40, dim=64, dtype=torch.float16, **kwargs):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, n, dim, generator=gen, dtype=dtype, **kwargs) for n in (q_len, k_len, k_len)]


def assert_close_to_sdpa(out, q, k, v, **kwargs):
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    assert out.dtype == q.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2 if q.dtype == torch.bfloat16 else 2e-3, rtol=0)


def only_reason() -> str:
    reasons = rfa.stats()["fallback_reasons"]
    assert rfa.stats()["kernel"] == 0 and len(reasons) == 1, rfa.stats()
    return next(iter(reasons))


# --- the kernel path --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((2, 3, 40, 40, 64), {}),
        ((1, 8, 33, 77, 40), {}),  # cross-attention, odd lengths
        ((1, 2, 50, 30, 128), {"is_causal": True}),  # top-left causal with Sq > Sk
        ((1, 2, 30, 50, 160), {"is_causal": True, "scale": 0.3}),
        ((1, 1, 16, 16, 512), {"scale": 1}),
    ],
)
def test_supported_calls_run_on_the_kernels_and_match_sdpa(fake_gpu, dtype, shape, kwargs):
    batch, heads, q_len, k_len, dim = shape
    q, k, v = qkv(batch, heads, q_len, k_len, dim, dtype)
    out = rfa.scaled_dot_product_attention(q, k, v, **kwargs)
    assert rfa.stats() == {"kernel": 1, "kernel_8bit": 0, "fallback": 0, "fallback_reasons": {},
                           "exact_not_8bit_reasons": {}}
    assert len(fake_gpu.launches) == 1
    assert_close_to_sdpa(out, q, k, v, **kwargs)


def test_kernels_get_the_callers_tensors_without_copies(fake_gpu):
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    launched = fake_gpu.launches[0][:3]
    assert all(a is b for a, b in zip(launched, (q, k, v)))


def test_enable_gqa_with_equal_head_counts_still_runs_on_the_kernels(fake_gpu):
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert rfa.stats()["kernel"] == 1


def test_explain_says_kernel(fake_gpu):
    q, k, v = qkv()
    assert rfa.explain(q, k, v, is_causal=True) == "runs on the kernels: torch.float16, head dim 64, causal"
    assert rfa.stats()["kernel"] == 0 and not fake_gpu.launches  # explaining runs nothing


# --- every fallback reason --------------------------------------------------------------------------


def misaligned():
    """(2, 3, 40, 64) float16 starting 8 bytes into its storage."""
    return torch.randn(2 * 3 * 40 * 64 + 4, dtype=torch.float16)[4:].view(2, 3, 40, 64)


def _nested():
    with warnings.catch_warnings():  # "prototype stage"
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.randn(2, 5, 64), torch.randn(2, 7, 64)], dtype=torch.float16)


FALLBACKS = {
    # name: (make (args, kwargs), a word the reason must contain)
    "3-D inputs": (lambda: ([t[0] for t in qkv()], {}), "4-D"),
    "5-D inputs": (lambda: ([t.unsqueeze(0) for t in qkv()], {}), "4-D"),
    "mask at a head dim without masked kernels": (
        lambda: (qkv(dim=256), {"attn_mask": torch.ones(40, 40, dtype=torch.bool)}), "masked kernels"),
    "dropout": (lambda: (qkv(), {"dropout_p": 0.1}), "dropout"),
    "dropout as a tensor": (lambda: (qkv(), {"dropout_p": torch.tensor(0.0)}), "dropout"),
    "scale as a tensor": (lambda: (qkv(), {"scale": torch.tensor(0.5)}), "scale"),
    "float32 inputs": (lambda: (qkv(dtype=torch.float32), {}), "float32"),
    "float64 inputs": (lambda: (qkv(dtype=torch.float64), {}), "dtype"),
    "head dim 12": (lambda: (qkv(dim=12), {}), "head dim"),
    "head dim 264": (lambda: (qkv(dim=264), {}), "head dim"),
    "value head dim differs": (lambda: (qkv()[:2] + [torch.randn(2, 3, 40, 32, dtype=torch.float16)], {}), "head dim"),
    "broadcast batch": (lambda: ([qkv(batch=2)[0]] + qkv(batch=1)[1:], {}), "batch"),
    "empty query": (lambda: (qkv(q_len=0), {}), "empty"),
    "empty keys": (lambda: (qkv(k_len=0), {}), "empty"),
    "head dim 0": (lambda: (qkv(dim=0), {}), "head dim"),
    "strided head dim": (lambda: ([t[..., ::2] for t in qkv(dim=128)], {}), "contiguous"),
    "misaligned storage": (lambda: ([misaligned()] * 3, {}), "16-byte"),
    "infinite scale": (lambda: (qkv(), {"scale": float("inf")}), "scale"),
    "nested tensors": (lambda: ([_nested()] * 3, {}), "nested"),
    "parameter subclass": (lambda: ([torch.nn.Parameter(t) for t in qkv()], {}), "plain"),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_every_fallback_reason_gives_sdpas_own_result(fake_gpu, name):
    make, word = FALLBACKS[name]
    args, kwargs = make()
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(*args, **kwargs) if "dropout_p" not in kwargs else None
        out = rfa.scaled_dot_product_attention(*args, **kwargs)
    assert word in only_reason()
    assert not fake_gpu.launches
    if expected is not None:
        if expected.is_nested:
            for a, b in zip(out.unbind(), expected.unbind()):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert word in rfa.explain(*args, **kwargs)


def test_key_value_length_mismatch_falls_back_where_sdpa_decides(fake_gpu):
    q, k, _ = qkv()
    v = torch.randn(2, 3, 39, 64, dtype=torch.float16)
    try:
        expected = F.scaled_dot_product_attention(q, k, v)
    except RuntimeError as exc:
        with pytest.raises(type(exc)):
            rfa.scaled_dot_product_attention(q, k, v)
    else:
        assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), expected)
    assert "lengths" in only_reason() and not fake_gpu.launches


def test_disabled_by_setting(fake_gpu):
    settings.disable = True
    rfa.scaled_dot_product_attention(*qkv())
    assert "RDNA_FA_DISABLE" in only_reason() and not fake_gpu.launches


def test_cpu_tensors_fall_back_without_fakes():
    q, k, v = qkv(dtype=torch.float32)
    assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert "CPU" in only_reason()


@pytest.mark.parametrize(
    "info, word",
    [
        (dict(backend="cuda", name="NVIDIA H100", gfx_target=None, runtime_version="12.8"), "NVIDIA"),
        (dict(backend="rocm", name="AMD Instinct MI210", gfx_target="gfx90a", runtime_version="6.2"), "gfx90a"),
        (dict(backend="zluda", name="RX 6800 [ZLUDA]", gfx_target="gfx1030", runtime_version="6.2"), "gfx1030"),
        (dict(backend="zluda", name="AMD Radeon [ZLUDA]", gfx_target=None, runtime_version=None), "unknown"),
        (dict(backend="other", name="xpu", gfx_target=None, runtime_version=None), "xpu"),
    ],
)
def test_policy_keeps_kernels_off_and_force_overrides_it(fake_gpu, info, word):
    fake_gpu.devices.info = info
    rfa.scaled_dot_product_attention(*qkv())
    assert word in only_reason()
    settings.force = True
    rfa.scaled_dot_product_attention(*qkv())
    assert rfa.stats()["kernel"] == 1


@pytest.mark.parametrize("target", ["gfx1100", "gfx1101", "gfx1102", "gfx1103",
                                    "gfx1150", "gfx1151", "gfx1152", "gfx1200", "gfx1201"])
def test_rdna3_and_rdna4_targets_are_on(fake_gpu, target):
    fake_gpu.devices.info["gfx_target"] = target
    fake_gpu.devices.info["backend"] = "rocm"
    rfa.scaled_dot_product_attention(*qkv())
    assert rfa.stats()["kernel"] == 1


def refuse_code_object(monkeypatch, reason: str) -> None:
    """The runtime refuses to load the device's code object, with `reason`."""

    def refused(info):
        raise runtime.KernelUnavailable(reason)

    monkeypatch.setattr(runtime, "loaded_library", refused)


def test_missing_artifact_falls_back_with_its_reason(fake_gpu, monkeypatch):
    refuse_code_object(monkeypatch, "no code object for gfx1100")
    settings.force = True  # force cannot conjure an artifact
    rfa.scaled_dot_product_attention(*qkv())
    assert only_reason() == "no code object for gfx1100"


def test_device_verdict_is_cached(fake_gpu):
    rfa.scaled_dot_product_attention(*qkv())
    described, loaded = fake_gpu.devices.calls, fake_gpu.devices.loads
    for _ in range(5):
        rfa.scaled_dot_product_attention(*qkv())
    assert fake_gpu.devices.loads == loaded and fake_gpu.devices.calls == described
    assert rfa.stats()["kernel"] == 6


# --- dtypes: the fp32 opt-in and autocast ------------------------------------------------------------


@pytest.mark.parametrize("cast, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fp32_cast_runs_fp32_inputs_on_the_kernels_and_returns_fp32(fake_gpu, cast, dtype):
    settings.fp32_cast = cast
    q, k, v = qkv(dtype=torch.float32)
    out = rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["kernel"] == 1 and fake_gpu.launches[0][0].dtype == dtype
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=3e-2, rtol=0)


def test_fp32_cast_does_not_touch_mixed_dtypes(fake_gpu):
    settings.fp32_cast = "bf16"
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k.half(), v)
    with pytest.raises(RuntimeError):
        rfa.scaled_dot_product_attention(q, k.half(), v)
    assert not fake_gpu.launches


@pytest.mark.parametrize("inputs", [torch.float32, torch.float16, torch.bfloat16])
def test_autocast_runs_in_the_autocast_dtype_like_sdpa(fake_gpu, inputs):
    q, k, v = qkv(dtype=inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.scaled_dot_product_attention(q, k, v)
        out = rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["kernel"] == 1 and fake_gpu.launches[0][0].dtype == torch.bfloat16
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=0)


# --- gradients --------------------------------------------------------------------------------------


def test_grad_runs_the_differentiable_kernels(fake_gpu):
    q, k, v = qkv(requires_grad=True)
    rfa.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert fake_gpu.differentiable_launches == 1 and rfa.stats()["kernel"] == 1 and not fake_gpu.launches
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).sum().backward()
    for ours, theirs in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(ours.grad.float(), theirs.grad, atol=1e-2, rtol=0)


def test_grad_with_training_off_falls_back(fake_gpu):
    settings.training = False
    q, k, v = qkv(requires_grad=True)
    rfa.scaled_dot_product_attention(q, k, v).sum().backward()
    assert "RDNA_FA_TRAINING" in only_reason() and q.grad is not None and not fake_gpu.differentiable_launches


def test_grad_through_the_fp32_cast(fake_gpu):
    q, k, v = qkv(dtype=torch.float32, requires_grad=True)
    settings.fp32_cast = "bf16"
    rfa.scaled_dot_product_attention(q, k, v).sum().backward()
    assert fake_gpu.differentiable_launches == 1 and rfa.stats()["kernel"] == 1
    assert q.grad.dtype == torch.float32 and q.grad.shape == q.shape


def test_no_grad_and_inference_use_the_plain_forward(fake_gpu):
    q, k, v = qkv(requires_grad=True)
    with torch.no_grad():
        rfa.scaled_dot_product_attention(q, k, v)
    with torch.inference_mode():
        rfa.scaled_dot_product_attention(*qkv())
    rfa.scaled_dot_product_attention(*qkv())  # no input requires grad
    assert rfa.stats()["kernel"] == 3 and len(fake_gpu.launches) == 3 and fake_gpu.differentiable_launches == 0


# --- self-test and kernel failures -------------------------------------------------------------------


def test_self_test_runs_once_on_the_first_supported_call(untested_fake_gpu, monkeypatch):
    runs = []
    monkeypatch.setattr(selftest, "run_checks", lambda dev, gradients=None: runs.append(dev) or [])
    rfa.scaled_dot_product_attention(*qkv(dtype=torch.float32))  # unsupported: no self-test yet
    assert runs == []
    for _ in range(3):
        rfa.scaled_dot_product_attention(*qkv())
    assert len(runs) == 1


def test_failed_self_test_turns_the_kernels_off_with_one_warning(untested_fake_gpu, log_records):
    untested_fake_gpu.error = 0.5
    q, k, v = qkv()
    for _ in range(3):
        out = rfa.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert "self-test failed" in only_reason() and rfa.stats()["fallback"] == 3
    warnings = [r for r in log_records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RX 7900 XTX" in warnings[0].getMessage()


def test_kernel_unavailable_at_launch_falls_back(fake_gpu):
    fake_gpu.raises = ops.KernelUnavailable("variant d64 missing from the artifact")
    q, k, v = qkv()
    assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert only_reason() == "variant d64 missing from the artifact"


def test_kernel_unavailable_while_preparing_a_launch_falls_back(fake_gpu, monkeypatch):
    def refused(*args):
        raise ops.KernelUnavailable("code object refused by the HIP runtime")

    monkeypatch.setattr(ops, "forward_launcher", refused)
    q, k, v = qkv()
    for _ in range(2):
        assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert only_reason() == "code object refused by the HIP runtime" and rfa.stats()["fallback"] == 2


def test_a_forward_signature_prepares_its_launch_once(fake_gpu):
    """The cached route keeps its prepared launch: later calls of the signature, on other storage
    too, go straight to it; another signature prepares its own."""
    q, k, v = qkv()
    same_signature = [t.clone() for t in (q, k, v)]
    for args in ((q, k, v), same_signature, (q, k, v)):
        assert_close_to_sdpa(rfa.scaled_dot_product_attention(*args), *args)
    assert_close_to_sdpa(rfa.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, is_causal=True)
    assert fake_gpu.prepared_launches == 2 and rfa.stats()["kernel"] == 4
    assert all(launch[0] is query for launch, query in zip(fake_gpu.launches, (q, same_signature[0], q)))
    assert [launch[3] for launch in fake_gpu.launches] == [False, False, False, True]


def test_kernel_error_turns_that_kernel_off_and_falls_back(fake_gpu, log_records):
    fake_gpu.raises = OSError("hipModuleLaunchKernel failed")
    q, k, v = qkv()
    for _ in range(2):
        assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    fake_gpu.raises = None
    rfa.scaled_dot_product_attention(q, k, v)
    assert not fake_gpu.launches and rfa.stats()["fallback"] == 3
    assert only_reason() == "rdna_fa_fwd_f16_d64 failed (OSError: hipModuleLaunchKernel failed); off for cpu"
    assert [r.levelno for r in log_records.records].count(logging.WARNING) == 1
    assert not [r for r in log_records.records if r.levelno >= logging.ERROR]
    assert rfa.explain(q, k, v).startswith("falls back to PyTorch SDPA: rdna_fa_fwd_f16_d64 failed")


LONG_ERROR = "hipErrorLaunchFailure: unspecified launch failure " + "x" * 6000 + "\nkernel arguments:\n" + "0" * 500


def test_a_long_error_gives_one_short_line_and_the_rest_at_debug(fake_gpu, log_records):
    fake_gpu.raises = RuntimeError(LONG_ERROR)
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    reason = only_reason()
    assert len(reason) <= dispatch.MAX_REASON_CHARS and "\n" not in reason
    assert reason.startswith("rdna_fa_fwd_f16_d64 failed (RuntimeError: hipErrorLaunchFailure: unspecified launch")
    assert reason.endswith("...); off for cpu")
    (warning,) = [r for r in log_records.records if r.levelno == logging.WARNING]
    assert reason in warning.getMessage() and len(warning.getMessage()) <= dispatch.MAX_REASON_CHARS + 100
    assert "\n" not in warning.getMessage() and warning.exc_info is None
    (debug,) = [r for r in log_records.records if r.levelno == logging.DEBUG]
    assert LONG_ERROR in log_records.text and debug.exc_info[1] is fake_gpu.raises


def test_a_failed_kernel_leaves_every_other_kernel_on(fake_gpu):
    q, k, v = qkv()
    fake_gpu.raises = OSError("hipModuleLaunchKernel failed")
    rfa.scaled_dot_product_attention(q, k, v)
    fake_gpu.raises = None
    rfa.reset_stats()
    wide = qkv(dim=128)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    for args, kwargs in (((q, k, v), {}), (wide, {}), ((q.bfloat16(), k.bfloat16(), v.bfloat16()), {}),
                         ((q, k, v), {"attn_mask": mask}), ((q, k, v), {"is_causal": True})):
        rfa.scaled_dot_product_attention(*args, **kwargs)
    # Only f16 d64 unmasked (causal or not: one kernel) falls back; bf16, d128 and the masked kernel run.
    assert rfa.stats()["kernel"] == 3 and rfa.stats()["fallback"] == 2


def test_out_of_memory_falls_back_for_that_call_only(fake_gpu, log_records):
    fake_gpu.raises = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB " + "y" * 6000)
    q, k, v = qkv()
    assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    reason = only_reason()
    assert "GPU memory" in reason and len(reason) <= dispatch.MAX_REASON_CHARS
    fake_gpu.raises = None
    assert_close_to_sdpa(rfa.scaled_dot_product_attention(q, k, v), q, k, v)
    assert rfa.stats()["kernel"] == 1 and len(fake_gpu.launches) == 1
    assert not [r for r in log_records.records if r.levelno >= logging.WARNING]


def test_a_failed_backward_turns_off_gradients_of_its_class_only(fake_gpu, monkeypatch, log_records):
    """The backward runs inside autograd: its error reaches the caller's backward, and the dispatcher's
    later calls of that class needing gradients fall back; forward-only calls keep the kernels."""
    def failing_backward(*args, **kwargs):
        raise RuntimeError(LONG_ERROR)

    monkeypatch.setattr(ops, "launch_backward", failing_backward)
    q, k, v = qkv()
    no_stats = (q.new_empty(0),) * 3
    with pytest.raises(RuntimeError, match="hipErrorLaunchFailure"):
        autograd._backward(q, q, k, v, q, q.new_zeros(q.shape[:3]), no_stats, None, False, None, False)
    grad_q, grad_k, grad_v = (t.clone().requires_grad_() for t in (q, k, v))
    rfa.scaled_dot_product_attention(grad_q, grad_k, grad_v)
    reason = only_reason()
    assert reason.startswith("rdna_fa_bwd_dq_f16_d64 and rdna_fa_bwd_dkdv_f16_d64 failed (RuntimeError: ")
    assert len(reason) <= dispatch.MAX_REASON_CHARS and "\n" not in reason
    rfa.scaled_dot_product_attention(q, k, v)
    rfa.scaled_dot_product_attention(*(t.clone().requires_grad_() for t in qkv(dim=128)))
    assert rfa.stats()["kernel"] == 2 and rfa.stats()["fallback"] == 1
    assert [r.levelno for r in log_records.records].count(logging.WARNING) == 1


def test_an_unavailable_kernel_turns_nothing_off(fake_gpu):
    fake_gpu.raises = ops.KernelUnavailable("no code object\n" + "z" * 6000)
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    assert only_reason() == "no code object"
    fake_gpu.raises = None
    rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["kernel"] == 1


# --- counters and logging ---------------------------------------------------------------------------


def test_counters_count_each_path_and_reset(fake_gpu):
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    rfa.scaled_dot_product_attention(q, k, v)
    rfa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    rfa.scaled_dot_product_attention(q.float(), k.float(), v.float())
    stats = rfa.stats()
    assert stats["kernel"] == 2 and stats["fallback"] == 2 and len(stats["fallback_reasons"]) == 2
    stats["fallback_reasons"].clear()  # a copy: callers cannot corrupt the counters
    assert rfa.stats()["fallback"] == 2
    rfa.reset_stats()
    assert rfa.stats() == {"kernel": 0, "kernel_8bit": 0, "fallback": 0, "fallback_reasons": {},
                           "exact_not_8bit_reasons": {}}


def test_each_fallback_reason_is_logged_once(fake_gpu, log_records):
    q, k, v = qkv()
    for _ in range(3):
        rfa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        rfa.scaled_dot_product_attention(q.float(), k.float(), v.float())
    rfa.reset_stats()
    rfa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    fallbacks = [r for r in log_records.records if "not using the kernels" in r.getMessage()]
    assert len(fallbacks) == 2 and all(r.levelno == logging.INFO for r in fallbacks)


def test_reasons_met_while_info_is_off_are_shown_once_it_is_on(fake_gpu, caplog):
    q, k, v = qkv()
    caplog.set_level(logging.WARNING, logger="rdna_flash_attn")
    rfa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    caplog.set_level(logging.INFO, logger="rdna_flash_attn")
    for _ in range(2):
        rfa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    shown = [r for r in caplog.records if "not using the kernels" in r.getMessage()]
    assert len(shown) == 1 and "dropout_p" in shown[0].getMessage()


def test_a_fallback_line_names_the_project_and_what_runs_instead(fake_gpu, log_records):
    rfa.scaled_dot_product_attention(*qkv(), dropout_p=0.5)
    rfa.attention_or_reason(*qkv(), is_causal=1, fallback_name="the host's attention")
    assert [r.getMessage() for r in log_records.records] == [
        "RDNA Flash Attention: not using the kernels: dropout_p is not 0 (PyTorch SDPA runs these calls)",
        "RDNA Flash Attention: not using the kernels: is_causal or enable_gqa is not a bool "
        "(the host's attention runs these calls)",
    ]


def test_a_log_line_is_not_glued_to_a_progress_bar(fake_gpu, log_records, monkeypatch):
    # A host's sampling loop draws a tqdm bar on the console; our line must start on a clean line.
    tqdm = pytest.importorskip("tqdm")
    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)
    with tqdm.tqdm(total=10, file=sys.stderr, mininterval=0) as bar:
        bar.update(3)
        drawn = console.getvalue()
        rfa.scaled_dot_product_attention(*qkv(), dropout_p=0.5)
        cleared = console.getvalue()
    assert "3/10" in drawn and cleared.startswith(drawn) and cleared != drawn
    assert cleared.endswith("\r")  # the bar's line is blanked and the cursor at its start
    assert len(log_records.records) == 1


def test_logs_go_through_the_package_logger_not_print(fake_gpu, log_records, capsys):
    rfa.scaled_dot_product_attention(*qkv(), dropout_p=0.5)
    assert capsys.readouterr() == ("", "")
    assert {r.name for r in log_records.records} == {"rdna_flash_attn"}


# --- the per-signature decision cache never changes a decision ----------------------------------------


def decide_each(calls) -> list[str]:
    """The path of each call: 'kernel', or the fallback reason; calls run in order."""
    outcomes = []
    for call in calls:
        before = rfa.stats()
        call()
        after = rfa.stats()
        if after["kernel"] > before["kernel"]:
            outcomes.append("kernel")
        else:
            grown = [r for r, n in after["fallback_reasons"].items() if n > before["fallback_reasons"].get(r, 0)]
            outcomes.append(grown[0])
    return outcomes


def test_cached_decisions_follow_every_settings_change(fake_gpu):
    q, k, v = qkv()
    q32, k32, v32 = qkv(dtype=torch.float32)
    sdpa = rfa.scaled_dot_product_attention

    def with_setting(name, value, call):
        def run():
            setattr(settings, name, value)
            call()
        return run

    outcomes = decide_each([
        lambda: sdpa(q, k, v),
        with_setting("disable", True, lambda: sdpa(q, k, v)),
        with_setting("disable", False, lambda: sdpa(q, k, v)),
        lambda: sdpa(q32, k32, v32),
        with_setting("fp32_cast", "bf16", lambda: sdpa(q32, k32, v32)),
        with_setting("fp32_cast", "off", lambda: sdpa(q32, k32, v32)),
    ])
    assert outcomes[0] == outcomes[2] == outcomes[4] == "kernel"
    assert "RDNA_FA_DISABLE" in outcomes[1] and "float32" in outcomes[3] and outcomes[5] == outcomes[3]


def test_cached_decisions_follow_grad_mode_autocast_and_alignment(fake_gpu):
    q, k, v = qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    shifted = torch.empty(q.numel() + 4, dtype=q.dtype)[4:].view(q.shape)  # same shape and strides, 8 bytes off
    shifted.copy_(q)
    sdpa = rfa.scaled_dot_product_attention

    def autocast_call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sdpa(q, k, v)

    def training_off():
        settings.training = False
        sdpa(*leaves)

    outcomes = decide_each([
        lambda: sdpa(q, k, v), lambda: sdpa(shifted, k, v), lambda: sdpa(q, k, v),
        lambda: sdpa(*leaves), training_off, autocast_call,
    ])
    assert outcomes[0] == outcomes[2] == outcomes[3] == outcomes[5] == "kernel"
    assert "16-byte" in outcomes[1] and "RDNA_FA_TRAINING" in outcomes[4]
    assert fake_gpu.differentiable_launches == 1 and fake_gpu.launches[-1][0].dtype == torch.bfloat16


def test_cached_decisions_tell_argument_types_apart(fake_gpu):
    q, k, v = qkv()
    kwargs = [{"is_causal": True}, {"is_causal": 1}, {"scale": 0.5}, {"scale": torch.tensor(0.5)},
              {"dropout_p": 0}, {"dropout_p": False}]
    outcomes = [rfa.attention_or_reason(q, k, v, **kw) for kw in kwargs]
    assert all(isinstance(out, torch.Tensor) for out in outcomes[::2])
    assert "bool" in outcomes[1] and "scale" in outcomes[3] and "dropout" in outcomes[5]


def test_forgetting_devices_drops_cached_decisions(fake_gpu, monkeypatch):
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    refuse_code_object(monkeypatch, "artifact removed")
    rfa.scaled_dot_product_attention(q, k, v)  # the device verdict is cached: still the kernels
    dispatch.forget_devices()
    rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["kernel"] == 2 and rfa.stats()["fallback_reasons"] == {"artifact removed": 1}


def test_the_runtime_dropping_its_libraries_drops_the_decisions_made_on_them(fake_gpu, monkeypatch):
    # A local rebuild drops the loaded code objects; the dispatcher hears it through loader.on_forget.
    q, k, v = qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    refuse_code_object(monkeypatch, "rebuilt code object refused")
    runtime.forget_libraries()
    rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["fallback_reasons"] == {"rebuilt code object refused": 1}


def test_an_explicit_library_serves_ops_callers_not_the_dispatcher(caplog):
    """The CPU interpreter's explicit library is for callers of ops: a forced dispatcher call inside
    its block still falls back (nothing is launched on it), and leaves no verdict behind."""

    class LaunchRefused:
        device_type = "cpu"

        def launcher(self, *args):
            raise AssertionError("the dispatcher launched on an explicit library")

        launch = launcher

    settings.force = True
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(q, k, v)
    with caplog.at_level(logging.INFO, logger="rdna_flash_attn"), runtime.explicit_library(LaunchRefused()):
        inside = rfa.scaled_dot_product_attention(q, k, v)
    after = rfa.scaled_dot_product_attention(q, k, v)
    assert torch.equal(inside, expected) and torch.equal(after, expected)
    assert rfa.stats()["kernel"] == 0 and rfa.stats()["fallback"] == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not any("failed" in reason for reason in rfa.stats()["fallback_reasons"])


# --- masks and grouped key/value heads on the kernels ----------------------------------------------


@pytest.mark.parametrize("mask_shape, dtype", [
    ((40, 40), torch.bool), ((2, 1, 1, 40), torch.float16), ((1, 40), torch.float32), ((2, 3, 40, 40), torch.bool)])
def test_masks_run_on_the_kernels_with_sdpas_result(fake_gpu, mask_shape, dtype):
    q, k, v = qkv()
    generator = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        mask = torch.rand(mask_shape, generator=generator) < 0.7
    else:
        mask = torch.zeros(mask_shape, dtype=dtype).masked_fill(torch.rand(mask_shape, generator=generator) < 0.3,
                                                                float("-inf"))
    with torch.no_grad():
        out = rfa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  attn_mask=mask if dtype == torch.bool else mask.float())
    assert rfa.stats() == {"kernel": 1, "kernel_8bit": 0, "fallback": 0, "fallback_reasons": {},
                           "exact_not_8bit_reasons": {}}
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=0)
    assert "mask" in rfa.explain(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kwargs, word", [
    ({"attn_mask": torch.zeros(40, 40, dtype=torch.bfloat16)}, "attn_mask dtype"),
    ({"attn_mask": torch.zeros(3, 40)}, "broadcast"),
    ({"attn_mask": torch.ones(40, 40, dtype=torch.bool), "is_causal": True}, "is_causal")])
def test_masks_sdpa_refuses_get_sdpas_own_error(fake_gpu, kwargs, word):
    q, k, v = qkv()
    expected = outcome_type(F.scaled_dot_product_attention, q, k, v, **kwargs)
    assert outcome_type(rfa.scaled_dot_product_attention, q, k, v, **kwargs) is expected
    assert word in only_reason()


def outcome_type(fn, *args, **kwargs):
    try:
        return type(fn(*args, **kwargs))
    except Exception as exc:
        return type(exc)


def test_mask_that_needs_a_gradient_falls_back(fake_gpu):
    q, k, v = qkv()
    bias = torch.zeros(40, 40, dtype=torch.float16, requires_grad=True)
    rfa.scaled_dot_product_attention(q, k, v, attn_mask=bias).float().sum().backward()
    assert "requires grad" in only_reason() and bias.grad is not None


def test_masks_past_2_31_elements_are_taken_while_a_waves_rows_fit():
    """The forward and dQ kernels count a mask's offsets from a wave's first query (MaskView::rows_from):
    a (B, 1, 50k, 50k) mask passes 2^31 elements and the forward takes it; rows 2^31 elements apart
    within 16 queries it does not. The dK/dV kernels count from their launch's first query, so the
    backward launches them per slice of 42,944 queries there (a multiple of 64), but not for a causal
    call, whose diagonal a slice would move. Meta tensors: only shapes and strides matter here."""
    target, meta = (1, 2, 50_000, 50_000), torch.device("meta")
    large = torch.empty(1, 1, 50_000, 50_000, dtype=torch.bool, device=meta)
    assert plans.mask_view(large, target, 64, torch.float16, meta).shape == target
    view = plans.mask_view(large, target, 64, torch.float16, meta, backward=True)
    assert view.shape == target and plans.mask_rows_per_launch(view, 50_000) == 42_944
    assert plans.mask_rows_per_launch(view[:, :, :42_000], 42_000) == 42_000
    q = torch.empty(1, 2, 50_000, 64, dtype=torch.float16, device=meta)

    class MetaLibrary:  # plans only: nothing is launched
        device_type = "meta"

    with runtime.explicit_library(MetaLibrary()):
        assert isinstance(plans.plan_forward(q, q, q, attn_mask=large, backward=True), plans.ForwardPlan)
        assert plans.plan_forward(q, q, q, True, attn_mask=large, backward=True) == plans.Refusal(
            "causal with an attn_mask whose rows span 2^31 elements (the backward's dK/dV launches split only "
            "non-causal calls)")
    sparse_rows = torch.empty(50_000, 2**26, dtype=torch.bool, device=meta)[:, :50_000]  # row stride 2^26
    assert plans.mask_view(sparse_rows, target, 64, torch.float16, meta).shape == target
    assert plans.mask_view(sparse_rows, target, 64, torch.float16, meta, backward=True) == plans.Refusal(
        "attn_mask's rows span 2^31 elements within 64 queries (the backward's dK/dV launches take fewer)")
    wide = torch.empty(50_000, 2**28, dtype=torch.bool, device=meta)[:, :50_000]  # row stride 2^28
    assert plans.mask_view(wide, target, 64, torch.float16, meta) == plans.Refusal(
        "attn_mask's rows span 2^31 elements within 16 queries")


def test_grouped_heads_run_on_the_kernels_only_with_enable_gqa(fake_gpu):
    q, (k, v) = qkv(heads=4)[0], qkv(heads=2)[1:]
    with torch.no_grad():
        out = rfa.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=0)
    assert fake_gpu.launches[0][1].shape[1] == 2  # key/value heads as given: not repeated in memory
    with pytest.raises(RuntimeError):
        rfa.scaled_dot_product_attention(q, k, v)  # SDPA's own error without enable_gqa
    assert "enable_gqa" in rfa.stats()["fallback_reasons"].popitem()[0]
