"""The forward that scores a micro-batch, whatever its layout: ``[R, L, V]`` logits
(`policy_logits`) or the final hidden states the output layer reads (`policy_hidden`), each
sequence attending only to its own tokens.

Padded rows (one sequence a row, its padding after it) go in without a mask under ``sdpa`` /
``eager`` and with their attention mask under any other implementation (below). Packed rows
(``trainer/packing.py``: ``position_ids`` restarting at 0 at every sequence, the row's trailing
padding one more "sequence" of its own) keep attention within a sequence by one of two means,
chosen by the model's attention implementation:

- ``sdpa`` / ``eager``: an explicit 4-D block-diagonal causal mask ``[R, 1, L, L]`` (boolean for
  sdpa, additive for eager: the conventions transformers 5 passes through unchanged when a mask is
  already 4-D, ``masking_utils._preprocess_mask_arguments``);
- any other (``flash_attention_2``/``3``, flex, hub kernels): the rows flattened into one row and
  the position ids alone; transformers derives the sequences' boundaries from them (flash's varlen
  path, ``modeling_flash_attention_utils._is_packed_sequence``, takes one row only).

Why padded rows need no mask under sdpa / eager: a row's padding lies after every token of its
sequence, so the causal mask alone keeps each token from it, exactly. sdpa then runs a causal
kernel, which skips the masked half of the scores; given an explicit mask it cannot (the
difference at long sequences: docs/trainer.md). A model whose decoder layers are compiled
(`MIN_ROWS`) gets no micro-batch of one row (`layout_inputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from asyncrl.rl.scoring.batch import MicroBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations given an explicit 4-D mask; every other gets flattened position ids."""

MIN_ROWS = "_asyncrl_min_rows"
"""The attribute a model whose decoder layers are compiled carries (set by ``trainer/compile.py``,
read by `layout_inputs`): the fewest rows its forward is given; a micro-batch with fewer gets
dummy rows, cut off its output."""

ROUTED_FORWARD = "_asyncrl_routed_forward"
"""The attribute a sharded root carries when its forward runs a given function inside FSDP2's root
hooks (set by ``trainer/fsdp.py``, read by `in_root_forward`)."""


def in_root_forward(model: PreTrainedModel, fn: Callable[[], T]) -> T:
    """``fn()``, inside the sharded root's forward when ``model`` is sharded (``trainer/fsdp.py``):
    a computation that reads the head's weight itself would see shards outside it."""
    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return root(asyncrl_call=fn) if getattr(root, ROUTED_FORWARD, False) else fn()


def policy_logits(model, batch: MicroBatch) -> torch.Tensor:
    """``[R, L, V]`` logits of ``model`` on ``batch``, each sequence seeing only its own tokens (and
    no KV cache built: a training forward never decodes)."""
    inputs, flat = layout_inputs(model, batch)
    return _unflatten(model(**inputs).logits, batch, flat)[: len(batch.input_ids)]


def policy_hidden(model, batch: MicroBatch) -> torch.Tensor:
    """``[R, L, H]`` final hidden states (after the final norm: what the output layer reads) of
    ``model``'s decoder on ``batch``: `policy_logits`' forward without the output layer, the same
    inputs in the same layout. ``model.get_decoder()`` reaches through a peft wrapper."""
    inputs, flat = layout_inputs(model, batch)
    return _unflatten(model.get_decoder()(**inputs).last_hidden_state, batch, flat)[: len(batch.input_ids)]


def layout_inputs(model, batch: MicroBatch) -> tuple[dict, bool]:
    """The forward's keyword arguments for ``batch``'s layout (padded, packed under a 4-D mask, or
    packed flat; see the module docstring), and whether the output is one flat row to split back
    into ``batch``'s rows (the output may hold more rows than ``batch``: cut it to them). Written
    once for every forward that scores a batch.

    What the decoder layers are called with stays alike from one micro-batch to the next, so that
    layers compiled for dynamic shapes (``trainer/compile.py``) compile once for each layout
    (padded: no mask; packed: a 4-D one), not again mid-run (each recompile cost seconds of a step
    on a GPU, and past dynamo's recompile limit a layer runs eagerly for good):

    - padded rows under sdpa / eager get no mask, whether or not they hold padding (given a 2-D
      mask, transformers turned it into a 4-D one only where a row had padding, and dynamo
      recompiled on the layers' mask turning None); other implementations keep the 2-D mask
      (flash attention's own path drops the padding's tokens);
    - a compiled model (`MIN_ROWS`) gets no micro-batch of one row: dynamo specialises a size of 1
      even for dynamic shapes and recompiled on the first one (``2 <= hidden_states.size()[0]``).
      The flat layout is always one row, never another number, so it needs neither."""
    masked = model.config._attn_implementation in MASKED_IMPLEMENTATIONS
    if batch.position_ids is not None and not masked:
        return flat_inputs(batch), True
    batch = _with_rows(batch, getattr(model, MIN_ROWS, 1))
    if batch.position_ids is not None:
        return masked_inputs(model, batch), False
    return dict(input_ids=batch.input_ids, attention_mask=None if masked else batch.attention, use_cache=False), False


def _with_rows(batch: MicroBatch, rows: int) -> MicroBatch:
    """``batch`` with dummy rows added up to ``rows`` rows: token 0 filling the row, attended
    (a row of padding alone would have queries attending nothing: NaN in sdpa) and, when packed,
    one sequence of its own. Only the forward's inputs: no sequence lies in them."""
    extra = rows - len(batch.input_ids)
    if extra <= 0:
        return batch
    length = batch.input_ids.shape[1]
    device = batch.input_ids.device
    pad = dict(
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(extra, length)]),
        attention=torch.cat([batch.attention, batch.attention.new_ones(extra, length)]),
    )
    if batch.position_ids is not None:
        positions = torch.arange(length, device=device).expand(extra, length)
        pad["position_ids"] = torch.cat([batch.position_ids, positions])
    return dataclasses.replace(batch, **pad)


def masked_inputs(model, batch: MicroBatch) -> dict:
    """Packed rows through an explicit 4-D block-diagonal causal mask (sdpa, eager)."""
    blocks = _for_implementation(model, block_causal_mask(_packed_positions(batch)))
    return dict(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=blocks, use_cache=False)


def _for_implementation(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean 4-D mask as ``model``'s attention takes it: as is for sdpa, additive for eager."""
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed


def flat_inputs(batch: MicroBatch) -> dict:
    """Packed rows as one row with position ids and no mask: transformers finds the sequences from
    the restarts (flash attention's varlen path on GPU; a mask it builds itself for sdpa/eager)."""
    # use_cache=False: with a KV cache transformers skips looking for packed sequences
    return dict(
        input_ids=batch.input_ids.reshape(1, -1), position_ids=_packed_positions(batch).reshape(1, -1), use_cache=False
    )


def _packed_positions(batch: MicroBatch) -> torch.Tensor:
    if batch.position_ids is None:
        raise ValueError("a packed micro-batch's inputs need its position_ids (packing.py makes them)")
    return batch.position_ids


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
