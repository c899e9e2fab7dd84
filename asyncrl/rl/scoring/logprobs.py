"""The log-probs of a micro-batch's scored tokens, the trainer's, its KL reference's and a
teacher's alike: ``[S, C]`` in `MicroBatch.scored`'s layout (the input ``grpo_loss`` takes), by
one of two paths.

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

from asyncrl.rl.scoring.batch import MicroBatch
from asyncrl.rl.scoring.chunked_head import head_logprobs, head_topk
from asyncrl.rl.scoring.forward import in_root_forward, policy_hidden, policy_logits
from asyncrl.rl.scoring.tokens import LossInputError, token_entropy, token_logprobs

NON_LINEAR_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Model config keys of logits that are not the output layer's plain output (Gemma's soft cap,
Cohere's and Granite's scales): such models take the full-logits path."""


def fused_head_fallback(model) -> str:
    """Why ``model`` must take the full-logits path ("" when the fused one applies; a sharded
    model takes it inside its root's forward, `forward.in_root_forward`):

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
    lp, ent, _ = scored_logprobs_at(
        model, batch, temperature, None, fused=fused, entropy=entropy, autocast_dtype=autocast_dtype
    )
    return lp, ent


def scored_logprobs_at(
    model,
    batch: MicroBatch,
    temperature: float,
    at_ids: torch.Tensor | None,
    *,
    fused: bool,
    entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`scored_logprobs`, and with ``at_ids`` (``[S, C, K]`` token ids: a teacher's top-K at each
    completion position) the ``[S, C, K]`` log-probs of those ids at the same positions, with
    gradient: on the fused path gathered from the chunk of logits the head computes anyway."""
    device = batch.input_ids.device
    autocast = _autocast(device, autocast_dtype)
    if not fused:
        with autocast:
            logits = policy_logits(model, batch)
        logits = logits.float() / temperature
        lp = batch.scored(token_logprobs(logits, batch.input_ids))
        at = None if at_ids is None else _logprobs_at(logits, batch, at_ids)
        return lp, batch.scored(token_entropy(logits[:, :-1])) if entropy else None, at
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
    if at_ids is not None:  # column 0 the sampled token, then the K ids: one pass through the head
        _check_ids(at_ids, vocab)
        targets = torch.cat([targets[:, None], at_ids[batch.mask]], dim=1)

    def on_the_head() -> tuple[torch.Tensor, torch.Tensor | None]:
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

    lp, ent = in_root_forward(model, on_the_head)
    ent = None if ent is None else _spread(ent, batch.mask)
    if at_ids is None:
        return _spread(lp, batch.mask), ent, None
    return _spread(lp[:, 0], batch.mask), ent, _spread(lp[:, 1:], batch.mask)


@torch.no_grad()
def scored_topk(
    model, batch: MicroBatch, temperature: float, k: int, *, fused: bool, autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, C, k]`` float32 log-probs and ids of the ``k`` (at most the vocabulary) most likely
    tokens at each of ``batch``'s completion positions, at ``temperature``: a teacher's top-K,
    computed a chunk of positions at a time (no ``[tokens, vocab]`` log-softmax of the batch)."""
    device = batch.input_ids.device
    autocast = _autocast(device, autocast_dtype)
    if not fused:
        with autocast:
            logits = policy_logits(model, batch)
        scored = batch.scored(logits[:, :-1])  # [S, C, V] of the positions only
        values = torch.zeros(*scored.shape[:2], k, device=device)
        ids = torch.zeros(*scored.shape[:2], k, dtype=torch.long, device=device)
        for s in range(scored.shape[0]):  # a sequence at a time: float32 temporaries of [C, V]
            z = scored[s].float() / temperature
            top = torch.topk(z, k, dim=-1)
            values[s], ids[s] = top.values - torch.logsumexp(z, dim=-1, keepdim=True), top.indices
        return values, ids
    rows = batch.row.unsqueeze(1).expand_as(batch.score_index)[batch.mask]
    positions = batch.score_index[batch.mask]
    with autocast:
        hidden = policy_hidden(model, batch)
    head = model.get_output_embeddings()
    values, ids = head_topk(
        hidden[rows, positions], head.weight, head.bias, k, temperature, compute_dtype=autocast_dtype
    )
    return _spread(values, batch.mask), _spread(ids, batch.mask)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """The forward's autocast context on ``device`` (``dtype`` None: none)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _logprobs_at(logits: torch.Tensor, batch: MicroBatch, at_ids: torch.Tensor) -> torch.Tensor:
    """``[S, C, K]`` log-probs of ``at_ids`` from full ``[R, L, V]`` (tempered) logits, a sequence
    at a time."""
    _check_ids(at_ids, logits.shape[-1])
    out = []
    for s in range(at_ids.shape[0]):
        z = logits[batch.row[s], batch.score_index[s]]  # [C, V]
        out.append(z.gather(-1, at_ids[s]) - torch.logsumexp(z, dim=-1, keepdim=True))
    return torch.stack(out)


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise LossInputError(f"teacher ids must lie in [0, {vocab}); got [{int(ids.min())}, {int(ids.max())}]")


def _spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S, C, ...]`` with ``values`` (``[mask.sum(), ...]``, row-major) where ``mask`` is set, 0 elsewhere."""
    out = values.new_zeros(*mask.shape, *values.shape[1:])
    out[mask] = values
    return out
