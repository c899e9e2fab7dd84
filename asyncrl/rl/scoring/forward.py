"""The forward that scores a micro-batch, whatever its layout: ``[R, L, V]`` logits
(`policy_logits`) or the final hidden states the output layer reads (`policy_hidden`), each
sequence attending only to its own tokens.

Padded rows (one sequence a row) go in with their attention mask. Packed rows (``trainer/packing.py``:
``position_ids`` restarting at 0 at every sequence, the row's trailing padding one more "sequence"
of its own) keep attention within a sequence by one of two means, chosen by the model's attention
implementation:

- ``sdpa`` / ``eager``: an explicit 4-D block-diagonal causal mask ``[R, 1, L, L]`` (boolean for
  sdpa, additive for eager: the conventions transformers 5 passes through unchanged when a mask is
  already 4-D, ``masking_utils._preprocess_mask_arguments``);
- any other (``flash_attention_2``/``3``, flex, hub kernels): the rows flattened into one row and
  the position ids alone; transformers derives the sequences' boundaries from them (flash's varlen
  path, ``modeling_flash_attention_utils._is_packed_sequence``, takes one row only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from asyncrl.rl.scoring.batch import MicroBatch

T = TypeVar("T")

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations given an explicit 4-D mask; every other gets flattened position ids."""

ROUTED_FORWARD = "_asyncrl_routed_forward"
"""The attribute a sharded root carries when its forward runs a given function inside FSDP2's root
hooks (set by ``trainer/fsdp.py``, read by `in_root_forward`)."""


def in_root_forward(model: torch.nn.Module, fn: Callable[[], T]) -> T:
    """``fn()``, inside the sharded root's forward when ``model`` is sharded (``trainer/fsdp.py``):
    a computation that reads the head's weight itself would see shards outside it."""
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return root(asyncrl_call=fn) if getattr(root, ROUTED_FORWARD, False) else fn()


def policy_logits(model, batch: MicroBatch) -> torch.Tensor:
    """``[R, L, V]`` logits of ``model`` on ``batch``, each sequence seeing only its own tokens (and
    no KV cache built: a training forward never decodes)."""
    inputs, flat = layout_inputs(model, batch)
    return _unflatten(model(**inputs).logits, batch, flat)


def policy_hidden(model, batch: MicroBatch) -> torch.Tensor:
    """``[R, L, H]`` final hidden states (after the final norm: what the output layer reads) of
    ``model``'s decoder on ``batch``: `policy_logits`' forward without the output layer, the same
    inputs in the same layout. ``model.get_decoder()`` reaches through a peft wrapper."""
    inputs, flat = layout_inputs(model, batch)
    return _unflatten(model.get_decoder()(**inputs).last_hidden_state, batch, flat)


def layout_inputs(model, batch: MicroBatch) -> tuple[dict, bool]:
    """The forward's keyword arguments for ``batch``'s layout (padded, packed under a 4-D mask, or
    packed flat; see the module docstring), and whether the output is one flat row to split back
    into ``batch``'s rows. Written once for every forward that scores a batch."""
    if batch.position_ids is None:
        return dict(input_ids=batch.input_ids, attention_mask=batch.attention, use_cache=False), False
    if model.config._attn_implementation in MASKED_IMPLEMENTATIONS:
        return masked_inputs(model, batch), False
    return flat_inputs(batch), True


def masked_inputs(model, batch: MicroBatch) -> dict:
    """Packed rows through an explicit 4-D block-diagonal causal mask (sdpa, eager)."""
    blocks = block_causal_mask(batch.position_ids)
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        blocks = torch.zeros(blocks.shape, device=blocks.device).masked_fill(~blocks, torch.finfo(torch.float32).min)
    return dict(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=blocks, use_cache=False)


def flat_inputs(batch: MicroBatch) -> dict:
    """Packed rows as one row with position ids and no mask: transformers finds the sequences from
    the restarts (flash attention's varlen path on GPU; a mask it builds itself for sdpa/eager)."""
    # use_cache=False: with a KV cache transformers skips looking for packed sequences
    return dict(
        input_ids=batch.input_ids.reshape(1, -1), position_ids=batch.position_ids.reshape(1, -1), use_cache=False
    )


def masked_logits(model, batch: MicroBatch) -> torch.Tensor:
    """`policy_logits` of packed rows under the 4-D mask, whatever the attention implementation."""
    return model(**masked_inputs(model, batch)).logits


def flat_logits(model, batch: MicroBatch) -> torch.Tensor:
    """`policy_logits` of packed rows flattened, whatever the attention implementation."""
    return _unflatten(model(**flat_inputs(batch)).logits, batch, True)


def _unflatten(out: torch.Tensor, batch: MicroBatch, flat: bool) -> torch.Tensor:
    return out.view(*batch.input_ids.shape, -1) if flat else out


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]`` boolean, True where query ``q`` may attend key ``k``: same sequence (a new
    one starts wherever the position id is 0) and ``k <= q``."""
    segment = (position_ids == 0).cumsum(-1)
    same = segment.unsqueeze(-1) == segment.unsqueeze(-2)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)
