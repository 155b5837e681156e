"""flash-attn 2.8.3's `flash_attn.bert_padding`: between padded (batch, seqlen, ...) tensors and the
packed (total_tokens, ...) layout of the varlen functions. Plain indexing, so autograd differentiates
all of it. None of these takes cu_seqlens (the varlen functions check those, ops.check_cu_seqlens):
the one unpad_input returns is sound by construction, and torch's indexing bounds pad_input's indices."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def index_first_axis(input, indices):
    """input[indices] along the first axis: (len(indices), ...)."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero (first_axis_dim, ...) tensor with values at rows `indices`."""
    output = values.new_zeros(first_axis_dim, *values.shape[1:])
    output[indices] = values
    return output


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the tokens attention_mask (batch, seqlen; bool or int, nonzero = a token) selects, and
    those unused_mask selects (allocated but unused), from hidden_states (batch, seqlen, ...).

    Returns (hidden_states (total, ...), indices (total,) into the flattened (batch * seqlen) tokens,
    cu_seqlens int32 (batch + 1,), max_seqlen_in_batch as a Python int, used_seqlens_in_batch int32
    (batch,): the tokens attention_mask alone selects), as flash-attn >= 2.7 does."""
    selected = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqlens_in_batch = selected.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max()) if seqlens_in_batch.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: (total, ...) tokens back to (batch, seqlen, ...), zeros elsewhere."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *output.shape[1:])
