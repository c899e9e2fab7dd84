"""Off-policy corrections of GRPO's loss (``--trainer.loss.*``): what the sampler's policy ``mu``
and the policy before the step ``pi_prox`` say about each token, which tokens and completions leave
the policy term, and with decoupled PPO each token's behaviour weight. ``loss.py`` applies them;
docs/algorithms.md has the formulas and their sources.

Conventions (each held by a test in ``tests/test_corrections.py``):

* The behaviour log-ratio of a token is ``log k = log pi_prox - log mu``, detached. pi_prox is the
  trainer's weights before the step. The trainer takes one optimiser step a batch, so every
  micro-batch's forward runs with exactly those weights: pi_prox is that forward's log-prob,
  detached ('recompute' and no decoupling alike), or AReaL's log-linear approximation by the
  token's version lag ('loglinear').
* A sequence-level ratio is the geometric mean ``g = exp(mean over the completion's policy tokens
  of log k)``, never the product: a product of 8k ratios near 1 collapses to 0 or overflows where
  the mean stays near 1.
* Every band tests ``k`` (or ``g``), never ``1 / k``, in log space on the unclamped log-ratio:
  ``log lo <= log k <= log hi``. OPSM's one-sided test ``mean log(mu / pi_prox) > delta`` is
  ``g < e**-delta``.
* A mask is an indicator: inside its band a token keeps the weight the policy term gives it (``pi
  / mu`` through PPO's ratio, or the behaviour weight with decoupling), applied once.
* The behaviour weight is detached (no gradient flows through ``k``) and computed as ``exp(min(log
  k, 50))``: e**50 bounds it, finite in float32; a token the trainer gives probability 0 (``log k
  = -inf``) weighs 0. A NaN log-ratio (both log-probs infinite) masks its token, and its
  completion wherever a sequence-level option is on.
* Masked tokens stay in the normaliser (the batch's token or sequence count before masking, as
  AReaL does): masking removes a token's contribution without scaling up the others', and the
  normaliser stays what `loss_normalizer` computed from the batch before any forward, which is
  what lets micro-batches and trainer ranks add up to the whole batch's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncrl.rl.config.trainer import GRPOLossConfig
from asyncrl.rl.scoring.tokens import LossInputError
from asyncrl.rl.trainer.policy_terms import EXP_EXACT_UP_TO

LAG_KEYS = ("0", "1", "2", "3", "4", "5", "6", "7", "8+")
"""The step record's version-lag buckets: a token's lag, a completion's oldest token's."""
LENGTH_EDGES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Upper ends of the completion-length buckets (policy tokens); a last bucket takes the rest."""
LENGTH_KEYS = tuple(f"{lo + 1}-{hi}" for lo, hi in zip((0, *LENGTH_EDGES[:-1]), LENGTH_EDGES)) + (
    f"{LENGTH_EDGES[-1] + 1}+",
)
ROWS = len(LAG_KEYS) + len(LENGTH_KEYS)
SUM_COLUMNS = 6
"""`tally` columns added across micro-batches and ranks: tokens, masked tokens, tokens of a finite
ratio, their ratios' sum, sequences, masked sequences. The last two are maxima: the ratio's max and
minus its min."""


@dataclass
class OffPolicy:
    """What the corrections decided for a ``[B, L]`` batch (every tensor detached)."""

    prox: torch.Tensor
    """log pi_prox of each token (0 at padding)."""
    log_k: torch.Tensor
    """The behaviour log-ratio ``log pi_prox - log mu`` (0 at padding; NaN where undefined)."""
    keep: torch.Tensor
    """Valid tokens that stay in the policy term."""
    weight: torch.Tensor | None
    """With decoupling, each kept token's behaviour weight (0 elsewhere); None without."""


def off_policy(
    new_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    config: GRPOLossConfig,
    token_lag: torch.Tensor | None,
) -> OffPolicy:
    """The corrections of ``config`` for one batch: ``adv`` is ``[B, L]`` (0 at padding),
    ``token_lag`` each token's version lag (the trainer's version minus the token's; needed by
    'loglinear' only)."""
    with torch.no_grad():
        new = torch.where(valid, new_logprobs.detach(), 0.0)
        mu = torch.where(valid, behaviour_logprobs.detach().to(new.dtype), 0.0)
        prox = _proximal(new, mu, valid, config, token_lag)
        log_k = torch.where(valid, prox - mu, 0.0)
        keep = valid & ~torch.isnan(log_k)
        if config.token_mask is not None:
            keep &= _in_band(log_k, config.token_mask)
        sequence_level = config.seq_mask is not None or config.seq_tis_cap is not None or config.opsm_delta is not None
        log_g = _log_geometric_mean(log_k, valid)
        if sequence_level:
            keep &= ~torch.isnan(log_g)
        if config.seq_mask is not None:
            keep &= _in_band(log_g, config.seq_mask)
        if config.opsm_delta is not None:
            # DeepSeek-V3.2: mean log(mu / pi_old) > delta, pi_old the policy before the step
            keep &= ~((adv < 0) & (-log_g > config.opsm_delta))
        weight = None
        if config.decoupled != "off":
            weight = torch.where(keep, _behaviour_weight(log_k, log_g, config), 0.0)
        return OffPolicy(prox, log_k, keep, weight)


def _proximal(
    new: torch.Tensor, mu: torch.Tensor, valid: torch.Tensor, config: GRPOLossConfig, token_lag: torch.Tensor | None
) -> torch.Tensor:
    """log pi_prox: the forward's own log-prob, or with 'loglinear' AReaL's interpolation between
    mu (lag 0: the sampler had the trainer's weights) and pi (the policy after this step), ``alpha =
    (v_prox - v_mu) / (v_pi - v_mu) = lag / (lag + 1)`` with ``v_prox`` the trainer's version and
    ``v_pi`` the step's result, one more."""
    if config.decoupled != "loglinear":
        return new
    if token_lag is None:
        raise LossInputError("decoupled loglinear needs token_lag: each token's version lag")
    lag = token_lag.to(new.dtype).clamp(min=0)  # a token newer than the weights (no run makes one): on-policy
    alpha = lag / (lag + 1)
    # where(): at alpha 0 the sampler's log-prob itself, so that mu = -inf gives -inf, not NaN
    return torch.where(valid & (alpha > 0), mu + alpha * (new - mu), mu)


def _log_geometric_mean(log_k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the mean of each sequence's valid log-ratios (0 for a sequence without any)."""
    return log_k.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)


def _in_band(log_x: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    lo, hi = band
    log_lo = math.log(lo) if lo > 0 else -math.inf
    log_hi = math.log(hi) if hi > 0 else -math.inf
    return (log_x >= log_lo) & (log_x <= log_hi)  # NaN is in no band


def _behaviour_weight(log_k: torch.Tensor, log_g: torch.Tensor, config: GRPOLossConfig) -> torch.Tensor:
    """Decoupled PPO's detached weight of each token: ``k``, or ``min(k, tis_cap)``, or its
    completion's ``min(g, seq_tis_cap)``."""
    if config.seq_tis_cap is not None:
        return torch.exp(log_g.clamp(max=math.log(config.seq_tis_cap))).expand_as(log_k)
    cap = math.log(config.tis_cap) if config.tis_cap is not None else EXP_EXACT_UP_TO
    return torch.exp(log_k.clamp(max=cap))


# --- what the corrections did, for the step record ---------------------------------------------


@torch.no_grad()
def tally(op: OffPolicy, valid: torch.Tensor, token_lag: torch.Tensor | None) -> torch.Tensor:
    """``[ROWS, 8]`` float64 counts of one micro-batch: per version-lag bucket (`LAG_KEYS`: a
    token's own lag, a sequence's oldest token's; left empty without ``token_lag``), then per
    completion-length bucket (`LENGTH_KEYS`, by the completion's policy tokens), the tokens,
    masked tokens, tokens of a finite ratio ``k``, the sum of those ``k``, sequences, masked
    sequences (none of their tokens kept), the largest ``k`` and minus the smallest. Add two
    tallies with `merge`."""
    out = empty_tally(valid.device)
    n = valid.sum(dim=1)
    has = n > 0
    k = torch.exp(op.log_k.double())
    finite = valid & torch.isfinite(k)
    masked_seq = has & ~(op.keep & valid).any(dim=1)
    lengths = len(LAG_KEYS) + torch.bucketize(n, torch.tensor(LENGTH_EDGES, device=n.device))
    _add(out, lengths.unsqueeze(1).expand_as(valid), lengths, valid, op.keep, finite, k, has, masked_seq)
    if token_lag is not None:
        last = len(LAG_KEYS) - 1
        token_rows = token_lag.clamp(0, last)
        seq_rows = torch.where(valid, token_lag, -1).amax(dim=1).clamp(0, last)
        _add(out, token_rows, seq_rows, valid, op.keep, finite, k, has, masked_seq)
    return out


def empty_tally(device: torch.device) -> torch.Tensor:
    """The tally of nothing: no tokens, extremes at -inf."""
    out = torch.zeros(ROWS, SUM_COLUMNS + 2, dtype=torch.float64, device=device)
    out[:, SUM_COLUMNS:] = -math.inf
    return out


def _add(out, token_rows, seq_rows, valid, keep, finite, k, has, masked_seq) -> None:
    def count(rows: torch.Tensor, where: torch.Tensor, column: int, values: torch.Tensor | None = None) -> None:
        add = where[where].double() if values is None else values[where]
        out[:, column].index_add_(0, rows[where], add)

    count(token_rows, valid, 0)
    count(token_rows, valid & ~keep, 1)
    count(token_rows, finite, 2)
    count(token_rows, finite, 3, k)
    count(seq_rows, has, 4)
    count(seq_rows, masked_seq, 5)
    out[:, 6].scatter_reduce_(0, token_rows[finite], k[finite], reduce="amax")
    out[:, 7].scatter_reduce_(0, token_rows[finite], -k[finite], reduce="amax")


def merge(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Two tallies as one: counts added, extremes kept."""
    if a is None:
        return b
    counts = a[:, :SUM_COLUMNS] + b[:, :SUM_COLUMNS]
    return torch.cat([counts, torch.maximum(a[:, SUM_COLUMNS:], b[:, SUM_COLUMNS:])], dim=1)


def tally_metrics(t: torch.Tensor) -> dict[str, object]:
    """The step record's fields of a step's whole tally (``TrainMetrics``): the shares of tokens
    and sequences masked, ``all_masked`` (1 when the step had policy tokens and masked every one:
    its policy term was 0), the behaviour ratio's mean, min and max, and each of them per lag
    and per length bucket that holds a token."""
    t = t.cpu()
    lengths = t[len(LAG_KEYS) :]
    whole = torch.cat([lengths[:, :SUM_COLUMNS].sum(0), lengths[:, SUM_COLUMNS:].amax(0)])
    out: dict[str, object] = {
        "masked_token_frac": _share(whole[1], whole[0]),
        "masked_seq_frac": _share(whole[5], whole[4]),
        "all_masked": float(whole[0] > 0 and whole[1] == whole[0]),
    }
    out.update({f"behaviour_{k}": v for k, v in _ratio(whole).items()})
    out["correction_by_lag"] = _buckets(t[: len(LAG_KEYS)], LAG_KEYS)
    out["correction_by_length"] = _buckets(lengths, LENGTH_KEYS)
    return out


def _buckets(rows: torch.Tensor, keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    return {
        key: {
            "tokens": float(row[0]),
            "masked_token_frac": _share(row[1], row[0]),
            "sequences": float(row[4]),
            "masked_seq_frac": _share(row[5], row[4]),
            **_ratio(row),
        }
        for key, row in zip(keys, rows)
        if row[0] > 0
    }


def _ratio(row: torch.Tensor) -> dict[str, float]:
    if not row[2] > 0:
        return {}
    return {"ratio_mean": float(row[3] / row[2]), "ratio_min": float(-row[7]), "ratio_max": float(row[6])}


def _share(part: torch.Tensor, whole: torch.Tensor) -> float:
    return float(part / whole) if whole > 0 else 0.0
