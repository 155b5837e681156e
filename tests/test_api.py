"""The public API against torch's SDPA: same results, same exception types, the patch, flash_attn_func."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa

TORCH_SDPA = F.scaled_dot_product_attention


def test_public_names():
    for name in ("scaled_dot_product_attention", "flash_attn_func", "patch_sdpa", "enable_sdpa_patch",
                 "disable_sdpa_patch", "explain", "settings", "stats", "reset_stats"):
        assert callable(getattr(rfa, name)) or name == "settings"
    assert rfa.__version__ == "0.1.0"


def test_import_without_torch_imports_no_torch_until_the_api_is_used():
    # `python -m rdna_flash_attn --help` imports the package: it must not pay for torch (seconds).
    code = (
        "import sys, rdna_flash_attn as rfa\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert rfa.settings is not None and rfa.__version__\n"
        "assert 'torch' not in sys.modules\n"
        "sdpa = rfa.scaled_dot_product_attention\n"
        "assert 'rdna_flash_attn.integrations.flash_attn_interface' in sys.modules  # every name at once\n"
        "assert rfa.dispatch is sys.modules['rdna_flash_attn.dispatch']\n"
        "import torch\n"
        "q = torch.randn(1, 1, 4, 8)\n"
        "assert torch.allclose(sdpa(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_after_torch_loads_the_api_at_once():
    # Every host imports torch first: a broken install must fail at its `import rdna_flash_attn`.
    code = ("import sys, torch, rdna_flash_attn\n"
            "assert 'scaled_dot_product_attention' in vars(rdna_flash_attn)\n"
            "assert 'rdna_flash_attn.dispatch.sdpa_patch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_lazy_api_table_matches_its_type_checking_imports():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(rfa))
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    spelled = {alias.name: node.module for node in block.body for alias in node.names}
    assert spelled == rfa._API
    assert set(rfa._API) <= set(rfa.__all__) and set(rfa.__all__) <= set(rfa._API) | {"Settings", "settings",
                                                                                       "__version__"}
    with pytest.raises(AttributeError):
        rfa.no_such_name


def test_import_is_cheap_and_touches_no_gpu():
    code = (
        "import sys, torch, rdna_flash_attn\n"
        "assert not torch.cuda.is_initialized()\n"
        "heavy = {'matplotlib', 'rdna_flash_attn.tools.benchmark', 'rdna_flash_attn.tools.cli'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- argument handling against torch on random inputs ------------------------------------------------


def random_call(rng: random.Random):
    """Random SDPA arguments, valid or not: ranks 2-5, broadcast batches, masks, GQA, odd dims."""
    rank = rng.choice([2, 3, 4, 4, 4, 4, 4, 4, 5])
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32])
    heads, kv_heads = rng.choice([(2, 2), (4, 2), (3, 2), (1, 1)])
    q_len, k_len = rng.choice([1, 7, 40]), rng.choice([1, 9, 40])
    dim, v_dim = rng.choice([(64, 64), (40, 40), (12, 12), (64, 32), (8, 8)])
    batch = [rng.choice([1, 2])] * (rank - 3)
    lead_q = batch + ([heads] if rank >= 3 else [])
    lead_kv = [rng.choice([1, *batch[:1]]) for _ in batch] + ([kv_heads] if rank >= 3 else [])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(*lead_q, q_len, dim, generator=gen).to(dtype)
    k = torch.randn(*lead_kv, k_len, dim, generator=gen).to(dtype)
    v = torch.randn(*lead_kv, k_len, v_dim, generator=gen).to(dtype)
    kwargs = {}
    if rng.random() < 0.15:
        kwargs["attn_mask"] = (
            torch.rand(q_len, k_len, generator=gen) > 0.3
            if rng.random() < 0.5
            else torch.randn(q_len, k_len, generator=gen).to(dtype)
        )
    if rng.random() < 0.4:
        kwargs["is_causal"] = True
    if rng.random() < 0.3:
        kwargs["scale"] = rng.choice([0.1, 1, 0.0, -0.5])
    if rng.random() < 0.3:
        kwargs["enable_gqa"] = True
    return (q, k, v), kwargs


def outcome(fn, args, kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # the type is what must match
        return type(exc)


def assert_same_outcome(ours, theirs, exact: bool):
    if isinstance(theirs, type):
        assert ours is theirs
        return
    assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if exact:
        assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    else:
        torch.testing.assert_close(ours.float(), theirs.float(), atol=3e-2, rtol=0, equal_nan=True)


@pytest.mark.parametrize("seed", range(150))
def test_random_calls_match_torch_without_kernels(seed):
    args, kwargs = random_call(random.Random(seed))
    ours = outcome(rfa.scaled_dot_product_attention, args, kwargs)
    assert_same_outcome(ours, outcome(TORCH_SDPA, args, kwargs), exact=True)


@pytest.mark.parametrize("seed", range(150))
def test_random_calls_match_torch_through_the_kernels(fake_gpu, seed):
    args, kwargs = random_call(random.Random(seed))
    theirs = outcome(TORCH_SDPA, args, kwargs)
    ours = outcome(rfa.scaled_dot_product_attention, args, kwargs)
    assert_same_outcome(ours, theirs, exact=not fake_gpu.launches)
    if isinstance(theirs, type):
        assert not fake_gpu.launches


def test_random_calls_reach_the_kernels_often_enough(fake_gpu):
    for seed in range(150):
        args, kwargs = random_call(random.Random(seed))
        outcome(rfa.scaled_dot_product_attention, args, kwargs)
    assert rfa.stats()["kernel"] >= 15  # 19 with these seeds


q4 = lambda *shape, dtype=torch.float16: torch.randn(*(shape or (2, 2, 8, 64)), dtype=dtype)  # noqa: E731

BAD_CALLS = {
    "1-D": lambda: ((q4(64), q4(64), q4(64)), {}),
    "key head dim differs": lambda: ((q4(), q4(2, 2, 8, 32), q4()), {}),
    "dtypes differ": lambda: ((q4(), q4(dtype=torch.float32), q4()), {}),
    "devices differ": lambda: ((q4(), torch.randn(2, 2, 8, 64, dtype=torch.float16, device="meta"), q4()), {}),
    "heads differ": lambda: ((q4(2, 4, 8, 64), q4(), q4()), {}),
    "heads not divisible with gqa": lambda: ((q4(2, 3, 8, 64), q4(), q4()), {"enable_gqa": True}),
    "batches differ": lambda: ((q4(3, 2, 8, 64), q4(), q4()), {}),
    "integer mask": lambda: ((q4(), q4(), q4()), {"attn_mask": torch.ones(8, 8, dtype=torch.int64)}),
    "mask shape": lambda: ((q4(), q4(), q4()), {"attn_mask": torch.ones(3, 8, dtype=torch.bool)}),
    "dropout above 1": lambda: ((q4(), q4(), q4()), {"dropout_p": 1.5}),
    "is_causal not a bool": lambda: ((q4(), q4(), q4()), {"is_causal": 1}),
    "enable_gqa not a bool": lambda: ((q4(), q4(), q4()), {"enable_gqa": 1}),
    "scale a string": lambda: ((q4(), q4(), q4()), {"scale": "0.5"}),
    "query None": lambda: ((None, q4(), q4()), {}),
    "query a list": lambda: (([[1.0]], q4(), q4()), {}),
    "unknown keyword": lambda: ((q4(), q4(), q4()), {"sliding_window": 4}),
    "scale positional": lambda: ((q4(), q4(), q4(), None, 0.0, False, 0.5), {}),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_raise_the_same_exception_type_and_never_launch(fake_gpu, name):
    args, kwargs = BAD_CALLS[name]()
    theirs = outcome(TORCH_SDPA, args, kwargs)
    assert isinstance(theirs, type), "torch accepts this call: not a bad call"
    assert outcome(rfa.scaled_dot_product_attention, args, kwargs) is theirs
    explained = outcome(rfa.explain, args, kwargs)  # a reason, or the same error for a bad signature
    assert isinstance(explained, str) or explained is theirs
    assert not fake_gpu.launches


# --- bad input that SDPA answers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 2, 0, 64), (2, 2, 8, 64)),
        ((2, 2, 8, 64), (2, 2, 0, 64)),
        ((0, 2, 8, 64), (0, 2, 8, 64)),
        ((2, 2, 8, 0), (2, 2, 8, 0)),
    ],
)
def test_empty_tensors_give_sdpas_result(fake_gpu, shapes):
    q = torch.randn(shapes[0], dtype=torch.float16)
    k = torch.randn(shapes[1], dtype=torch.float16)
    assert_same_outcome(rfa.scaled_dot_product_attention(q, k, k), TORCH_SDPA(q, k, k), exact=True)
    assert not fake_gpu.launches


def nan_inf_inputs(bad):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16, generator=gen) for _ in range(3))
    q[0, 0, 3, 5] = bad  # head 0: only query row 3 is touched
    k[0, 1, 7, 0] = bad  # head 1: every row sees it
    v[0, 1, 2, 9] = bad
    return q, k, v


def test_nan_inputs_give_sdpas_nan_pattern(fake_gpu):
    q, k, v = nan_inf_inputs(float("nan"))
    ours, theirs = rfa.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v)
    assert len(fake_gpu.launches) == 1  # no scan of the data: NaN goes to the kernels as to SDPA
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~theirs.isnan()
    torch.testing.assert_close(ours[finite].float(), theirs[finite].float(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_inf_inputs_run_and_leave_untouched_rows_exact(fake_gpu, bad):
    # What an infinite score gives differs between SDPA's own backends; the rows it does not touch must not.
    q, k, v = nan_inf_inputs(bad)
    ours, theirs = rfa.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v)
    assert len(fake_gpu.launches) == 1 and ours.shape == theirs.shape and ours.dtype == theirs.dtype
    untouched = [row for row in range(16) if row != 3]
    torch.testing.assert_close(ours[0, 0, untouched], theirs[0, 0, untouched], atol=2e-3, rtol=0)


def test_non_contiguous_head_dim_falls_back(fake_gpu):
    q, k, v = (torch.randn(2, 2, 8, 64, 2, dtype=torch.float16)[..., 0] for _ in range(3))
    assert torch.equal(rfa.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v))
    assert not fake_gpu.launches


def test_transposed_views_with_contiguous_head_dim_run_on_the_kernels(fake_gpu):
    q, k, v = (torch.randn(2, 40, 3, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    out = rfa.scaled_dot_product_attention(q, k, v)
    assert rfa.stats()["kernel"] == 1
    torch.testing.assert_close(out, TORCH_SDPA(q, k, v), atol=2e-3, rtol=0)


# --- patch_sdpa ---------------------------------------------------------------------------------------


def test_patch_sdpa_routes_torch_sdpa_and_restores_the_exact_object(fake_gpu):
    original = F.scaled_dot_product_attention
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    with rfa.patch_sdpa():
        assert F.scaled_dot_product_attention is rfa.scaled_dot_product_attention
        assert rfa.sdpa_patch_enabled()
        F.scaled_dot_product_attention(q, k, v)
    assert F.scaled_dot_product_attention is original and not rfa.sdpa_patch_enabled()
    assert rfa.stats()["kernel"] == 1


def test_enable_and_disable_are_idempotent():
    original = F.scaled_dot_product_attention
    rfa.enable_sdpa_patch()
    rfa.enable_sdpa_patch()
    assert F.scaled_dot_product_attention is rfa.scaled_dot_product_attention
    rfa.disable_sdpa_patch()
    assert F.scaled_dot_product_attention is original
    rfa.disable_sdpa_patch()
    assert F.scaled_dot_product_attention is original


def test_context_keeps_an_outer_enable_and_restores_after_errors():
    original = F.scaled_dot_product_attention
    rfa.enable_sdpa_patch()
    with rfa.patch_sdpa():
        with rfa.patch_sdpa():
            pass
    assert F.scaled_dot_product_attention is rfa.scaled_dot_product_attention
    rfa.disable_sdpa_patch()
    with pytest.raises(ValueError):
        with rfa.patch_sdpa():
            raise ValueError("host error")
    assert F.scaled_dot_product_attention is original


def test_scopes_closing_out_of_order_keep_the_patch_until_the_last_closes():
    """Two threads' diffusers layers: scopes opened A, B and closed A, B."""
    original = F.scaled_dot_product_attention
    first, second = contextlib.ExitStack(), contextlib.ExitStack()
    first.enter_context(rfa.patch_sdpa())
    second.enter_context(rfa.patch_sdpa())
    first.close()
    assert rfa.sdpa_patch_enabled()
    second.close()
    assert F.scaled_dot_product_attention is original


def test_patched_fallback_calls_torch_not_itself():
    q = torch.randn(1, 2, 8, 64)  # CPU float32: falls back
    with rfa.patch_sdpa():
        out = F.scaled_dot_product_attention(q, q, q)
    assert torch.equal(out, TORCH_SDPA(q, q, q))


def test_patched_fallback_goes_to_the_sdpa_it_replaced(fake_gpu):
    """A host's own SDPA wrapper (SD.Next's sliced attention) keeps serving the calls the kernels do
    not take; supported calls still reach the kernels; disabling restores torch's SDPA as fallback."""
    wrapper_calls = []

    def hosts_sdpa(*args, **kwargs):
        wrapper_calls.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return TORCH_SDPA(*args, **kwargs)

    F.scaled_dot_product_attention = hosts_sdpa
    try:
        q, k, v = (torch.randn(1, 2, 8, 256, dtype=torch.float16) for _ in range(3))
        mask = torch.ones(8, 8, dtype=torch.bool)  # no masked kernel at head dim 256
        with rfa.patch_sdpa():
            masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            F.scaled_dot_product_attention(q, k, v)
        assert len(wrapper_calls) == 1 and wrapper_calls[0] is mask
        torch.testing.assert_close(masked, TORCH_SDPA(q, k, v, attn_mask=mask))
        assert rfa.stats()["kernel"] == 1 and F.scaled_dot_product_attention is hosts_sdpa
        rfa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert len(wrapper_calls) == 1  # unpatched: the dispatcher's fallback is torch's own again
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA


def test_enabling_again_after_a_host_put_its_sdpa_back_wraps_the_new_one(fake_gpu):
    # SD.Next puts its own SDPA back at every model load; enabling again routes through us on top of it.
    rfa.enable_sdpa_patch()
    calls = []

    def hosts_new_sdpa(*args, **kwargs):
        calls.append(1)
        return TORCH_SDPA(*args, **kwargs)

    F.scaled_dot_product_attention = hosts_new_sdpa
    try:
        assert not rfa.sdpa_patch_enabled()  # the status says what is installed
        rfa.enable_sdpa_patch()
        assert rfa.sdpa_patch_enabled()
        q = torch.randn(1, 2, 8, 64)
        F.scaled_dot_product_attention(q, q, q)  # float32, refused: the host's function runs it
        assert calls == [1]
        rfa.disable_sdpa_patch()
        assert F.scaled_dot_product_attention is hosts_new_sdpa
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA


def test_a_host_wrapper_around_our_patch_does_not_loop(fake_gpu):
    # Our override installed first, then a host wrapped it (functools.wraps) and we enable again:
    # falling back to that wrapper would call us again, so refused calls go to torch's SDPA.
    rfa.enable_sdpa_patch()
    below = F.scaled_dot_product_attention

    @functools.wraps(below)
    def hosts_wrapper(*args, **kwargs):
        return below(*args, **kwargs)

    F.scaled_dot_product_attention = hosts_wrapper
    try:
        rfa.enable_sdpa_patch()
        q = torch.randn(1, 2, 8, 64)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)  # float32, refused: must not recurse
        torch.testing.assert_close(out, TORCH_SDPA(q, q, q, is_causal=True))
    finally:
        rfa.disable_sdpa_patch()
        F.scaled_dot_product_attention = TORCH_SDPA


def test_disable_leaves_a_later_replacement_alone(log_records):
    rfa.enable_sdpa_patch()
    def someone_elses(*args, **kwargs):
        return rfa.scaled_dot_product_attention(*args, **kwargs)
    F.scaled_dot_product_attention = someone_elses
    try:
        rfa.disable_sdpa_patch()
        assert F.scaled_dot_product_attention is someone_elses
        assert any(r.levelno == logging.WARNING for r in log_records.records)
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA
