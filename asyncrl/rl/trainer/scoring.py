"""The trainer's log-probs of a micro-batch's scored tokens: ``[S, C]`` in `MicroBatch.scored`'s
layout, the input ``grpo_loss`` takes, by one of two paths.

- fused (the default): the decoder's final hidden states, gathered at the scored positions only
  (a prompt token never goes through the output layer), then the output layer and log-softmax a
  chunk at a time (``chunked_head.py``): no ``[tokens, vocab]`` logits exist.
- full logits (the fallback, `fused_head_fallback` says when): the whole model's ``[R, L, V]``
  logits, then ``token_logprobs`` and ``token_entropy`` over them.

Entries outside ``batch.mask`` (padding, environment tokens) are 0 in the fused path and the
full path's values in the other: ``grpo_loss`` reads neither.
"""

from __future__ import annotations

import contextlib

import torch

from asyncrl.rl.trainer.batching import MicroBatch
from asyncrl.rl.trainer.chunked_head import head_logprobs
from asyncrl.rl.trainer.fsdp import in_root_forward
from asyncrl.rl.trainer.loss import LossInputError, token_entropy, token_logprobs
from asyncrl.rl.trainer.packing import policy_hidden, policy_logits

NON_LINEAR_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Model config keys of logits that are not the output layer's plain output (Gemma's soft cap,
Cohere's and Granite's scales): such models take the full-logits path."""


def fused_head_fallback(model) -> str:
    """Why ``model`` must take the full-logits path ("" when the fused one applies; a sharded
    model takes it inside its root's forward, `fsdp.in_root_forward`):

    - a config with a soft cap or a scale on its logits (`NON_LINEAR_HEAD_KEYS`);
    - no ``get_decoder``/``get_output_embeddings``, a decoder that is the model itself, or a head
      that is not exactly ``nn.Linear`` (e.g. a LoRA-wrapped head: its weight is not its output).
    """
    config = getattr(model, "config", None)
    for key in NON_LINEAR_HEAD_KEYS:
        if getattr(config, key, None) is not None:
            return f"the model's config sets {key}: its logits are not a plain linear layer's"
    if not (callable(getattr(model, "get_decoder", None)) and callable(getattr(model, "get_output_embeddings", None))):
        return "the model has no get_decoder/get_output_embeddings"
    if model.get_decoder() is model:
        return "the model's decoder is the model itself"
    if type(model.get_output_embeddings()) is not torch.nn.Linear:
        return f"the output layer is a {type(model.get_output_embeddings()).__name__}, not a plain nn.Linear"
    return ""


def scored_logprobs(
    model,
    batch: MicroBatch,
    temperature: float,
    *,
    fused: bool,
    entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[S, C]`` float32 log-probs of ``batch``'s completion tokens at ``temperature`` (with the
    current grad mode: the KL reference calls it under ``no_grad``), and with ``entropy`` the
    ``[S, C]`` entropy there (a metric, detached). ``autocast_dtype``: the forward's autocast
    (bf16 on GPU), None for none."""
    device = batch.input_ids.device
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    if not fused:
        with autocast:
            logits = policy_logits(model, batch)
        logits = logits.float() / temperature
        lp = batch.scored(token_logprobs(logits, batch.input_ids))
        return lp, batch.scored(token_entropy(logits[:, :-1])) if entropy else None
    if batch.input_ids.shape[1] < 2:
        raise LossInputError("need rows of >= 2 tokens: the first token is never scored")
    # Only the scored positions: row row[s], index score_index[s, j], predicting the token after.
    rows = batch.row.unsqueeze(1).expand_as(batch.score_index)[batch.mask]
    positions = batch.score_index[batch.mask]
    targets = batch.input_ids[rows, positions + 1]
    vocab = model.get_output_embeddings().weight.shape[0]  # sharded, a DTensor: its shape is the whole one
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        # an out-of-range id would be a device-side assert on CUDA, which kills the context
        raise LossInputError(f"input_ids must lie in [0, {vocab}); got [{int(targets.min())}, {int(targets.max())}]")

    def fused() -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast:
            hidden = policy_hidden(model, batch)
        head = model.get_output_embeddings()
        return head_logprobs(
            hidden[rows, positions],
            head.weight,
            head.bias,
            targets,
            temperature,
            compute_dtype=autocast_dtype,
            entropy=entropy,
        )

    lp, ent = in_root_forward(model, fused)
    return _spread(lp, batch.mask), (None if ent is None else _spread(ent, batch.mask))


def _spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S, C]`` with ``values`` (``[mask.sum()]``, row-major) where ``mask`` is set, 0 elsewhere."""
    out = values.new_zeros(mask.shape)
    out[mask] = values
    return out
