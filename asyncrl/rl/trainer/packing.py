"""Packed sequences: several ``prompt + completion`` sequences share one row of the trainer's
forward pass, so that short completions stop paying for the longest one's padding.

Layout (see `MicroBatch`): sequences are laid end to end in a row of at most ``pack_tokens``
tokens; ``position_ids`` restart at 0 at every sequence, and the row's trailing padding is one more
"sequence" of its own (so no token is left with nothing to attend to: an all-masked row of
attention is NaN in sdpa). Attention never crosses a boundary, by one of two means, chosen by the
model's attention implementation:

- ``sdpa`` / ``eager``: an explicit 4-D block-diagonal causal mask ``[R, 1, L, L]`` (boolean for
  sdpa, additive for eager: the conventions transformers 5 passes through unchanged when a mask is
  already 4-D, ``masking_utils._preprocess_mask_arguments``);
- any other (``flash_attention_2``/``3``, flex, hub kernels): the rows flattened into one row and
  the position ids alone; transformers derives the sequences' boundaries from them (flash's varlen
  path, ``modeling_flash_attention_utils._is_packed_sequence``, takes one row only).

The loss side does not change: each sequence keeps its own ``[C]`` row of scores, mask, behaviour
log-probs and advantage (`MicroBatch.scored` reads them at ``(row, offset + P - 1 + j)``), so the
token-mean and seq-mean normalisers count what they count in the padded layout.
"""

from __future__ import annotations

import torch

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.batching import (
    MicroBatch,
    Sequence,
    cut_by_budget,
    sequences,
    teacher_matrix,
    teacher_topk_tensors,
)

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention implementations given an explicit 4-D mask; every other gets flattened position ids."""


def packed_micro_batches(
    groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device, pack_tokens: int
) -> list[MicroBatch]:
    """`micro_batches` with several sequences per row: the batch's sequences packed into rows of at
    most ``pack_tokens`` tokens (first fit, longest first: a
    sequence longer than that gets a row of its own), then cut the rows into micro-batches of at
    most ``budget`` tokens (rows x longest row)."""
    rows: list[list[Sequence]] = []
    fill: list[int] = []
    for seq in sorted(sequences(groups, advantages), key=_length, reverse=True):
        n = _length(seq)
        for r, used in enumerate(fill):
            if used + n <= pack_tokens:
                rows[r].append(seq)
                fill[r] += n
                break
        else:
            rows.append([seq])
            fill.append(n)
    rows.sort(key=_row_length)
    return [_build(chunk, device) for chunk in cut_by_budget(rows, _row_length, budget)]


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


def _length(seq: Sequence) -> int:
    return len(seq[0]) + len(seq[1])


def _row_length(row: list[Sequence]) -> int:
    return sum(_length(s) for s in row)


def _build(rows: list[list[Sequence]], device: torch.device) -> MicroBatch:
    length = max(_row_length(r) for r in rows)
    seqs = [s for r in rows for s in r]
    width = max(max(len(s[1]) for s in seqs), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    behaviour = torch.zeros(len(seqs), width)
    row_of = torch.zeros(len(seqs), dtype=torch.long)
    s = 0
    for r, row in enumerate(rows):
        offset = 0
        for prompt, completion, lps, _, actions, *_teacher in row:
            n, p, c = len(prompt) + len(completion), len(prompt), len(completion)
            ids[r, offset : offset + n] = torch.tensor(prompt + completion)
            attention[r, offset : offset + n] = 1
            positions[r, offset : offset + n] = torch.arange(n)
            score_index[s, :c] = torch.arange(offset + p - 1, offset + p - 1 + c)
            mask[s, :c] = True if actions is None else torch.tensor(actions, dtype=torch.bool)
            behaviour[s, :c] = torch.tensor(lps)
            row_of[s] = r
            offset += n
            s += 1
        positions[r, offset:] = torch.arange(length - offset)  # the padding: a sequence of its own
    advantages = torch.tensor([seq[3] for seq in seqs])
    tensors = (ids, attention, score_index, mask, behaviour, advantages, row_of, positions)
    return MicroBatch(
        *(t.to(device) for t in tensors),
        teacher=teacher_matrix(seqs, width, device),
        **teacher_topk_tensors(seqs, width, device),
    )
