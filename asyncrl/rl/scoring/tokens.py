"""Per-token log-probs and entropy of full ``[B, T, V]`` logits, the one place both the trainer's
loss and a scorer's teacher read them from, and the error a bad input to them raises."""

from __future__ import annotations

import torch

from asyncrl.errors import AsyncrlError


class LossInputError(AsyncrlError, ValueError):
    """A loss input has the wrong shape, dtype or range; the message names the argument."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, chunk_rows: int = 1) -> torch.Tensor:
    """``[B, T-1]`` log-probabilities of the tokens that are actually in ``input_ids``.

    CAUSAL SHIFT: ``logits[:, t]`` is the model's prediction for token ``t + 1``, so
    ``out[:, t] = log_softmax(logits[:, t])[input_ids[:, t + 1]]``. Token 0 is never scored and the
    last logit position predicts past the end and is unused. For a sequence of prompt length
    ``P`` followed by ``C`` completion tokens, the completion's log-probs are
    ``out[:, P - 1 : P - 1 + C]``. (Gathering ``logits[:, t]`` at ``input_ids[:, t]`` -- no shift --
    scores each token by a prediction that had already seen it: a silent, plausible-looking bug.)

    Computed in float32 whatever the logits' dtype, as ``logit - logsumexp(logits)`` rather than by
    indexing a ``log_softmax``: for the backward ``log_softmax`` keeps a ``[B, T-1, V]`` float32
    output of its own, while ``logsumexp`` keeps its input, the float32 logits its caller holds
    anyway. With a 150k-token vocabulary each such tensor is 10 GiB per 16k tokens.
    ``chunk_rows`` bounds the forward's float32 temporaries to ``[chunk_rows, T, V]``.
    """
    if logits.dim() != 3:
        raise LossInputError(f"logits must be [B, T, V], not {list(logits.shape)}")
    if input_ids.shape != logits.shape[:2]:
        raise LossInputError(f"input_ids {list(input_ids.shape)} must match logits' [B, T] = {list(logits.shape[:2])}")
    if logits.shape[1] < 2:
        raise LossInputError("need T >= 2 tokens: the first token is never scored")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise LossInputError(f"input_ids must be an integer tensor, not {input_ids.dtype}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, not {chunk_rows}")
    vocab = logits.shape[2]
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        # An out-of-range id would be a device-side assert on CUDA, which kills the context.
        raise LossInputError(
            f"input_ids must lie in [0, {vocab}); got [{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    targets = input_ids[:, 1:].long().unsqueeze(-1)  # token t+1 ...
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        scores = logits[rows, :-1].float()  # ... scored by logits at t
        out.append((scores.gather(-1, targets[rows]) - torch.logsumexp(scores, dim=-1, keepdim=True)).squeeze(-1))
    return torch.cat(out)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_tokens: int = 2048) -> torch.Tensor:
    """``[B, T]`` entropy of each position's distribution (a metric: no gradient), computed
    ``chunk_tokens`` positions at a time so its float32 temporaries stay ``[chunk_tokens, V]``
    however long the rows are."""
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    rows_per_chunk = max(1, chunk_tokens // max(logits.shape[1], 1))  # short rows: several per chunk
    for row in range(0, logits.shape[0], rows_per_chunk):
        for start in range(0, logits.shape[1], chunk_tokens):
            block = (slice(row, row + rows_per_chunk), slice(start, start + chunk_tokens))
            logp = torch.log_softmax(logits[block].float(), dim=-1)
            out[block] = -(logp.exp() * logp).sum(-1)
    return out
