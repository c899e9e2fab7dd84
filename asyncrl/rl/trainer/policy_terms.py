"""The policy-gradient term of GRPO's loss, per valid token, one function per
``--trainer.loss.policy_loss`` (`POLICY_TERMS`): PPO's clipped surrogate (`ppo_clip`), GSPO
(`gspo`) and CISPO (`cispo`). Each takes the masked log importance ratio and the advantages
(``[B, L]``, 0 at padding) and gives the term (to maximise), the ratio and where a token was clipped
below and above, for the metrics; ``loss.py`` aggregates them.

Every exp() of a log-ratio goes through `safe_exp`, or clamps first: a ratio never overflows.
"""

from __future__ import annotations

import math

import torch

from asyncrl.rl.config.trainer import GRPOLossConfig

# exp() overflows float32 to inf above ~88.7 nats, and inf * 0 in a backward is NaN. Instead of
# clamping the log-ratio (a clamp has zero gradient beyond its bound, so it silently DROPPED the
# very tokens the truncated importance weight exists for, and the k3 KL's pull back towards the
# reference), exp() is exact up to this many nats and continues linearly above, value and slope
# continuous: e**50 ~ 5e21, so even a million such terms sum far below float32's 3.4e38.
EXP_EXACT_UP_TO = 50.0


def ppo_clip(log_ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, config: GRPOLossConfig):
    """PPO's token-level clipped surrogate (`_clipped_surrogate`); the ratio and where a token
    was clipped (its gradient dropped), below and above, for the metrics."""
    log_ratio = _floored(log_ratio)
    ratio = safe_exp(log_ratio.detach())
    low, high = (adv < 0) & (ratio < 1 - config.eps_low), (adv > 0) & (ratio > 1 + config.eps_high)
    return _clipped_surrogate(log_ratio, adv, config), ratio, low, high


def gspo(log_ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, config: GRPOLossConfig):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in the paper's GSPO-token
    form: with the sequence ratio ``s_i = exp(mean_t log r_it)`` over the valid tokens (the
    length-normalised geometric mean of the token ratios) and ``sg`` a stop-gradient::

        s_it = sg(s_i) * exp(log r_it - sg(log r_it))       (value s_i, d s_it / d new_it = s_i)
        term_it = min(s_it * A_it, clip(s_it, 1 - gspo_eps_low, 1 + gspo_eps_high) * A_it)

    Aggregated by 'seq_mean' this is GSPO's objective exactly, value and gradient (the paper:
    with ``A_it = A_i`` GSPO-token and GSPO coincide); the token form also takes per-token
    advantages. Readings taken: the paper's ``pi_old`` is the behaviour policy (the sampler's
    log-probs: in an async run the sequence ratio also corrects staleness); the clip is decided
    by the sequence (every token of a clipped sequence loses its gradient); 'token_mean' weighs
    a sequence by its length instead, which the paper does not do.

    The floor at -`EXP_EXACT_UP_TO` applies to the sequence's mean, not to each token before it:
    a token far below its sampling log-prob (-80), or given probability 0 by the trainer (-inf),
    lowers the sequence ratio as the formula says (to exp(-0.8) in a 100-token sequence; to
    e**-50, i.e. 0, for -inf), where a floor per token would have changed it (to exp(-0.5)) and
    every token's gradient with it. The token trick carries a unit gradient on each finite
    log-ratio, and none on a -inf one (whose ``s_i / |y_i|`` is 0), so nothing is -inf - -inf."""
    n = valid.sum(dim=1, keepdim=True).clamp(min=1)
    seq = _floored(log_ratio.sum(dim=1, keepdim=True) / n).detach()  # log_ratio is 0 at padding
    finite = torch.where(torch.isfinite(log_ratio), log_ratio, 0.0)
    token = seq + finite - finite.detach()
    clipped = torch.exp(token.clamp(math.log1p(-config.gspo_eps_low), math.log1p(config.gspo_eps_high)))
    term = torch.minimum(safe_exp(token) * adv, clipped * adv)
    ratio = safe_exp(seq).expand_as(log_ratio)
    low = (adv < 0) & (ratio < 1 - config.gspo_eps_low)
    high = (adv > 0) & (ratio > 1 + config.gspo_eps_high)
    return term, ratio, low, high


def cispo(log_ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, config: GRPOLossConfig):
    """CISPO (MiniMax-M1, Chen et al. 2025): REINFORCE on every token, weighted by the
    clipped and detached importance ratio ``w = sg(clip(r, 1 - cispo_eps_low, 1 + cispo_eps_high))``::

        objective_it = w_it * A_it * log pi(y_it)    ->   gradient w_it * A_it * grad log pi(y_it)

    No token loses its gradient (PPO's clip drops the rare high-ratio "fork" tokens); the weight
    only bounds how much each counts. Reading taken: the paper's objective has ``log pi`` itself
    as its value, a log-likelihood of no meaning here; we return ``w * A * (1 + log r - sg(log
    r))``: the same gradient, and a value (``w * A``) comparable with the other losses' ``pg_loss``.
    Normalised per the aggregation; the paper's is 'token_mean'. ``cispo_eps_low`` 1: no lower
    bound on the weight (the paper's)."""
    log_ratio = _floored(log_ratio)
    sg = log_ratio.detach()
    weight = torch.exp(
        sg.clamp(
            math.log1p(-config.cispo_eps_low) if config.cispo_eps_low < 1 else -math.inf,
            math.log1p(config.cispo_eps_high),
        )
    )
    term = weight * adv * (1 + log_ratio - sg)
    ratio = safe_exp(sg)
    return term, ratio, ratio < 1 - config.cispo_eps_low, ratio > 1 + config.cispo_eps_high


def _clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, config: GRPOLossConfig) -> torch.Tensor:
    """Per token ``min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``, times ``w = min(1,
    tis_cap / r)`` (detached) when ``tis_cap`` is set and ``decoupled`` off (decoupled PPO
    truncates its behaviour weight instead: ``corrections.py``), computed without forming a huge ``r``.

    The clipped branch clips in log space, so ``exp()`` never sees more than ``log(1 + eps_high)``.
    With the TIS weight the unclipped branch is ``r * w * A = e**(lr - sg(lr)) * min(sg(r), cap) * A``
    (``sg``: stop-gradient): its value is ``min(r, cap) * A`` and its gradient ``min(r, cap) * A``
    for ANY log-ratio, the docstring's promise, with nothing to overflow. ``w > 0``, so scaling
    both branches by it before ``minimum`` picks the same branch as the formula.
    """
    clipped_r = torch.exp(log_ratio.clamp(math.log1p(-config.eps_low), math.log1p(config.eps_high)))
    if config.tis_cap is None or config.decoupled != "off":
        return torch.minimum(safe_exp(log_ratio) * adv, clipped_r * adv)
    sg = log_ratio.detach()
    log_cap = math.log(config.tis_cap)
    weight = torch.exp((log_cap - sg).clamp(max=0.0))  # min(1, cap / r)
    unclipped = torch.exp(log_ratio - sg) * torch.exp(sg.clamp(max=log_cap)) * adv
    return torch.minimum(unclipped, clipped_r * weight * adv)


def _floored(log_ratio: torch.Tensor) -> torch.Tensor:
    """A token's log-ratio floored at -`EXP_EXACT_UP_TO`: for a ratio of its own (PPO, CISPO) it
    only drops gradients smaller than e**-50, and a -inf log-prob would otherwise give NaN
    (0 * inf). GSPO floors its sequence's mean instead (`gspo`)."""
    return log_ratio.clamp(min=-EXP_EXACT_UP_TO)


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` up to ``EXP_EXACT_UP_TO``, then its tangent line there: finite for every finite
    ``x``, with a nonzero gradient everywhere (a clamp would have none above its bound)."""
    e = torch.exp(x.clamp(max=EXP_EXACT_UP_TO))
    return torch.where(x > EXP_EXACT_UP_TO, e * (1 + x - EXP_EXACT_UP_TO), e)


POLICY_TERMS = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
