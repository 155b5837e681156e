"""The routing functions shared by the WebUIs whose attention functions have ComfyUI's form (Forge,
reForge, Forge Classic), and the rebinding that puts them in place of the host's functions in every
module that holds one."""

from __future__ import annotations

import importlib
import logging
import sys

import torch

import rdna_flash_attn
from rdna_flash_attn.config import LOGGER_NAME

from . import guard
from .options import toggles

log = logging.getLogger(LOGGER_NAME)

KNOWN_PARAMETERS = ("mask", "attn_precision", "skip_reshape", "skip_output_reshape")  # after (q, k, v, heads)


def routed_attention_function(original, fallback_name: str = "Forge's attention_function"):
    """A ComfyUI-style attention function, as Forge's `attention_function`, reForge's and Forge Classic's
    `optimized_attention` have it: `(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
    skip_output_reshape=False)` (Forge's stops before skip_output_reshape, Forge Classic's, and SD3's own
    `attention` in A1111 and Forge, after mask), q, k, v (B, N, H*D), or (B, H, N, D) with skip_reshape;
    returns (B, N, H*D), or (B, H, N, D) with skip_output_reshape (reForge's Cosmos). The kernels
    accumulate in float32, which is what an `attn_precision` of float32 asks for. Float masks go to the
    kernels where every backend of the host reads them alike (`_mask_read_alike`), 3-D ones where
    `original` reads them as (batch, queries, keys) (`_reads_3d_masks_batch_first`, tried at the first
    such call). A call the kernels do not take goes to `original` with its own arguments; one of a form
    not known here is logged once (`_log_unknown_form_once`)."""
    batch_first = None  # whether `original` reads 3-D masks batch first: unknown until one comes

    def mask_taken(mask) -> bool:
        nonlocal batch_first
        if _mask_read_alike(mask):
            return True
        if not (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dim() == 3):
            return False
        if batch_first is None:
            batch_first = _reads_3d_masks_batch_first(original)
        return batch_first

    def on_kernels(q, k, v, heads, mask, skip_reshape, skip_output_reshape):
        if skip_reshape:
            q4, k4, v4 = q, k, v
        else:
            q4, k4, v4 = (_heads_first(t, heads) for t in (q, k, v))
        if mask is not None and mask.dim() == 3:  # (batch, queries, keys): mask_taken
            mask = mask[:, None]
        out = rdna_flash_attn.attention_or_reason(q4, k4, v4, attn_mask=mask, fallback_name=fallback_name)
        if not isinstance(out, torch.Tensor):
            return None
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)

    def attention_function(q, k, v, heads, *args, **kwargs):
        named = dict(zip(KNOWN_PARAMETERS, args), **kwargs)
        skip_reshape, mask = named.get("skip_reshape", False), named.get("mask")
        unknown = sorted(set(named) - set(KNOWN_PARAMETERS))
        if unknown or len(args) > len(KNOWN_PARAMETERS):
            _log_unknown_form_once(unknown, len(args), fallback_name)
        elif toggles.unet and _routable(q, k, v, heads, skip_reshape) and mask_taken(mask):
            try:
                out = on_kernels(q, k, v, heads, mask, skip_reshape, named.get("skip_output_reshape", False))
            except Exception as error:
                guard.report_failure("attention_function", error)
                out = None
            if out is not None:
                return out
        return original(q, k, v, heads, *args, **kwargs)

    attention_function.rdna_original = original
    return attention_function


_unknown_forms_logged: set[str] = set()


def _log_unknown_form_once(unknown: list[str], positional: int, fallback_name: str) -> None:
    """One INFO line per distinct call form the routing does not know (a keyword or a positional
    argument past skip_output_reshape): such calls run on the host's function, unseen by stats()."""
    form = f"keyword {', '.join(unknown)}" if unknown else f"{positional} arguments after heads"
    if form not in _unknown_forms_logged:
        _unknown_forms_logged.add(form)
        log.info("not using the kernels: attention call with %s, unknown to the extension (%s runs these calls)",
                 form, fallback_name)


def _mask_read_alike(mask) -> bool:
    """No mask, or one every attention backend of these hosts applies as SDPA does: an additive float
    mask of 2 (queries, keys) or 4 (batch, heads, queries, keys) dimensions. Bool masks are key padding
    to some of their backends, and 3-D masks are read batch first by some and heads first by others
    (`_reads_3d_masks_batch_first` asks the host's function)."""
    return mask is None or (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dim() in (2, 4))


PROBE_HEADS, PROBE_HEAD_DIM, PROBE_TOKENS = 2, 4, 3


def _reads_3d_masks_batch_first(function) -> bool:
    """Whether the host's attention function reads a 3-D float mask as (batch, queries, keys), as all of
    today's reForge backends do (and ComfyUI's), tried on a tiny CPU input. Forge's and Forge Classic's
    PyTorch backends, and older reForge's, hand it to SDPA as it is, (heads, queries, keys), while their
    split backends read it batch first: which one a user runs is the host's choice, so the function
    itself is asked. Any failure (a backend that cannot run on the CPU) counts as no: such masks then
    stay with the host."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, PROBE_TOKENS, PROBE_HEADS * PROBE_HEAD_DIM, generator=generator) for _ in range(3))
    mask = torch.randn(2, PROBE_TOKENS, PROBE_TOKENS, generator=generator)  # batch 2 = heads 2: either reading runs
    try:
        out = function(q, k, v, PROBE_HEADS, mask=mask)
    except Exception:
        return False
    q4, k4, v4 = (t.unflatten(-1, (PROBE_HEADS, PROBE_HEAD_DIM)).transpose(1, 2) for t in (q, k, v))
    weights = (q4 @ k4.transpose(-2, -1) * PROBE_HEAD_DIM**-0.5 + mask[:, None]).softmax(-1)
    expected = (weights @ v4).transpose(1, 2).flatten(2)
    return (isinstance(out, torch.Tensor) and out.shape == expected.shape
            and torch.allclose(out.float(), expected, atol=1e-4, rtol=1e-3))


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, H*D), or (B, L, H, D) as SD3's MMDiT passes v, -> a (B, H, L, D) view."""
    return t.transpose(1, 2) if t.dim() == 4 else t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _routable(q, k, v, heads, skip_reshape) -> bool:
    """Shapes the reshapes here handle; anything else goes to the host's function unchanged, which
    then raises its own error for malformed input."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if skip_reshape:
        return all(t.dim() == 4 for t in tensors)
    if not isinstance(heads, int) or heads <= 0 or q.dim() != 3 or q.shape[-1] % heads:
        return False
    head_dim = q.shape[-1] // heads
    return all((t.dim() == 3 and t.shape[-1] % head_dim == 0) or (t.dim() == 4 and t.shape[-1] == head_dim)
               for t in (k, v))


def routed_single_head_spatial(original, fallback_name: str = "Forge's VAE attention"):
    """Forge's `attention_function_single_head_spatial(q, k, v)` (and the VAE attention of reForge and
    Forge Classic): (B, C, H, W) each, one head of C channels (the VAE's mid-block); returns (B, C, H, W)."""

    def on_kernels(q, k, v):
        b, c, h, w = q.shape
        q4, k4, v4 = (t.reshape(b, 1, c, h * w).transpose(2, 3).contiguous() for t in (q, k, v))
        out = rdna_flash_attn.attention_or_reason(q4, k4, v4, fallback_name=fallback_name)
        return out.transpose(2, 3).reshape(b, c, h, w) if isinstance(out, torch.Tensor) else None

    def attention_function_single_head_spatial(q, k, v):
        if toggles.vae:
            try:
                out = on_kernels(q, k, v)
            except Exception as error:
                guard.report_failure("attention_function_single_head_spatial", error)
                out = None
            if out is not None:
                return out
        return original(q, k, v)

    attention_function_single_head_spatial.rdna_original = original
    return attention_function_single_head_spatial


def _global(module, name: str):
    try:
        return vars(module).get(name)
    except Exception:  # sys.modules may hold odd objects (lazy loaders, None)
        return None


class Rebinding:
    """Module globals that hold a routing function instead of the host's attention function, so they
    can be put back. `routes` maps each function name of the host's attention module to the maker of
    its routing function; `rebind_home`: the attention module's own global too (where the host's
    code looks the name up there at call time; modules imported later then take the routing function
    from it, and restore() puts theirs back as well)."""

    def __init__(self, home: str, routes: dict, rebind_home: bool = False):
        self.home, self.routes, self.rebind_home = home, routes, rebind_home
        self.bound: list[tuple[object, str, object, object]] = []  # (module, name, original, ours)
        self._routes: dict[str, object] = {}  # name -> our routing function for the host's current one

    def apply(self) -> None:
        """Rebind every loaded module holding the host's function. Safe to repeat: modules already
        rebound no longer hold it."""
        attention = importlib.import_module(self.home)
        for name, make in self.routes.items():
            original = getattr(attention, name)
            original = getattr(original, "rdna_original", original)  # the home module rebound before
            ours = self._routes.get(name)
            if ours is None or ours.rdna_original is not original:
                ours = self._routes[name] = make(original)
            for module in list(sys.modules.values()):
                if (module is attention and not self.rebind_home) or _global(module, name) is not original:
                    continue
                setattr(module, name, ours)
                self.bound.append((module, name, original, ours))

    def restore(self) -> None:
        for module, name, original, ours in self.bound:
            if _global(module, name) is ours:  # leave a later patch by someone else in place
                setattr(module, name, original)
        self.bound.clear()
        if self.rebind_home:  # modules imported since took the routing function from the home module
            for name, ours in self._routes.items():
                for module in list(sys.modules.values()):
                    if _global(module, name) is ours:
                        setattr(module, name, ours.rdna_original)
