"""GRPO loss formulas against hand computations (expected numbers are written out, not recomputed
with the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.rl.config.trainer import GRPOLossConfig
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.tokens import LossInputError, token_entropy, token_logprobs
from asyncrl.rl.trainer.distill import distill_advantages, topk_reverse_kl
from asyncrl.rl.trainer.loss import (
    group_advantages,
    grpo_loss,
    loss_normalizer,
    overlong_penalties,
    step_advantages,
)

F64 = torch.float64


def t(x, **kw) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, **kw)


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual.to(F64), t(expected), atol=tol, rtol=0)


# --- group advantages --------------------------------------------------------------------------


def test_advantages_centred_without_std():
    adv = group_advantages(t([[1, 2, 3, 6], [0, 0, 1, 1]]), normalize_std=False)
    close(adv, [[-2, -1, 0, 3], [-0.5, -0.5, 0.5, 0.5]])


def test_advantages_divided_by_population_std():
    # [1, 2, 3, 6]: mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5, std 1.8708286933869707
    adv = group_advantages(t([[1, 2, 3, 6], [0, 1, 0, 1]]), eps=0.0)
    close(adv, [[-1.0690449676496976, -0.5345224838248488, 0.0, 1.6035674514745464], [-1, 1, -1, 1]])
    # the default eps only nudges the divisor: 2 / (1.8708286933869707 + 1e-6)
    close(group_advantages(t([[1, 2, 3, 6]]))[0, 0:1], [-1.0690443962216838], tol=1e-12)


def test_equal_rewards_give_exact_zeros_and_no_nan():
    for normalize in (True, False):
        adv = group_advantages(t([[0.1, 0.1, 0.1], [5, 5, 5]]), normalize_std=normalize)
        assert torch.equal(adv, torch.zeros(2, 3, dtype=F64))  # exactly, though 0.1*3/3 != 0.1
        assert torch.equal(group_advantages([[0.7], [2.0, 2.0]], normalize_std=normalize), torch.zeros(3))
    assert torch.equal(group_advantages(torch.full((1, 4), 0.1, dtype=torch.float32), eps=0.0), torch.zeros(1, 4))


def test_advantages_of_ragged_groups_come_out_flat_in_order():
    rewards = [[1.0, 3.0], [2.0, 2.0, 2.0], [0.0, 0.0, 3.0]]
    close(group_advantages(rewards, normalize_std=False), [-1, 1, 0, 0, 0, -1, -1, 2], tol=1e-6)
    # group 3: mean 1, centred [-1, -1, 2], population variance 6 / 3 = 2
    expected = [-1, 1, 0, 0, 0, -0.7071067811865475, -0.7071067811865475, 1.414213562373095]
    close(group_advantages(rewards, eps=0.0), expected, tol=1e-6)
    with pytest.raises(LossInputError):
        group_advantages([[1.0], []])


# --- token log-probs ---------------------------------------------------------------------------

LOGITS = [
    [[0.1, 1.2, -0.3, 0.5], [2.0, -1.0, 0.0, 0.3], [0.7, 0.7, -2.0, 1.5]],
    [[-0.5, 0.0, 0.5, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, -3.0, 0.2, 0.1]],
]
IDS = [[1, 0, 3], [2, 3, 0]]


def manual_logprob(row: list[float], token: int) -> float:
    return row[token] - math.log(sum(math.exp(x) for x in row))


def test_token_logprobs_scores_the_next_token():
    out = token_logprobs(t(LOGITS), torch.tensor(IDS))
    assert out.shape == (2, 2) and out.dtype == torch.float32
    shifted = [[manual_logprob(LOGITS[b][i], IDS[b][i + 1]) for i in range(2)] for b in range(2)]
    close(out, shifted, tol=1e-6)
    # logits at [1, 1] are uniform over 4 tokens: whatever comes next has log(1/4)
    assert out[1, 1].item() == pytest.approx(-1.3862943611198906, abs=1e-6)
    # the unshifted (wrong) reading scores each token by a prediction that already saw it
    unshifted = [[manual_logprob(LOGITS[b][i], IDS[b][i]) for i in range(2)] for b in range(2)]
    assert not torch.allclose(out.to(F64), t(unshifted), atol=1e-3)


def test_token_logprobs_float32_from_bf16_and_chunking_changes_nothing():
    logits = t(LOGITS).to(torch.bfloat16)
    ids = torch.tensor(IDS)
    rounded = logits.to(F64).tolist()  # what bf16 actually holds
    expected = [[manual_logprob(rounded[b][i], IDS[b][i + 1]) for i in range(2)] for b in range(2)]
    for chunk_rows in (1, 2, 5):
        out = token_logprobs(logits, ids, chunk_rows=chunk_rows)
        assert out.dtype == torch.float32
        close(out, expected, tol=1e-6)


def test_token_entropy_in_chunks_equals_the_whole_and_takes_no_gradient():
    logits = torch.randn(2, 7, 11, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    p = torch.softmax(logits.detach(), dim=-1)
    whole = -(p * p.log()).sum(-1)
    for chunk in (1, 3, 7, 100):  # across and beyond row ends
        out = token_entropy(logits, chunk_tokens=chunk)
        assert out.shape == (2, 7) and not out.requires_grad
        close(out, whole.tolist(), tol=1e-6)


def test_token_logprobs_gradient_reaches_logits_but_not_the_last_position():
    logits = t(LOGITS).requires_grad_()
    token_logprobs(logits, torch.tensor(IDS)).sum().backward()
    assert torch.equal(logits.grad[:, -1], torch.zeros(2, 4, dtype=F64))  # predicts past the end
    # d/dlogits of log_softmax[token]: one-hot(token) - softmax. The uniform row [1, 1] scores
    # the NEXT token, IDS[1][2] = 0 (not IDS[1][1] = 3, the unshifted reading).
    close(logits.grad[1, 1], [0.75, -0.25, -0.25, -0.25], tol=1e-6)


def test_token_logprobs_refuses_bad_input():
    logits = t(LOGITS)
    for bad_ids in (
        torch.tensor([[1, 0, 4], [2, 3, 0]]),
        torch.tensor([[1, 0, -1], [2, 3, 0]]),
        torch.tensor([[1, 0], [2, 3]]),
        t(IDS),
    ):
        with pytest.raises(LossInputError):
            token_logprobs(logits, bad_ids)
    with pytest.raises(LossInputError, match="T >= 2"):
        token_logprobs(logits[:, :1], torch.tensor([[1], [2]]))


# --- clipped surrogate -------------------------------------------------------------------------

CFG = GRPOLossConfig()  # eps_low 0.2, eps_high 0.28


def one_token(ratio: float, adv: float, cfg: GRPOLossConfig = CFG):
    """Loss and d loss / d new for a single token with the given ratio and advantage."""
    beh = t([[-1.0]])
    new = (beh + math.log(ratio)).requires_grad_()
    loss, metrics = grpo_loss(new, beh, t([adv]), torch.ones(1, 1, dtype=torch.bool), cfg)
    loss.backward()
    return loss.item(), new.grad.item(), metrics


def test_ratio_inside_the_clip_range():
    loss, grad, m = one_token(1.1, 2.0)
    assert loss == pytest.approx(-2.2) and grad == pytest.approx(-2.2)  # -(r A), d/dnew = -A r
    assert m["ratio_mean"].item() == pytest.approx(1.1)
    assert m["clip_frac_low"].item() == 0 and m["clip_frac_high"].item() == 0


def test_ratio_above_one_plus_eps_high_with_positive_advantage_is_clipped():
    loss, grad, m = one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert m["clip_frac_high"].item() == 1 and m["clip_frac_low"].item() == 0


def test_ratio_below_one_minus_eps_low_with_negative_advantage_is_clipped():
    loss, grad, m = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0  # min(-0.5, -0.8) = -0.8
    assert m["clip_frac_low"].item() == 1 and m["clip_frac_high"].item() == 0


def test_the_other_sides_are_not_clipped():
    loss, grad, _ = one_token(1.5, -1.0)  # min(-1.5, -1.28): the PPO clip leaves this open
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)
    loss, grad, _ = one_token(0.5, 1.0)  # min(0.5, 0.8)
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def padded_batch():
    """Row 0: A=+1, ratios 1.0, 1.1, 1.5 (last clipped). Row 1: A=-2, ratios 0.5 (clipped), 1.2,
    then padding. Row 2: fully masked. Padding holds NaN/inf: it must not matter."""
    nan, inf = math.nan, math.inf
    beh = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, nan], [nan, 0.0, inf]])
    ratios = [[1.0, 1.1, 1.5], [0.5, 1.2, 1.0], [1.0, 1.0, 1.0]]
    new = (beh + t(ratios).log()).nan_to_num(nan=nan, posinf=nan).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    return new, beh, t([1.0, -2.0, 5.0]), mask


def test_token_mean_on_a_padded_batch():
    new, beh, adv, mask = padded_batch()
    loss, m = grpo_loss(new, beh, adv, mask, CFG)
    # terms: -(1.0, 1.1, 1.28) and +(1.6, 2.4); (-3.38 + 4.0) / 5 tokens
    assert loss.item() == pytest.approx(0.124)
    loss.backward()
    close(new.grad, [[-0.2, -0.22, 0.0], [0.0, 0.48, 0.0], [0.0, 0.0, 0.0]])
    assert m["tokens"].item() == 5
    assert m["ratio_mean"].item() == pytest.approx(1.06) and m["ratio_max"].item() == pytest.approx(1.5)
    assert m["clip_frac_low"].item() == pytest.approx(0.2) and m["clip_frac_high"].item() == pytest.approx(0.2)


def test_seq_mean_on_a_padded_batch():
    new, beh, adv, mask = padded_batch()
    loss, _ = grpo_loss(new, beh, adv, mask, GRPOLossConfig(aggregation="seq_mean"))
    # rows: -3.38 / 3 and 4.0 / 2; the fully-masked row is left out of the mean
    assert loss.item() == pytest.approx(0.43666666666666665)
    loss.backward()
    close(new.grad, [[-1 / 6, -1.1 / 6, 0.0], [0.0, 0.6, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("aggregation, normalizer", [("token_mean", 5), ("seq_mean", 2)])
def test_normalizer_makes_micro_batches_add_up(aggregation, normalizer):
    new, beh, adv, mask = padded_batch()
    cfg = GRPOLossConfig(aggregation=aggregation)
    whole, _ = grpo_loss(new, beh, adv, mask, cfg)
    parts = [
        grpo_loss(new[s], beh[s], adv[s], mask[s], cfg, normalizer=normalizer)[0] for s in (slice(0, 1), slice(1, 3))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def test_fully_masked_batch_gives_zero_loss_and_no_nan():
    for aggregation in ("token_mean", "seq_mean"):
        new = t([[math.nan, 1.0]]).requires_grad_()
        loss, m = grpo_loss(
            new,
            t([[math.inf, 0.0]]),
            t([3.0]),
            torch.zeros(1, 2),
            GRPOLossConfig(aggregation=aggregation),
            ref_logprobs=t([[math.nan, 0.0]]),
        )
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(new.grad, torch.zeros(1, 2, dtype=F64))
        assert all(not torch.isnan(v).any() for v in m.values()), m


def test_kl_term_k3():
    new = t([[-1.0, -2.0, 0.0]]).requires_grad_()
    ref = t([[-1.5, -1.0, math.nan]])  # third token is padding
    mask = torch.tensor([[1, 1, 0]])
    loss, m = grpo_loss(new, new.detach(), t([0.0]), mask, GRPOLossConfig(kl_coef=0.1), ref_logprobs=ref)
    # ref - new = -0.5, 1.0: k3 = exp(d) - d - 1 = 0.10653065971263342, 0.7182818284590451
    assert m["kl"].item() == pytest.approx(0.41240624408583926)
    assert loss.item() == pytest.approx(0.041240624408583926)  # A = 0: the surrogate adds nothing
    loss.backward()
    # d k3 / d new = 1 - exp(ref - new), times kl_coef / 2 tokens
    close(new.grad, [[0.01967346701436833, -0.08591409142295225, 0.0]])
    loss0, m0 = grpo_loss(new, new.detach(), t([0.0]), mask, CFG, ref_logprobs=ref)
    assert loss0.item() == 0.0 and m0["kl"].item() == pytest.approx(0.41240624408583926)  # metric only


def test_truncated_importance_weight():
    beh = t([[-1.0], [-1.0], [-1.0]])
    new = (beh + t([[5.0], [1.1], [5.0]]).log()).requires_grad_()
    adv, mask = t([-1.0, -1.0, 1.0]), torch.ones(3, 1)
    loss, m = grpo_loss(new, beh, adv, mask, GRPOLossConfig(tis_cap=2.0))
    # factor min(1, 2 / r) = 0.4, 1, 0.4; terms 0.4 * -5, -1.1, 0.4 * 1.28 (clipped)
    assert loss.item() == pytest.approx((2.0 + 1.1 - 0.512) / 3)
    loss.backward()
    close(new.grad, [[2 / 3], [1.1 / 3], [0.0]])  # min(r, cap) * -A / 3 tokens; clipped: 0
    assert m["tis_frac"].item() == pytest.approx(2 / 3)
    new.grad = None
    plain, _ = grpo_loss(new, beh, adv, mask, CFG)
    assert plain.item() == pytest.approx((5.0 + 1.1 - 1.28) / 3)
    plain.backward()
    close(new.grad, [[5 / 3], [1.1 / 3], [0.0]])


def test_gradient_flows_only_into_new_logprobs():
    new, beh, adv, mask = padded_batch()
    beh, adv = beh.clone().requires_grad_(), adv.clone().requires_grad_()
    ref = t([[-1.0] * 3] * 3, requires_grad=True)
    entropy = t([[0.5, 1.0, 1.5], [2.0, 3.0, 9.0], [9.0, 9.0, 9.0]])
    loss, m = grpo_loss(new, beh, adv, mask, GRPOLossConfig(kl_coef=0.1), ref_logprobs=ref, entropy=entropy)
    loss.backward()
    assert new.grad is not None and beh.grad is None and adv.grad is None and ref.grad is None
    assert m["entropy"].item() == pytest.approx(8.0 / 5)
    assert all(not v.requires_grad for v in m.values())


def test_bad_inputs_and_config_are_refused():
    x, m = t([[0.0, 0.0]]), torch.ones(1, 2)
    with pytest.raises(LossInputError, match="behaviour_logprobs"):
        grpo_loss(x, t([[0.0]]), t([1.0]), m, CFG)
    with pytest.raises(LossInputError, match="advantages"):
        grpo_loss(x, x, t([1.0, 2.0]), m, CFG)
    with pytest.raises(LossInputError, match="ref_logprobs"):
        grpo_loss(x, x, t([1.0]), m, GRPOLossConfig(kl_coef=0.1))
    for bad in (
        dict(eps_low=1.0),
        dict(eps_low=-0.1),
        dict(eps_high=-0.1),
        dict(tis_cap=0.5),
        dict(kl_coef=-1.0),
        dict(aggregation="sum"),
    ):
        with pytest.raises(ValueError):
            GRPOLossConfig(**bad)


# --- far off-policy tokens: |log-ratio| beyond any clamp -------------------------------------


def float64_reference(log_ratio, adv, cfg: GRPOLossConfig, ref_minus_new=None):
    """The papers' formulas written naively in float64 (e**25 is nothing to it): token-mean loss
    and its gradient with respect to the new log-probs."""
    lr = t(log_ratio).requires_grad_()
    r = lr.exp()
    a = t(adv).unsqueeze(1)
    term = torch.minimum(r * a, r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    if cfg.tis_cap is not None:
        term = term * (cfg.tis_cap / r.detach()).clamp(max=1.0)
    loss = -term.mean()
    if ref_minus_new is not None:
        delta = t(ref_minus_new) - (lr - lr.detach())  # d delta / d new = -1
        loss = loss + cfg.kl_coef * (delta.exp() - delta - 1).mean()
    loss.backward()
    return loss.item(), lr.grad


@pytest.mark.parametrize("tis_cap", [None, 2.0])
def test_log_ratio_25_keeps_its_value_and_gradient(tis_cap):
    # rows: A<0 at +25 (the case the truncated weight exists for), A>0 at +25 (clipped), A>0 and
    # A<0 at -25; every term against a float64 reference, in float32 as the trainer computes.
    cfg = GRPOLossConfig(tis_cap=tis_cap)
    log_ratio, adv = [[25.0], [25.0], [-25.0], [-25.0]], [-1.0, 1.0, 1.0, -1.0]
    beh = torch.full((4, 1), -30.0)
    new = (beh + torch.tensor(log_ratio)).requires_grad_()
    loss, m = grpo_loss(new, beh, torch.tensor(adv), torch.ones(4, 1), cfg)
    loss.backward()
    ref_loss, ref_grad = float64_reference(log_ratio, adv, cfg)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(new.grad.to(F64), ref_grad, rtol=1e-5, atol=1e-12)
    if tis_cap is not None:
        # min(r, cap) * -A / 4 tokens: the negative-advantage token still pushes down, bounded
        assert new.grad[0, 0].item() == pytest.approx(2.0 / 4)
        assert m["tis_frac"].item() == pytest.approx(0.5)
    else:
        assert new.grad[0, 0].item() == pytest.approx(math.exp(25) / 4, rel=1e-5)
    assert new.grad[1, 0].item() == 0.0  # clipped: no gradient, as the formula says


def test_k3_gradient_survives_25_nats_on_either_side_of_the_reference():
    cfg = GRPOLossConfig(kl_coef=0.1)
    ref_minus_new = [[-25.0, 25.0]]
    new = torch.tensor([[-1.0, -26.0]], requires_grad=True)
    ref = new.detach() + torch.tensor(ref_minus_new)
    loss, m = grpo_loss(new, new.detach(), torch.zeros(1), torch.ones(1, 2), cfg, ref_logprobs=ref)
    loss.backward()
    ref_loss, ref_grad = float64_reference([[0.0, 0.0]], [0.0], cfg, ref_minus_new=ref_minus_new)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(new.grad.to(F64), ref_grad, rtol=1e-5, atol=1e-12)
    # 25 nats above the reference: d k3 / d new = 1 - e**-25, times 0.1 / 2 tokens (the clamp gave 0)
    assert new.grad[0, 0].item() == pytest.approx(0.05)


def test_log_ratios_past_float32_exp_range_stay_finite_and_keep_their_sign():
    for cfg in (CFG, GRPOLossConfig(tis_cap=2.0), GRPOLossConfig(kl_coef=0.1)):
        beh = torch.tensor([[-300.0, 0.0]])
        new = torch.tensor([[-100.0, -200.0]], requires_grad=True)  # log-ratio +200, ref 200 nats above
        loss, m = grpo_loss(new, beh, torch.tensor([-1.0]), torch.ones(1, 2), cfg, ref_logprobs=torch.zeros(1, 2))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all(), cfg
        assert all(torch.isfinite(v) for v in m.values()), m
        assert new.grad[0, 0].item() > 0  # A < 0: lower the token's probability, never silently 0
        if cfg.tis_cap is not None:
            assert new.grad[0, 0].item() == pytest.approx(2.0 / 2)
        if cfg.kl_coef:
            assert new.grad[0, 1].item() < 0  # 200 nats below the reference: pulled back up


# --- loss variants: each against its paper's formula, written naively in float64 --------------


def variant_batch():
    """Four sequences, log-ratios chosen around GSPO's clip at 0.1 either way: row 0 inside
    (s = e**(0.25 / 3) = 1.087), row 1 above with A > 0 (1.221: clipped), row 2 below with A < 0
    (e**-0.15 = 0.861: clipped), row 3 above with A < 0 (1.649: the side a clip leaves open).
    Padding holds NaN."""
    nan = math.nan
    log_ratio = [[0.05, 0.3, -0.1], [0.2, 0.2, nan], [-0.3, 0.0, nan], [0.5, nan, nan]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    beh = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, nan], [-0.7, -0.1, nan], [-2.0, nan, nan]])
    return log_ratio, mask, beh, t([1.0, 1.0, -2.0, -1.0])


def new_from(log_ratio, beh, mask):
    return torch.where(mask.bool(), beh.nan_to_num() + t(log_ratio).nan_to_num(), math.nan).requires_grad_()


def gspo_reference(log_ratio, mask, adv, lo, hi, per_token_weight: bool):
    """GSPO's objective (Zheng et al. 2025) on the sequence ratio itself, no token trick:
    J = -mean_i min(s_i A_i, clip(s_i, 1 - lo, 1 + hi) A_i), s_i = exp(mean of valid log r).
    ``per_token_weight``: each sequence's term counted once per valid token, / all tokens."""
    lr = t(log_ratio).nan_to_num().requires_grad_()
    valid = mask.bool()
    n = valid.sum(1)
    s = (torch.where(valid, lr, 0.0).sum(1) / n).exp()
    a = adv.to(F64)
    j = torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a)
    loss = -(j * n).sum() / n.sum() if per_token_weight else -j.mean()
    loss.backward()
    return loss.item(), torch.where(valid, lr.grad, 0.0)


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_gspo_matches_the_sequence_level_objective(aggregation):
    log_ratio, mask, beh, adv = variant_batch()
    cfg = GRPOLossConfig(policy_loss="gspo", gspo_eps_low=0.1, gspo_eps_high=0.1, aggregation=aggregation)
    new = new_from(log_ratio, beh, mask)
    loss, m = grpo_loss(new, beh, adv, mask, cfg)
    loss.backward()
    ref_loss, ref_grad = gspo_reference(log_ratio, mask, adv, 0.1, 0.1, aggregation == "token_mean")
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(torch.where(mask.bool(), new.grad, 0.0), ref_grad, rtol=0, atol=1e-12)
    if aggregation == "seq_mean":
        # by hand: row 0 unclipped, d/dnew_t = -s A / 3 tokens / 4 sequences; rows 1, 2 clipped
        # whole (no token keeps a gradient, though row 1's ratios lie inside the token clip of
        # ppo_clip); row 3: -(e**0.5 * -1) / 1 token / 4
        s0 = math.exp(0.25 / 3)
        close(new.grad[0], [-s0 / 12] * 3)
        assert torch.equal(new.grad[1:3], torch.zeros(2, 3, dtype=F64))
        assert new.grad[3, 0].item() == pytest.approx(math.exp(0.5) / 4)
        assert loss.item() == pytest.approx(-(s0 + 1.1 - 1.8 - math.exp(0.5)) / 4)
    # metrics: the sequence ratio; clipped tokens are those of rows 1 and 2 (2 + 2 of 8)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5))
    assert m["clip_frac_high"].item() == pytest.approx(2 / 8) and m["clip_frac_low"].item() == pytest.approx(2 / 8)


def test_gspo_token_form_takes_per_token_advantages():
    # with A_it = A_i broadcast the token form is GSPO itself; with A varying inside a sequence,
    # each token's gradient is s_i * A_it / |y_i| (GSPO-token, s_i unclipped)
    log_ratio, mask, beh, _ = variant_batch()
    cfg = GRPOLossConfig(policy_loss="gspo", gspo_eps_low=0.7, gspo_eps_high=0.7, aggregation="seq_mean")
    per_token = t([[1.0, -1.0, 2.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    new = new_from(log_ratio, beh, mask)
    loss, _ = grpo_loss(new, beh, per_token, mask, cfg)
    loss.backward()
    s = [math.exp(0.25 / 3), math.exp(0.2), 1.0, math.exp(0.5)]
    expected = [
        [-s[0] * a / 3 / 4 for a in (1.0, -1.0, 2.0)],
        [-s[1] * 0.5 / 2 / 4] * 2 + [0.0],
        [0.0] * 3,
        [-s[3] * 3.0 / 4, 0.0, 0.0],
    ]
    close(torch.where(mask.bool(), new.grad, 0.0), expected, tol=1e-12)


@pytest.mark.parametrize("low", [-80.0, -math.inf])
def test_gspo_floors_the_sequence_ratio_after_its_mean_not_each_token(low):
    """One token of a 100-token sequence far below its sampling log-prob (a log-ratio of -80), or
    given probability 0 by the trainer (-inf). GSPO's ratio is the mean over the sequence, by hand
    exp(-80 / 100) = 0.4493 and exp(-inf) = 0 (floored at e**-50); every token's gradient is
    ``-s * A / 100``, finite (the -inf token's 0). Seen: each token was floored at -50 before the
    mean, giving exp(-50 / 100) = 0.6065 for both, and every token's gradient with it."""
    length, at = 100, 7
    beh = torch.full((1, length), -1.0, dtype=F64)
    new = beh.clone()
    new[0, at] = beh[0, at] + low
    new.requires_grad_()
    cfg = GRPOLossConfig(policy_loss="gspo", aggregation="seq_mean")  # the paper's clip, 3e-4 / 4e-4
    loss, m = grpo_loss(new, beh, t([1.0]), torch.ones(1, length), cfg)  # A > 0: s < 1 - eps is not clipped
    loss.backward()
    s = math.exp(-0.8) if low == -80.0 else math.exp(-50.0)
    assert m["ratio_max"].item() == pytest.approx(s, rel=1e-12)
    assert loss.item() == pytest.approx(-s, rel=1e-12)  # seq_mean of one sequence: -(s * A)
    assert torch.isfinite(new.grad).all()
    expected = [-s / length] * length
    if low == -math.inf:  # d s / d new there is s / 100 with s = 0: none
        expected[at] = 0.0
    close(new.grad[0], expected, tol=1e-15)


def cispo_reference(log_ratio, mask, beh, adv, lo, hi):
    """CISPO (MiniMax-M1): J = -(1 / tokens) sum sg(clip(r, 1 - lo, 1 + hi)) A log pi,
    written on log pi itself: its gradient is the paper's; its value is not ours (see _cispo)."""
    valid = mask.bool()
    logp = (beh.nan_to_num() + t(log_ratio).nan_to_num()).requires_grad_()
    r = (logp - beh.nan_to_num()).exp()
    w = r.clamp(1 - lo, 1 + hi).detach()
    loss = -torch.where(valid, w * adv.unsqueeze(1) * logp, 0.0).sum() / valid.sum()
    loss.backward()
    value = -torch.where(valid, w * adv.unsqueeze(1), 0.0).sum() / valid.sum()
    return value.item(), torch.where(valid, logp.grad, 0.0)


@pytest.mark.parametrize("eps_low", [1.0, 0.2])
def test_cispo_weights_every_token_by_the_clipped_detached_ratio(eps_low):
    log_ratio, mask, beh, adv = variant_batch()
    cfg = GRPOLossConfig(policy_loss="cispo", cispo_eps_low=eps_low, cispo_eps_high=0.28)
    new = new_from(log_ratio, beh, mask)
    loss, m = grpo_loss(new, beh, adv, mask, cfg)
    loss.backward()
    ref_value, ref_grad = cispo_reference(log_ratio, mask, beh, adv, eps_low, 0.28)
    assert loss.item() == pytest.approx(ref_value, abs=1e-12)
    torch.testing.assert_close(torch.where(mask.bool(), new.grad, 0.0), ref_grad, rtol=0, atol=1e-12)
    # by hand, 8 tokens: row 3's e**0.5 = 1.65 is truncated to 1.28 and keeps its gradient (PPO's
    # clip leaves that side open, but row 0's token at e**0.3 = 1.35, A > 0, PPO would drop)
    assert new.grad[3, 0].item() == pytest.approx(1.28 / 8)
    assert new.grad[0, 1].item() == pytest.approx(-1.28 / 8)
    # row 2's e**-0.3 = 0.741: below 0.8 only when there is a lower bound
    low_w = 0.8 if eps_low == 0.2 else math.exp(-0.3)
    assert new.grad[2, 0].item() == pytest.approx(2 * low_w / 8)
    assert m["clip_frac_high"].item() == pytest.approx(2 / 8)  # e**0.3, e**0.5
    assert m["clip_frac_low"].item() == pytest.approx(1 / 8 if eps_low == 0.2 else 0.0)


def dr_grpo_reference(log_ratio, mask, adv, budget):
    """Dr. GRPO (Liu et al. 2025; their code's constant normaliser): the PPO surrogate
    summed over each sequence's tokens, / MAX_TOKENS, then averaged over the sequences."""
    lr = t(log_ratio).nan_to_num().requires_grad_()
    r = lr.exp()
    a = adv.unsqueeze(1)
    term = torch.minimum(r * a, r.clamp(0.8, 1.28) * a)
    loss = -(torch.where(mask.bool(), term, 0.0).sum(1) / budget).mean()
    loss.backward()
    return loss.item(), torch.where(mask.bool(), lr.grad, 0.0)


def test_dr_grpo_divides_by_a_constant_token_budget():
    log_ratio, mask, beh, adv = variant_batch()
    cfg = GRPOLossConfig(aggregation="fixed_tokens", token_budget=16)
    new = new_from(log_ratio, beh, mask)
    loss, _ = grpo_loss(new, beh, adv, mask, cfg)
    loss.backward()
    ref_loss, ref_grad = dr_grpo_reference(log_ratio, mask, adv, 16)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(torch.where(mask.bool(), new.grad, 0.0), ref_grad, rtol=0, atol=1e-12)
    # a token's weight is 1 / (4 sequences x 16), whatever its sequence's length: row 0 (3 tokens)
    # and row 3 (1 token) alike
    assert new.grad[0, 0].item() == pytest.approx(-math.exp(0.05) / 64)
    assert new.grad[3, 0].item() == pytest.approx(math.exp(0.5) / 64)
    assert loss_normalizer(cfg, n_tokens=8, n_seqs=4) == 64
    with pytest.raises(ValueError, match="token_budget"):
        grpo_loss(new, beh, adv, mask, GRPOLossConfig(aggregation="fixed_tokens"))


@pytest.mark.parametrize(
    "cfg",
    [
        GRPOLossConfig(aggregation="fixed_tokens", token_budget=16),
        GRPOLossConfig(policy_loss="gspo", aggregation="seq_mean"),
        GRPOLossConfig(policy_loss="cispo"),
    ],
)
def test_variants_add_up_over_micro_batches(cfg):
    log_ratio, mask, beh, adv = variant_batch()
    new = new_from(log_ratio, beh, mask)
    whole, _ = grpo_loss(new, beh, adv, mask, cfg)
    norm = loss_normalizer(cfg, n_tokens=float(mask.sum()), n_seqs=4.0)
    parts = [grpo_loss(new[s], beh[s], adv[s], mask[s], cfg, normalizer=norm)[0] for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-12)


def test_dapo_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: no penalty up to 6 tokens, then -1/4 a token, -1 from 10 on
    cfg = GRPOLossConfig(overlong_buffer=4, overlong_max_tokens=10)
    assert overlong_penalties([0, 6, 7, 9, 10, 12], cfg) == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    half = GRPOLossConfig(overlong_buffer=4, overlong_max_tokens=10, overlong_penalty=0.5)
    assert overlong_penalties([8], half) == [-0.25]
    assert overlong_penalties([50], GRPOLossConfig()) == [0.0]  # off by default
    with pytest.raises(ValueError, match="overlong_max_tokens"):
        overlong_penalties([3], GRPOLossConfig(overlong_buffer=4))  # L_max unresolved


def test_overlong_penalty_enters_the_advantages():
    # equal task rewards: without shaping no signal; with it the 10-token completion is pushed
    # down against the 4-token one (rewards 1 + 0 and 1 - 1, mean-centred: +0.5, -0.5)
    group = RolloutGroup(
        prompt_id=0,
        prompt_ids=[1],
        completion_ids=[[2] * 4, [2] * 10],
        behaviour_logprobs=[[0.0] * 4, [0.0] * 10],
        rewards=[1.0, 1.0],
        version=0,
    )
    assert step_advantages([group], GRPOLossConfig(), normalize_std=False).tolist() == [0.0, 0.0]
    shaped = step_advantages([group], GRPOLossConfig(overlong_buffer=4, overlong_max_tokens=10), normalize_std=False)
    assert shaped.tolist() == [0.5, -0.5]


def test_variant_configs_refuse_bad_values():
    for bad in (
        dict(policy_loss="grpo"),
        dict(policy_loss="gspo", tis_cap=2.0),
        dict(policy_loss="cispo", tis_cap=2.0),
        dict(gspo_eps_low=1.5),
        dict(cispo_eps_high=-1.0),
        dict(token_budget=-1),
        dict(aggregation="token_sum"),
        dict(overlong_buffer=8, overlong_max_tokens=4),
        dict(overlong_penalty=-1.0),
    ):
        with pytest.raises(ValueError):
            GRPOLossConfig(**bad)


# --- on-policy distillation: the teacher's reverse KL as a per-token advantage ---------------


def test_distillation_advantage_against_its_formula():
    # A_it = A_i - c * (log mu - log p_T), the PPO surrogate on it, token mean; by hand and in float64
    log_ratio, mask, beh, adv = variant_batch()
    teacher = beh.nan_to_num() + t([[0.5, -1.0, 0.0], [0.2, 0.0, 0.0], [-2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    teacher = torch.where(mask.bool(), teacher, math.nan)
    cfg = GRPOLossConfig(distill_coef=0.5)
    new = new_from(log_ratio, beh, mask)
    loss, m = grpo_loss(new, beh, adv, mask, cfg, teacher_logprobs=teacher)
    loss.backward()
    per_token = distill_advantages(adv, beh, teacher, 0.5)
    close(
        torch.where(mask.bool(), per_token, 0.0),
        [[1.25, 0.5, 1.0], [1.1, 1.0, 0.0], [-3.0, -1.5, 0.0], [-1.0, 0.0, 0.0]],
    )
    lr = t(log_ratio).nan_to_num().requires_grad_()
    r = lr.exp()
    a = per_token.nan_to_num()
    ref = -torch.where(mask.bool(), torch.minimum(r * a, r.clamp(0.8, 1.28) * a), 0.0).sum() / 8
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    torch.testing.assert_close(
        torch.where(mask.bool(), new.grad, 0.0), torch.where(mask.bool(), lr.grad, 0.0), rtol=0, atol=1e-12
    )
    # the teacher likes row 0's first token more than the sampler did: a larger advantage there
    assert new.grad[0, 0].item() == pytest.approx(-1.25 * math.exp(0.05) / 8)
    # distill_kl: mean over valid tokens of log mu - log p_T = (-0.5 + 1 - 0.2 + 2 - 1) / 8
    assert m["distill_kl"].item() == pytest.approx(1.3 / 8)
    with pytest.raises(LossInputError, match="teacher_logprobs"):
        grpo_loss(new, beh, adv, mask, cfg)


def test_distillation_without_a_task_reward_pulls_towards_the_teacher():
    # zero task advantage: the only signal is the teacher's; a token the teacher rates higher than
    # the sampler did is pushed up (negative d loss / d new), one it rates lower is pushed down
    beh = t([[-1.0, -1.0]])
    new = beh.clone().requires_grad_()
    loss, _ = grpo_loss(
        new, beh, t([0.0]), torch.ones(1, 2), GRPOLossConfig(distill_coef=1.0), teacher_logprobs=t([[-0.2, -3.0]])
    )
    loss.backward()
    close(new.grad, [[-0.8 / 2, 2.0 / 2]])


# --- on-policy distillation with the teacher's top-K: the K+1-bucket reverse KL in the loss --------


def coarsened_kl(student: list[float], teacher: list[float], ids: list[int]) -> float:
    """KL(s || t) between the two distributions coarsened to ``ids`` + one bucket for the rest,
    written out as a sum (probabilities, not log-probs)."""
    s_rest, t_rest = 1.0 - sum(student[i] for i in ids), 1.0 - sum(teacher[i] for i in ids)
    kl = sum(student[i] * math.log(student[i] / teacher[i]) for i in ids)
    return kl + s_rest * math.log(s_rest / t_rest)


@pytest.mark.parametrize("k", [1, 3, 7], ids=["top1", "top3", "whole-vocab"])
def test_topk_reverse_kl_is_the_coarsened_kl_a_lower_bound_of_the_full_one_and_equal_at_the_vocab(k):
    torch.manual_seed(k)
    vocab = 7
    s_logits, t_logits = torch.randn(5, vocab, dtype=F64) * 2, torch.randn(5, vocab, dtype=F64) * 2
    s_lp, t_lp = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    ids = torch.topk(t_lp, k, -1).indices  # the teacher's top-K
    got = topk_reverse_kl(s_lp.gather(-1, ids), t_lp.gather(-1, ids))
    full = (s_lp.exp() * (s_lp - t_lp)).sum(-1)
    for n in range(5):
        s, tt = s_lp[n].exp().tolist(), t_lp[n].exp().tolist()
        want = coarsened_kl(s, tt, ids[n].tolist()) if k < vocab else full[n].item()
        assert got[n].item() == pytest.approx(want, rel=1e-10, abs=1e-6 if k == vocab else 1e-12)
    assert (got <= full + 1e-12).all() and (got >= 0).all()
    if k == vocab:
        torch.testing.assert_close(got, full, rtol=0, atol=1e-6)  # the floored rests add < 1e-6

    # its gradient through the student's logits: autograd against finite differences, in float64
    def of_logits(logits):
        lp = torch.log_softmax(logits, -1)
        return topk_reverse_kl(lp.gather(-1, ids), t_lp.gather(-1, ids))

    if k < vocab:  # at the whole vocabulary both rests sit on the floor: no gradient to check there
        assert torch.autograd.gradcheck(of_logits, (s_logits.clone().requires_grad_(),))
    else:  # the full reverse KL's own gradient
        x = s_logits.clone().requires_grad_()
        of_logits(x).sum().backward()
        y = s_logits.clone().requires_grad_()
        lp = torch.log_softmax(y, -1)
        (lp.exp() * (lp - t_lp)).sum().backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-9)


def test_the_top_k_term_enters_the_loss_and_leaves_the_advantages_as_they_are():
    # two sequences of two tokens, vocab 4, K 2; sequence 1's second token is padding (NaN there)
    torch.manual_seed(0)
    s_logits = torch.randn(2, 2, 4, dtype=F64, requires_grad=True)
    t_lp = torch.log_softmax(torch.randn(2, 2, 4, dtype=F64), -1)
    ids = torch.topk(t_lp, 2, -1).indices
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    beh = t([[-1.0, -1.2], [-0.7, math.nan]])
    new = beh.nan_to_num().clone().requires_grad_()
    s_topk = torch.log_softmax(s_logits, -1).gather(-1, ids)
    teacher = torch.where(mask.bool()[..., None], t_lp.gather(-1, ids), math.nan)
    cfg = GRPOLossConfig(distill_coef=0.5)
    adv = t([0.0, 0.0])  # a uniform group: no task signal, the teacher's term alone
    loss, m = grpo_loss(new, beh, adv, mask, cfg, student_topk=s_topk, teacher_topk=teacher)
    loss.backward()
    kls = [
        coarsened_kl(torch.softmax(s_logits[b, j], -1).tolist(), t_lp[b, j].exp().tolist(), ids[b, j].tolist())
        for b, j in ((0, 0), (0, 1), (1, 0))
    ]
    assert m["distill_kl"].item() == pytest.approx(sum(kls) / 3, rel=1e-12)
    assert m["pg_loss"].item() == 0.0 and loss.item() == pytest.approx(0.5 * sum(kls) / 3, rel=1e-12)
    assert new.grad.abs().max() == 0.0  # the advantages stay the task's (0): no policy-term gradient
    assert s_logits.grad[0].abs().max() > 1e-3 and s_logits.grad[1, 1].abs().max() == 0.0  # padding: none
    # with a task advantage both terms add
    loss2, m2 = grpo_loss(new, beh, t([1.0, -1.0]), mask, cfg, student_topk=s_topk.detach(), teacher_topk=teacher)
    assert loss2.item() == pytest.approx(m2["pg_loss"].item() + 0.5 * sum(kls) / 3, rel=1e-12)
    with pytest.raises(LossInputError, match="come together"):
        grpo_loss(new, beh, adv, mask, cfg, teacher_topk=teacher)
