"""GRPO's loss as pure functions: group advantages, per-token log-probs, the clipped surrogate.

Shapes: ``B`` sequences, ``T`` tokens per packed sequence (prompt + completion), ``L`` completion
positions scored by the loss, ``V`` vocabulary entries. Padding is described by a mask, never by a
sentinel value: masked positions may hold anything (NaN included) and contribute nothing to the
loss, its gradient, or any metric.
"""

from __future__ import annotations

import math

import torch

from asyncrl.errors import AsyncrlError
from asyncrl.rl.config.trainer import GRPOLossConfig

# exp() overflows float32 to inf above ~88.7 nats, and inf * 0 in a backward is NaN. Instead of
# clamping the log-ratio (a clamp has zero gradient beyond its bound, so it silently DROPPED the
# very tokens the truncated importance weight exists for, and the k3 KL's pull back towards the
# reference), exp() is exact up to this many nats and continues linearly above, value and slope
# continuous: e**50 ~ 5e21, so even a million such terms sum far below float32's 3.4e38.
_EXP_EXACT_UP_TO = 50.0


class LossInputError(AsyncrlError, ValueError):
    """A loss input has the wrong shape, dtype or range; the message names the argument."""


def group_advantages(rewards: torch.Tensor | list[list[float]], normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each completion: its reward minus its group's mean, divided by
    ``(group std + eps)`` when ``normalize_std``.

    ``rewards`` is a ``[G, n]`` tensor (G groups of n) and gives ``[G, n]``, or a list of per-group
    reward lists (sizes may differ) and gives one flat ``[sum of sizes]`` tensor, groups in order:
    the ``[B]`` layout ``grpo_loss`` takes. The std is the POPULATION std (``unbiased=False``):
    rewards {0, 1} give advantages exactly -1, +1 (TRL uses the unbiased std, which is larger by
    sqrt(n / (n - 1))). A group whose rewards are all equal (a group of one included) has no
    learning signal and gets advantages of exactly 0 -- forced, because ``r - mean`` need not be
    exactly 0 in floating point (0.1 + 0.1 + 0.1 != 0.3) and ``/ (0 + eps)`` would amplify it.
    """
    if isinstance(rewards, torch.Tensor):
        if rewards.dim() != 2 or rewards.shape[1] == 0:
            raise LossInputError(f"rewards must be [groups, group_size >= 1], not {list(rewards.shape)}")
        return _advantages_2d(rewards, normalize_std, eps)
    if any(len(g) == 0 for g in rewards):
        raise LossInputError("every reward group needs at least one reward")
    if not rewards:
        return torch.zeros(0)
    return torch.cat([_advantages_2d(torch.tensor([g], dtype=torch.float64), normalize_std, eps)[0] for g in rewards]).float()


def _advantages_2d(rewards: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    r = rewards if rewards.dtype == torch.float64 else rewards.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)).expand_as(adv)
    return adv.masked_fill(flat, 0.0)


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
        raise LossInputError(f"input_ids must lie in [0, {vocab}); got [{int(input_ids.min())}, {int(input_ids.max())}]")
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


def grpo_loss(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's token-level clipped surrogate (to minimise) and detached 0-dim metric tensors.

    ``mask``: nonzero marks a valid (scored) token. Per valid token, with ``r = exp(new - behaviour)`` (the importance ratio against the sampler's
    behaviour policy: the off-policy correction for stale groups) and ``A`` its sequence's
    advantage: ``term = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (times the TIS factor
    when ``tis_cap`` is set, see ``GRPOLossConfig``); ``loss = -aggregate(term) + kl_coef *
    aggregate(k3)`` with ``k3 = exp(ref - new) - (ref - new) - 1``. Gradient flows only into
    ``new_logprobs``; every other input is detached. These are exact (to float32) for any
    log-ratio up to 50 nats either way, and finite with the right sign beyond (see ``_safe_exp``).

    ``normalizer`` replaces the divisor of the aggregation (valid tokens for 'token_mean',
    non-empty sequences for 'seq_mean'): pass the whole batch's count when a batch is split into
    micro-batches whose gradients are accumulated, so the sum equals the loss of the whole batch.

    Metrics (over valid tokens, whatever the aggregation): ``loss``, ``pg_loss``, ``ratio_mean``,
    ``ratio_max``, ``clip_frac_low`` (A < 0 and r < 1 - eps_low: clipped, no gradient),
    ``clip_frac_high`` (A > 0 and r > 1 + eps_high), ``tokens``; ``kl`` with ``ref_logprobs``;
    ``tis_frac`` (r > tis_cap) with ``tis_cap``; ``entropy`` with ``entropy``. They stay tensors
    so that logging them costs no device sync until the caller asks.
    """
    _check_same_shape(new_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask, ref_logprobs=ref_logprobs, entropy=entropy)
    if new_logprobs.dim() != 2 or advantages.shape != new_logprobs.shape[:1]:
        raise LossInputError(f"need new_logprobs [B, L] and advantages [B]; got {list(new_logprobs.shape)} and {list(advantages.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise LossInputError("kl_coef > 0 needs ref_logprobs")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, not {normalizer!r}")
    valid = mask.bool()
    # Mask BEFORE exp(): padding may hold NaN/inf, and where() routes a zero gradient to it.
    # The floor only drops gradients smaller than e**-50 (a -inf log-prob would otherwise give NaN).
    log_ratio = torch.where(valid, new_logprobs - behaviour_logprobs.detach(), 0.0).clamp(min=-_EXP_EXACT_UP_TO)
    adv = advantages.detach().to(log_ratio.dtype).unsqueeze(1)
    term = _clipped_surrogate(log_ratio, adv, config)
    ratio = _safe_exp(log_ratio.detach())  # for the metrics only
    n_tokens = valid.sum()
    metrics: dict[str, torch.Tensor] = {"tokens": n_tokens.detach()}
    pg_loss = -_aggregate(term, valid, config.aggregation, normalizer)
    loss = pg_loss
    if ref_logprobs is not None:
        delta = torch.where(valid, ref_logprobs.detach() - new_logprobs, 0.0)
        # Schulman's k3: >= 0 per token, low variance. No floor on delta: exp() of a very negative
        # number is 0, and the gradient far above the reference (1 - e**delta ~ 1) must survive.
        k3 = _safe_exp(delta) - delta - 1
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * _aggregate(k3, valid, config.aggregation, normalizer)
        metrics["kl"] = _token_mean(k3.detach(), valid, n_tokens)
    with torch.no_grad():
        metrics["loss"] = loss.detach()
        metrics["pg_loss"] = pg_loss.detach()
        metrics["ratio_mean"] = _token_mean(ratio, valid, n_tokens)
        metrics["ratio_max"] = torch.where(valid, ratio, 0.0).amax() if ratio.numel() else ratio.new_zeros(())
        metrics["clip_frac_low"] = _token_mean(((adv < 0) & (ratio < 1 - config.eps_low)).to(ratio.dtype), valid, n_tokens)
        metrics["clip_frac_high"] = _token_mean(((adv > 0) & (ratio > 1 + config.eps_high)).to(ratio.dtype), valid, n_tokens)
        if config.tis_cap is not None:
            metrics["tis_frac"] = _token_mean((ratio > config.tis_cap).to(ratio.dtype), valid, n_tokens)
        if entropy is not None:
            metrics["entropy"] = _token_mean(entropy.detach().to(ratio.dtype), valid, n_tokens)
    return loss, metrics


def _clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, config: GRPOLossConfig) -> torch.Tensor:
    """Per token ``min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``, times ``w = min(1,
    tis_cap / r)`` (detached) when ``tis_cap`` is set, computed without forming a huge ``r``.

    The clipped branch clips in log space, so ``exp()`` never sees more than ``log(1 + eps_high)``.
    With the TIS weight the unclipped branch is ``r * w * A = e**(lr - sg(lr)) * min(sg(r), cap) * A``
    (``sg``: stop-gradient): its value is ``min(r, cap) * A`` and its gradient ``min(r, cap) * A``
    for ANY log-ratio, the docstring's promise, with nothing to overflow. ``w > 0``, so scaling
    both branches by it before ``minimum`` picks the same branch as the formula.
    """
    clipped_r = torch.exp(log_ratio.clamp(math.log1p(-config.eps_low), math.log1p(config.eps_high)))
    if config.tis_cap is None:
        return torch.minimum(_safe_exp(log_ratio) * adv, clipped_r * adv)
    sg = log_ratio.detach()
    log_cap = math.log(config.tis_cap)
    weight = torch.exp((log_cap - sg).clamp(max=0.0))  # min(1, cap / r)
    unclipped = torch.exp(log_ratio - sg) * torch.exp(sg.clamp(max=log_cap)) * adv
    return torch.minimum(unclipped, clipped_r * weight * adv)


def _safe_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` up to ``_EXP_EXACT_UP_TO``, then its tangent line there: finite for every finite
    ``x``, with a nonzero gradient everywhere (a clamp would have none above its bound)."""
    e = torch.exp(x.clamp(max=_EXP_EXACT_UP_TO))
    return torch.where(x > _EXP_EXACT_UP_TO, e * (1 + x - _EXP_EXACT_UP_TO), e)


def _aggregate(x: torch.Tensor, valid: torch.Tensor, how: str, normalizer: float | None) -> torch.Tensor:
    """Masked mean of ``x`` per ``how``; 0 (with a graph) when nothing is valid, never NaN."""
    x = torch.where(valid, x, 0.0)  # not x * mask: NaN * 0 is NaN
    if how == "token_mean":
        return x.sum() / (normalizer if normalizer is not None else valid.sum().clamp(min=1))
    per_seq_tokens = valid.sum(dim=1)
    per_seq = x.sum(dim=1) / per_seq_tokens.clamp(min=1)
    # Sequences with no valid token contribute 0 to the sum and are left out of the count.
    n_seqs = normalizer if normalizer is not None else (per_seq_tokens > 0).sum().clamp(min=1)
    return per_seq.sum() / n_seqs


def _token_mean(x: torch.Tensor, valid: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x, 0.0).sum() / n_tokens.clamp(min=1)


def _check_same_shape(ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.shape != ref.shape:
            raise LossInputError(f"{name} has shape {list(t.shape)}, new_logprobs has {list(ref.shape)}")
