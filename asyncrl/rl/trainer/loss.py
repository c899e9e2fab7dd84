"""GRPO's loss as pure functions: group advantages, the clipped surrogate (the per-token log-probs
it reads: ``scoring/tokens.py``).

Shapes: ``B`` sequences, ``T`` tokens per packed sequence (prompt + completion), ``L`` completion
positions scored by the loss, ``V`` vocabulary entries. Padding is described by a mask, never by a
sentinel value: masked positions may hold anything (NaN included) and contribute nothing to the
loss, its gradient, or any metric.
"""

from __future__ import annotations

import torch

from asyncrl.rl.config.trainer import GRPOLossConfig
from asyncrl.rl.scoring.tokens import LossInputError
from asyncrl.rl.trainer.corrections import off_policy, tally
from asyncrl.rl.trainer.distill import distill_advantages, topk_reverse_kl
from asyncrl.rl.trainer.policy_terms import POLICY_TERMS, safe_exp


def group_advantages(
    rewards: torch.Tensor | list[list[float]], normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
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
    return torch.cat(
        [_advantages_2d(torch.tensor([g], dtype=torch.float64), normalize_std, eps)[0] for g in rewards]
    ).float()


def _advantages_2d(rewards: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    r = rewards if rewards.dtype == torch.float64 else rewards.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)).expand_as(adv)
    return adv.masked_fill(flat, 0.0)


def overlong_penalties(lengths: list[int], config: GRPOLossConfig) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, "overlong reward shaping") of completions of ``lengths``
    tokens, to ADD to their rewards. With ``L_max = overlong_max_tokens``, ``L_cache =
    overlong_buffer`` and ``c = overlong_penalty`` (the paper's c is 1)::

        R(y) = 0                                     |y| <= L_max - L_cache
               c * ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               -c                                    L_max < |y|

    Zero for every length when ``overlong_buffer`` is 0. L_max defaults to the generation limit,
    as in the paper (it generates at most 20480 tokens = L_max, with L_cache 4096), so a
    completion cut off by ``max_new_tokens`` gets the whole ``-c``; the third case arises only
    for an ``overlong_max_tokens`` set below the limit. Where the paper leaves it open: ``|y|``
    counts every completion token, an environment's tokens in a multi-turn episode included
    (they too fill the context).
    """
    buffer, limit = config.overlong_buffer, config.overlong_max_tokens
    if not buffer:
        return [0.0] * len(lengths)
    if limit < buffer:
        raise ValueError(
            f"overlong_max_tokens {limit} must be >= overlong_buffer {buffer} (0 is resolved from "
            "--sampler.max_new_tokens by GRPOConfig.trainer_config)"
        )
    start = limit - buffer
    return [-config.overlong_penalty * min(max(n - start, 0) / buffer, 1.0) for n in lengths]


def step_advantages(groups: list, config: GRPOLossConfig, normalize_std: bool) -> torch.Tensor:
    """The flat ``[B]`` advantages of a step's ``groups`` (anything with ``rewards`` and
    ``completion_ids``, a `RolloutGroup`): each group's rewards plus the overlong penalty of its
    completions (`overlong_penalties`), through `group_advantages`."""
    rewards = [list(g.rewards) for g in groups]
    if config.overlong_buffer:
        rewards = [
            [r + p for r, p in zip(rs, overlong_penalties([len(c) for c in g.completion_ids], config))]
            for rs, g in zip(rewards, groups)
        ]
    return group_advantages(rewards, normalize_std)


def loss_normalizer(config: GRPOLossConfig, n_tokens: float, n_seqs: float) -> float:
    """The divisor of a whole batch's loss (``grpo_loss``'s ``normalizer``) from its valid tokens
    and its sequences with at least one valid token, per ``config.aggregation``."""
    if config.aggregation == "token_mean":
        return max(n_tokens, 1.0)
    if config.aggregation == "seq_mean":
        return max(n_seqs, 1.0)
    return max(n_seqs, 1.0) * _token_budget(config)


def _token_budget(config: GRPOLossConfig) -> int:
    if not config.token_budget:
        raise ValueError(
            "aggregation 'fixed_tokens' needs token_budget > 0 (GRPOConfig.trainer_config sets it "
            "from --sampler.max_new_tokens when --trainer.loss.token_budget is 0)"
        )
    return config.token_budget


def grpo_loss(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    student_topk: torch.Tensor | None = None,
    teacher_topk: torch.Tensor | None = None,
    token_lag: torch.Tensor | None = None,
    with_tally: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's policy-gradient loss (to minimise) and detached 0-dim metric tensors.

    ``mask``: nonzero marks a valid (scored) token. ``advantages``: ``[B]`` (one per sequence) or
    ``[B, L]`` (one per token). Per valid token, with ``r = exp(new - behaviour)`` (the importance
    ratio against the sampler's behaviour policy: the off-policy correction for stale groups) and
    ``A`` its advantage, ``term`` is per ``config.policy_loss`` (``policy_terms.py``: `ppo_clip`,
    `gspo`, `cispo`); for 'ppo_clip' ``term = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``
    (times the TIS factor when ``tis_cap`` is set, see ``GRPOLossConfig``); ``loss =
    -aggregate(term) + kl_coef * aggregate(k3)`` with ``k3 = exp(ref - new) - (ref - new) - 1``.
    Gradient flows only into ``new_logprobs``; every other input is detached. These are exact (to
    float32) for any log-ratio up to 50 nats either way, and finite with the right sign beyond
    (see `safe_exp`).

    With ``distill_coef`` > 0 (`_distillation`), ``teacher_logprobs`` (a teacher's log-probs of the
    same tokens) make every advantage `distill_advantages`'; ``teacher_topk`` (``[B, L, K]``, its
    top-K log-probs) with ``student_topk`` (the policy's, with gradient) add instead
    ``distill_coef * aggregate(topk_reverse_kl)`` (GKD's form: the divergence back-propagated).

    Off-policy corrections act on the policy term only (`_policy_term`); ``token_lag`` is each
    token's version lag, for them.

    ``normalizer`` replaces the divisor of the aggregation (valid tokens for 'token_mean',
    non-empty sequences for 'seq_mean', those times ``token_budget`` for 'fixed_tokens'): pass the
    whole batch's (`loss_normalizer`) when a batch is split into micro-batches whose gradients are
    accumulated, so the sum equals the loss of the whole batch.

    Metrics: `_step_metrics`' (and ``kl``, ``distill_kl``, ``correction`` where they apply).
    """
    _check_loss_inputs(
        new_logprobs,
        behaviour_logprobs,
        advantages,
        mask,
        config,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        normalizer=normalizer,
        teacher_logprobs=teacher_logprobs,
        student_topk=student_topk,
        teacher_topk=teacher_topk,
        token_lag=token_lag,
    )
    valid = mask.bool()
    log_ratio, adv = _masked_ratio_and_advantages(new_logprobs, behaviour_logprobs, advantages, valid)
    n_tokens = valid.sum()
    metrics: dict[str, torch.Tensor] = {"tokens": n_tokens.detach()}
    distill = None
    if config.distill_coef > 0:
        adv, distill, metrics["distill_kl"] = _distillation(
            adv, valid, n_tokens, behaviour_logprobs, config, normalizer, teacher_logprobs, student_topk, teacher_topk
        )
    term, ratio, low, high, truncated = _policy_term(
        new_logprobs, behaviour_logprobs, log_ratio, adv, valid, config, token_lag, metrics if with_tally else None
    )
    pg_loss = -_aggregate(term, valid, config, normalizer)
    loss = pg_loss if distill is None else pg_loss + distill
    if ref_logprobs is not None:
        k3 = _k3(ref_logprobs, new_logprobs, valid)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * _aggregate(k3, valid, config, normalizer)
        metrics["kl"] = _token_mean(k3.detach(), valid, n_tokens)
    metrics.update(_step_metrics(loss, pg_loss, ratio, low, high, entropy, valid, n_tokens, config, truncated))
    return loss, metrics


def _policy_term(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    config: GRPOLossConfig,
    token_lag: torch.Tensor | None,
    tally_into: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's policy term (``config.policy_loss``) with the off-policy corrections applied,
    its ratio, its low and high clip masks, and the ratio ``tis_cap`` truncates: the policy
    term's, or with decoupling the behaviour ratio. With ``tally_into`` and a correction on, the
    micro-batch's `corrections.tally` goes there as ``correction``.

    The corrections (``decoupled``, ``token_mask``, ``seq_mask``, ``seq_tis_cap``, ``opsm_delta``;
    ``corrections.py``, docs/algorithms.md): with decoupling, the policy term's ratio is
    ``pi / pi_prox`` and each token's term is multiplied by its detached behaviour weight; a
    masked token's term is 0, and it stays in the normaliser. The KL and the teacher's top-K term
    keep every valid token. ``token_lag`` (``[B, L]``, each token's version lag: the trainer's
    version minus the one that sampled it) is needed by 'loglinear' and gives the metrics their
    lag buckets."""
    if not config.corrected:
        term, ratio, low, high = POLICY_TERMS[config.policy_loss](log_ratio, adv, valid, config)
        return term, ratio, low, high, ratio
    corrections = off_policy(new_logprobs, behaviour_logprobs, adv, valid, config, token_lag)
    truncated = None
    if corrections.weight is not None:  # decoupled: the clip is against pi_prox
        # a token pi_prox gives probability 0 has weight 0: its ratio (-inf - -inf) is not read
        finite = valid & torch.isfinite(corrections.prox)
        log_ratio = torch.where(finite, new_logprobs - corrections.prox, 0.0)
        truncated = torch.exp(corrections.log_k)
    term, ratio, low, high = POLICY_TERMS[config.policy_loss](log_ratio, adv, valid, config)
    if corrections.weight is not None:
        term = term * corrections.weight
    term = torch.where(corrections.keep, term, 0.0)
    if tally_into is not None:
        tally_into["correction"] = tally(corrections, valid, token_lag)
    return term, ratio, low, high, ratio if truncated is None else truncated


def _check_loss_inputs(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig,
    *,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    normalizer: float | None,
    teacher_logprobs: torch.Tensor | None,
    student_topk: torch.Tensor | None,
    teacher_topk: torch.Tensor | None,
    token_lag: torch.Tensor | None,
) -> None:
    """Refuse, before any arithmetic, inputs `grpo_loss` cannot read: shapes that disagree, and a
    config that asks for an input not given."""
    _check_same_shape(
        new_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        mask=mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        teacher_logprobs=teacher_logprobs,
        token_lag=token_lag,
    )
    if new_logprobs.dim() != 2 or advantages.shape not in (new_logprobs.shape[:1], new_logprobs.shape):
        raise LossInputError(
            f"need new_logprobs [B, L] and advantages [B] or [B, L]; got {list(new_logprobs.shape)} "
            f"and {list(advantages.shape)}"
        )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise LossInputError("kl_coef > 0 needs ref_logprobs")
    if (student_topk is None) != (teacher_topk is None):
        raise LossInputError("student_topk and teacher_topk come together (the teacher's top-K ids, scored by both)")
    if (
        teacher_topk is not None
        and student_topk is not None
        and (teacher_topk.shape != student_topk.shape or teacher_topk.shape[:2] != mask.shape)
    ):
        raise LossInputError(
            f"teacher_topk {list(teacher_topk.shape)} and student_topk {list(student_topk.shape)} must both be "
            f"[B, L, K] with [B, L] = {list(mask.shape)}"
        )
    if config.distill_coef > 0 and teacher_logprobs is None and teacher_topk is None:
        raise LossInputError(
            "distill_coef > 0 needs teacher_logprobs or teacher_topk (the scorer's, --teacher.model_path)"
        )
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, not {normalizer!r}")


def _masked_ratio_and_advantages(
    new_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token log importance ratio and ``[B, L]`` advantages, 0 at padding; only the ratio
    carries a gradient (into ``new_logprobs``)."""
    # Mask BEFORE exp(): padding may hold NaN/inf, and where() routes a zero gradient to it. Not
    # floored here: each policy term floors its own ratio (``policy_terms.py``; GSPO after its mean).
    log_ratio = torch.where(valid, new_logprobs - behaviour_logprobs.detach(), 0.0)
    adv = advantages.detach().to(log_ratio.dtype)
    adv = torch.where(valid, adv if adv.dim() == 2 else adv.unsqueeze(1), 0.0)  # per-token padding may be NaN
    return log_ratio, adv


def _distillation(
    adv: torch.Tensor,
    valid: torch.Tensor,
    n_tokens: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    config: GRPOLossConfig,
    normalizer: float | None,
    teacher_logprobs: torch.Tensor | None,
    student_topk: torch.Tensor | None,
    teacher_topk: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The teacher's part of the loss (``distill_coef`` > 0): the advantages, the loss term to add
    (None where the teacher acts through the advantages alone) and the ``distill_kl`` metric.

    With the teacher's top-K the advantages stay the task's and the term is the aggregated
    `topk_reverse_kl`; with its log-probs of the sampled tokens alone, every advantage becomes
    `distill_advantages`' and there is no term."""
    if teacher_topk is not None and student_topk is not None:  # together (`_check_loss_inputs`)
        # masked before the KL: padding may hold anything, and where() routes it no gradient
        kl = topk_reverse_kl(
            torch.where(valid[..., None], student_topk, 0.0), torch.where(valid[..., None], teacher_topk, 0.0)
        )
        kl = torch.where(valid, kl, 0.0)
        distill = config.distill_coef * _aggregate(kl, valid, config, normalizer)
        return adv, distill, _token_mean(kl.detach(), valid, n_tokens)
    if teacher_logprobs is None:
        raise LossInputError("distill_coef > 0 needs teacher_logprobs or teacher_topk")
    adv = torch.where(valid, distill_advantages(adv, behaviour_logprobs, teacher_logprobs, config.distill_coef), 0.0)
    distill_kl = _token_mean((behaviour_logprobs - teacher_logprobs).detach().to(adv.dtype), valid, n_tokens)
    return adv, None, distill_kl


def _k3(ref_logprobs: torch.Tensor, new_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token: >= 0, low variance, 0 at padding
    (``exp(0) - 0 - 1``). Gradient flows into ``new_logprobs`` only."""
    delta = torch.where(valid, ref_logprobs.detach() - new_logprobs, 0.0)
    # No floor on delta: exp() of a very negative number is 0, and the gradient far above the
    # reference (1 - e**delta ~ 1) must survive.
    return safe_exp(delta) - delta - 1


@torch.no_grad()
def _step_metrics(
    loss: torch.Tensor,
    pg_loss: torch.Tensor,
    ratio: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    entropy: torch.Tensor | None,
    valid: torch.Tensor,
    n_tokens: torch.Tensor,
    config: GRPOLossConfig,
    truncated: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The loss and its policy term, what the importance ratios did over the valid tokens (their
    mean and max, the share clipped below and above, with ``tis_cap`` the share of ``truncated``
    the TIS weight truncated) and, given, the entropy. `grpo_loss`' metrics in all:

    Metrics (over valid tokens, whatever the aggregation): ``loss``, ``pg_loss``, ``ratio_mean``,
    ``ratio_max`` (GSPO: of the sequence ratio), ``clip_frac_low`` (A < 0 and r < 1 - eps_low:
    clipped, no gradient; CISPO: r < 1 - eps_low, the weight truncated, whatever A),
    ``clip_frac_high`` (A > 0 and r > 1 + eps_high; CISPO: r > 1 + eps_high), ``tokens``; ``kl`` with ``ref_logprobs``;
    ``tis_frac`` (r > tis_cap) with ``tis_cap``; ``entropy`` with ``entropy``. They stay tensors
    so that logging them costs no device sync until the caller asks. With ``with_tally`` and a
    correction on (``config.corrected``), one more entry, ``correction``, is not a metric but the
    micro-batch's `corrections.tally` (what was masked and the behaviour ratio, by version lag and
    completion length), which the caller adds up over the step (`corrections.merge`,
    `corrections.tally_metrics`).
    """
    metrics = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "ratio_mean": _token_mean(ratio, valid, n_tokens),
        "ratio_max": torch.where(valid, ratio, 0.0).amax() if ratio.numel() else ratio.new_zeros(()),
        "clip_frac_low": _token_mean(low.to(ratio.dtype), valid, n_tokens),
        "clip_frac_high": _token_mean(high.to(ratio.dtype), valid, n_tokens),
    }
    if config.tis_cap is not None:
        metrics["tis_frac"] = _token_mean((truncated > config.tis_cap).to(ratio.dtype), valid, n_tokens)
    if entropy is not None:
        metrics["entropy"] = _token_mean(entropy.detach().to(ratio.dtype), valid, n_tokens)
    return metrics


def _aggregate(x: torch.Tensor, valid: torch.Tensor, config: GRPOLossConfig, normalizer: float | None) -> torch.Tensor:
    """Masked mean of ``x`` per ``config.aggregation``; 0 (with a graph) when nothing is valid, never NaN."""
    x = torch.where(valid, x, 0.0)  # not x * mask: NaN * 0 is NaN
    if config.aggregation == "token_mean":
        return x.sum() / (normalizer if normalizer is not None else valid.sum().clamp(min=1))
    if config.aggregation == "fixed_tokens":
        # Dr. GRPO (Liu et al. 2025): sum over each sequence's tokens / MAX_TOKENS, mean over sequences
        return x.sum() / (
            normalizer if normalizer is not None else valid.any(dim=1).sum().clamp(min=1) * _token_budget(config)
        )
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
