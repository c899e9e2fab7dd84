"""Off-policy corrections of GRPO's loss (``trainer/corrections.py``): decoupled PPO, token and
sequence masks, sequence-level truncation, DeepSeek's OPSM. Each against its paper's formula
written naively in float64 (value and gradient), with the numbers that matter also by hand; then
the conventions of docs/algorithms.md, each pinned by a test; then the step record's tally."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.rl.config.parse import ConfigError, parse_overrides
from asyncrl.rl.config.trainer import GRPOLossConfig
from asyncrl.rl.scoring.tokens import LossInputError
from asyncrl.rl.trainer.corrections import LENGTH_KEYS, empty_tally, merge, tally_metrics
from asyncrl.rl.trainer.loss import grpo_loss, loss_normalizer

F64 = torch.float64


def t(x, **kw) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, **kw)


def close(actual: torch.Tensor, expected, tol: float = 1e-12) -> None:
    torch.testing.assert_close(
        actual.to(F64), t(expected) if not torch.is_tensor(expected) else expected.to(F64), atol=tol, rtol=0
    )


def batch():
    """Four completions of up to three tokens, behaviour log-ratios ``log k`` chosen around the
    bands below: row 0 inside everything (k 1.05, 0.9, 1.2), row 1 with one token far above
    (k 6), row 2 with one far below (k 0.3), row 3 one token (k 2). Padding holds NaN."""
    nan = math.nan
    log_k = [
        [math.log(1.05), math.log(0.9), math.log(1.2)],
        [0.1, math.log(6.0), nan],
        [math.log(0.3), 0.0, nan],
        [math.log(2.0), nan, nan],
    ]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    beh = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, nan], [-0.7, -0.1, nan], [-2.0, nan, nan]])
    adv = t([1.0, -1.0, 2.0, -0.5])
    return log_k, mask, beh, adv


def new_from(log_k, beh, mask) -> torch.Tensor:
    """The trainer's log-probs: ``mu + log k`` on valid tokens, NaN elsewhere (it must not matter)."""
    return torch.where(mask, beh.nan_to_num() + t(log_k).nan_to_num(), math.nan).requires_grad_()


def reference(log_k, mask, beh, adv, *, prox_shift=None, keep=None, weight=None, eps=(0.2, 0.28), normalizer=None):
    """The decoupled PPO objective (AReaL, Fu et al. 2025, eq. 5) written naively in float64:
    ``-sum keep * w * min(rho A, clip(rho) A) / N`` with ``rho = pi / pi_prox``, ``pi_prox =
    pi - prox_shift`` held constant (0: the policy before the step, which the step's forward runs
    with), ``w`` the behaviour weight (default ``k = pi_prox / mu``), N the valid tokens.
    Returns the loss and d loss / d log pi (0 off the mask)."""
    lp = (beh.nan_to_num() + t(log_k).nan_to_num()).requires_grad_()
    shift = torch.zeros_like(lp) if prox_shift is None else prox_shift
    prox = lp.detach() - shift
    rho = torch.exp(lp - prox)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    term = torch.minimum(rho * a, rho.clamp(1 - eps[0], 1 + eps[1]) * a)
    w = torch.exp(prox - beh.nan_to_num()) if weight is None else weight
    term = term * w
    keep = mask if keep is None else keep & mask
    n = mask.sum() if normalizer is None else normalizer
    loss = -torch.where(keep, term, 0.0).sum() / n
    loss.backward()
    return loss.item(), torch.where(mask, lp.grad, 0.0)


def run(cfg: GRPOLossConfig, log_k=None, mask=None, beh=None, adv=None, token_lag=None, **kw):
    default = batch()
    log_k = default[0] if log_k is None else log_k
    mask = default[1] if mask is None else mask
    beh = default[2] if beh is None else beh
    adv = default[3] if adv is None else adv
    new = new_from(log_k, beh, mask)
    loss, metrics = grpo_loss(new, beh, adv, mask, cfg, token_lag=token_lag, with_tally=True, **kw)
    loss.backward()
    return loss.item(), torch.where(mask, new.grad, 0.0), metrics


# --- decoupled PPO ---------------------------------------------------------------------------


def test_decoupled_recompute_is_areal_eq5_and_its_clip_never_acts_in_one_step():
    """pi_prox is the policy before the step; with one optimiser step a batch that is the policy
    the forward runs with, so rho = 1 (never clipped) and each token's gradient is its behaviour
    weight k times -A / N. Here row 1 has A > 0: its k = 6 token pushes with 6 where PPO against
    mu clips it (no gradient)."""
    log_k, mask, beh, _ = batch()
    adv = t([1.0, 1.0, 2.0, -0.5])
    loss, grad, m = run(GRPOLossConfig(decoupled="recompute"), adv=adv)
    ref_loss, ref_grad = reference(log_k, mask, beh, adv)
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    close(grad, ref_grad)
    # by hand, 8 tokens: d loss / d log pi = -k A / 8
    assert grad[1, 1].item() == pytest.approx(-6.0 / 8)
    assert grad[2, 0].item() == pytest.approx(-0.3 * 2 / 8)
    assert m["clip_frac_low"].item() == 0 and m["clip_frac_high"].item() == 0 and m["ratio_mean"].item() == 1.0
    _, plain, plain_m = run(GRPOLossConfig(), adv=adv)
    assert plain[1, 1].item() == 0.0 and plain_m["clip_frac_high"].item() == pytest.approx(1 / 8)
    assert plain[0, 2].item() == pytest.approx(grad[0, 2].item())  # k 1.2 < 1.28: the same either way


def test_decoupled_weight_is_detached():
    """prime-rl's docs detach the importance weight and its code does not: ours is detached. Were
    it not, d(k * rho * A)/d log pi would add k * A again: a k = 6 token's gradient would be 12 / 8."""
    _, grad, _ = run(GRPOLossConfig(decoupled="recompute"))
    assert grad[1, 1].item() == pytest.approx(6.0 / 8)


@pytest.mark.parametrize("lags", [[0, 0, 0], [1, 3, 0]])
def test_decoupled_loglinear_interpolates_pi_prox_by_version_lag(lags):
    """AReaL's approximation: log pi_prox = log mu + alpha (log pi - log mu), alpha = lag /
    (lag + 1) with pi the policy after this step (one version past the trainer's). Lag 0: pi_prox
    = mu, which is PPO against mu itself."""
    log_k, mask, beh, adv = batch()
    lag = torch.tensor([lags] * 4)
    loss, grad, _ = run(GRPOLossConfig(decoupled="loglinear"), token_lag=lag)
    alpha = lag.to(F64) / (lag + 1)
    shift = (1 - alpha) * t(log_k).nan_to_num()  # log pi - log pi_prox
    ref_loss, ref_grad = reference(log_k, mask, beh, adv, prox_shift=shift)
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    close(grad, ref_grad)
    if lags == [0, 0, 0]:
        plain_loss, plain_grad, _ = run(GRPOLossConfig())
        assert loss == pytest.approx(plain_loss, abs=1e-12)
        close(grad, plain_grad)
    else:
        # row 1's second token, lag 3 (alpha 3/4): w = 6 ** 0.75, rho = 6 ** 0.25 = 1.565 > 1.28
        # with A < 0: the clip leaves it open, gradient w * rho * -A / 8 = 6 / 8
        assert grad[1, 1].item() == pytest.approx(6.0 / 8)
        # row 0's first token, lag 1: w = 1.05 ** 0.5, rho = 1.05 ** 0.5; gradient -w rho A / 8
        assert grad[0, 0].item() == pytest.approx(-1.05 / 8)
    with pytest.raises(LossInputError, match="token_lag"):
        run(GRPOLossConfig(decoupled="loglinear"))


def test_decoupled_tis_cap_truncates_the_behaviour_weight():
    log_k, mask, beh, adv = batch()
    loss, grad, m = run(GRPOLossConfig(decoupled="recompute", tis_cap=2.0))
    k = torch.exp(t(log_k).nan_to_num())
    ref_loss, ref_grad = reference(log_k, mask, beh, adv, weight=k.clamp(max=2.0))
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    close(grad, ref_grad)
    assert grad[1, 1].item() == pytest.approx(2.0 / 8)  # min(6, 2) * -A / 8
    assert m["tis_frac"].item() == pytest.approx(1 / 8)  # k = 6 (k = 2 is not above the cap)


# --- token masks ------------------------------------------------------------------------------


def test_icepop_masks_tokens_outside_its_band_and_weights_by_k_inside():
    """IcePop (Ring-1T): M(k) * min(rho A, clip(rho) A), M(k) = k inside [0.5, 5], 0 outside,
    k measured at the policy before the step: decoupled recompute with token_mask 0.5,5. Row
    1's k = 6 and row 2's k = 0.3 leave; the other six tokens keep k A."""
    log_k, mask, beh, adv = batch()
    loss, grad, m = run(GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 5.0)))
    k = torch.exp(t(log_k).nan_to_num())
    inside = (k >= 0.5) & (k <= 5.0)
    ref_loss, ref_grad = reference(log_k, mask, beh, adv, keep=inside)
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    close(grad, ref_grad)
    assert grad[1, 1].item() == 0.0 and grad[2, 0].item() == 0.0
    assert grad[3, 0].item() == pytest.approx(2.0 * 0.5 / 8)  # k = 2 inside: weight k, applied once
    assert m["tokens"].item() == 8


def test_a_mask_without_decoupling_keeps_the_policy_term_s_own_ratio_inside():
    """A mask is an indicator: inside its band a token keeps PPO's term against mu (whose ratio
    is k), never k twice; outside, 0."""
    log_k, mask, beh, adv = batch()
    loss, grad, _ = run(GRPOLossConfig(token_mask=(0.5, 5.0)))
    _, plain, _ = run(GRPOLossConfig())
    expected = plain.clone()
    expected[1, 1] = expected[2, 0] = 0.0
    close(grad, expected)
    assert grad[3, 0].item() == pytest.approx(2.0 * 0.5 / 8)  # r = k = 2, A < 0: open, 2 * 0.5 / 8


def test_token_mis_masks_above_its_cap_where_tis_truncates():
    """Token-level MIS is a band 0,C: a token above C weighs 0; TIS (tis_cap C) gives it C."""
    _, mis, _ = run(GRPOLossConfig(decoupled="recompute", token_mask=(0.0, 2.5)))
    _, tis, _ = run(GRPOLossConfig(decoupled="recompute", tis_cap=2.5))
    assert mis[1, 1].item() == 0.0 and tis[1, 1].item() == pytest.approx(2.5 / 8)
    assert mis[2, 0].item() == pytest.approx(-0.3 * 2 / 8)  # no lower bound: k = 0.3 stays
    assert mis[3, 0].item() == tis[3, 0].item() == pytest.approx(2.0 * 0.5 / 8)


def test_a_band_tests_k_not_its_inverse():
    """verl's k1 statistic tests 1 / k, which turns an asymmetric band around. Ours tests k: in
    0.5,1.1 a token of k 1.2 leaves and one of k 0.9 stays (1 / k would keep 1.2, 1 / 1.2 = 0.83,
    and drop 0.9, 1 / 0.9 = 1.11)."""
    _, grad, _ = run(GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 1.1)))
    assert grad[0, 2].item() == 0.0  # k 1.2
    assert grad[0, 1].item() == pytest.approx(-0.9 / 8)  # k 0.9


# --- sequence level: the geometric mean -------------------------------------------------------


def long_batch(length: int = 8192, dtype=torch.float32):
    """Three completions of ``length`` tokens whose log-ratios alternate around a mean: -0.0005
    (g = 0.9995: the product e**-4.1 = 0.017, like NeMo-RL's 0.06 at 8-10k tokens), -0.1 (g = 0.905,
    the product e**-819 = 0 even in float64) and +0.3 (g = 1.35, the product e**2458 = inf)."""
    means = [-0.0005, -0.1, 0.3]
    wiggle = torch.tensor([0.02, -0.02], dtype=F64).repeat(length // 2)
    log_k = torch.stack([m + wiggle for m in means])
    beh = torch.full((3, length), -1.5, dtype=F64)
    mask = torch.ones(3, length, dtype=torch.bool)
    return log_k, beh.to(dtype), mask, t([1.0, -1.0, 1.0]), means


def test_the_sequence_mask_takes_the_geometric_mean_where_an_8k_product_underflows():
    log_k, beh, mask, adv, means = long_batch()
    product = torch.exp(log_k.sum(1))  # float64, and still 0 or inf
    assert product[1].item() == 0.0 and math.isinf(product[2].item()) and product[0].item() < 0.02
    new = (beh + log_k.to(beh.dtype)).requires_grad_()
    for band, kept in (((0.999, 1.001), [True, False, False]), ((0.9, 1.4), [True, True, True])):
        cfg = GRPOLossConfig(decoupled="recompute", seq_mask=band)
        new.grad = None
        loss, m = grpo_loss(new, beh, adv, mask, cfg, with_tally=True)
        loss.backward()
        keep = torch.tensor(kept).unsqueeze(1).expand_as(mask)
        ref_loss, ref_grad = reference(log_k.tolist(), mask, beh.to(F64), adv, keep=keep)
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(new.grad.to(F64), ref_grad, rtol=1e-5, atol=1e-12)
        assert tally_metrics(m["correction"])["masked_seq_frac"] == pytest.approx(1 - sum(kept) / 3)
    # verl's band with the product instead would have dropped the first completion too (0.017)


def test_sequence_tis_weighs_every_token_by_its_completion_s_truncated_geometric_mean():
    log_k, beh, mask, adv, means = long_batch()
    new = (beh + log_k.to(beh.dtype)).requires_grad_()
    loss, _ = grpo_loss(new, beh, adv, mask, GRPOLossConfig(decoupled="recompute", seq_tis_cap=1.2))
    loss.backward()
    g = torch.exp(t(means)).clamp(max=1.2)  # 0.9995, 0.905, 1.2 (1.35 truncated)
    weight = g.unsqueeze(1).expand_as(log_k)
    ref_loss, ref_grad = reference(log_k.tolist(), mask, beh.to(F64), adv, weight=weight)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(new.grad.to(F64), ref_grad, rtol=1e-5, atol=1e-12)
    # by hand: each token of the third completion gets -1.2 * A / (3 * 8192)
    assert new.grad[2, 0].item() == pytest.approx(-1.2 / (3 * 8192), rel=1e-5)


def test_opsm_drops_a_negative_advantage_completion_whose_policy_moved_away():
    """DeepSeek-V3.2: mask when A < 0 and mean log(mu / pi_prox) > delta. Rows: A < 0 with mean
    log(mu / pi) = 0.2 (masked); the same drift with A > 0 (kept); A < 0 with 0.05 (kept); and a
    row whose per-token advantages differ in sign (only its negative tokens leave)."""
    log_k = [[-0.2, -0.2], [-0.2, -0.2], [-0.05, -0.05], [-0.3, -0.1]]
    mask = torch.ones(4, 2, dtype=torch.bool)
    beh = torch.full((4, 2), -1.0, dtype=F64)
    adv = t([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]])
    loss, grad, m = run(GRPOLossConfig(opsm_delta=0.1), log_k, mask, beh, adv)
    keep = torch.tensor([[False, False], [True, True], [True, True], [True, False]])
    _, plain, _ = run(GRPOLossConfig(), log_k, mask, beh, adv)
    close(grad, torch.where(keep, plain, 0.0))
    assert grad[1, 0].item() == pytest.approx(-math.exp(-0.2) / 8)  # kept: PPO's -r A / 8
    assert tally_metrics(m["correction"])["masked_token_frac"] == pytest.approx(3 / 8)


# --- the conventions ---------------------------------------------------------------------------


def test_masked_tokens_stay_in_the_normaliser_and_micro_batches_add_up():
    """Normaliser before masking (AReaL's): the kept tokens' terms over all 8 tokens, not the 6
    kept; so a batch split into micro-batches with the whole batch's normaliser adds up."""
    log_k, mask, beh, adv = batch()
    cfg = GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 5.0))
    loss, grad, _ = run(cfg)
    k = torch.exp(t(log_k).nan_to_num())
    inside = (k >= 0.5) & (k <= 5.0) & mask
    assert loss == pytest.approx(-(k * adv.unsqueeze(1))[inside].sum().item() / 8)
    new = new_from(log_k, beh, mask)
    norm = loss_normalizer(cfg, n_tokens=8.0, n_seqs=4.0)
    parts = [grpo_loss(new[s], beh[s], adv[s], mask[s], cfg, normalizer=norm)[0] for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(loss, abs=1e-12)
    for aggregation in ("seq_mean", "fixed_tokens"):
        c = GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 5.0), aggregation=aggregation, token_budget=4)
        whole, _ = grpo_loss(new, beh, adv, mask, c)
        norm = loss_normalizer(c, n_tokens=8.0, n_seqs=4.0)
        split = [grpo_loss(new[s], beh[s], adv[s], mask[s], c, normalizer=norm)[0] for s in (slice(0, 2), slice(2, 4))]
        assert (split[0] + split[1]).item() == pytest.approx(whole.item(), abs=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_an_all_masked_batch_is_a_zero_loss_no_nan_and_a_counted_event(aggregation):
    log_k, mask, beh, adv = batch()
    cfg = GRPOLossConfig(decoupled="recompute", token_mask=(100.0, 200.0), aggregation=aggregation, kl_coef=0.0)
    new = new_from(log_k, beh, mask)
    loss, m = grpo_loss(new, beh, adv, mask, cfg, with_tally=True)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(torch.where(mask, new.grad, 0.0), torch.zeros(4, 3, dtype=F64))
    assert not torch.isnan(new.grad).any()
    tally = m.pop("correction")
    assert all(not torch.isnan(v) for v in m.values()), m
    record = tally_metrics(tally)
    assert record["all_masked"] == 1.0 and record["masked_token_frac"] == 1.0 and record["masked_seq_frac"] == 1.0
    # one micro-batch masked whole in a step that kept others is not the event
    kept = GRPOLossConfig(decoupled="recompute", token_mask=(0.5, 5.0))
    _, m2 = grpo_loss(new, beh, adv, mask, kept, with_tally=True)
    assert tally_metrics(merge(tally, m2["correction"]))["all_masked"] == 0.0
    assert tally_metrics(empty_tally(torch.device("cpu")))["all_masked"] == 0.0  # no tokens: nothing masked


def test_environment_tokens_are_in_no_ratio_no_mean_and_no_count():
    """A multi-turn completion: tokens an environment wrote (action mask 0) carry garbage where a
    behaviour log-prob would be (NaN, +40). The corrections read the policy's tokens only: the
    loss, gradients and tally equal those of the same completion without them."""
    nan = math.nan
    log_k = [[0.1, 5.0, 5.0, -0.2], [0.05, 0.0, nan, nan]]
    beh = t([[-1.0, 40.0, nan, -2.0], [-0.5, -0.7, nan, nan]])
    mask = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]], dtype=torch.bool)
    adv = t([1.0, -1.0])
    cfg = GRPOLossConfig(decoupled="recompute", seq_mask=(0.9, 1.1), token_mask=(0.5, 5.0))
    loss, grad, m = run(cfg, log_k, mask, beh, adv)
    compact = [[0.1, -0.2], [0.05, 0.0]]
    c_loss, c_grad, c_m = run(cfg, compact, torch.ones(2, 2, dtype=torch.bool), t([[-1.0, -2.0], [-0.5, -0.7]]), adv)
    assert loss == pytest.approx(c_loss, abs=1e-12)
    close(grad[:, [0, 3]][0], c_grad[0].tolist())
    close(grad[1, :2], c_grad[1].tolist())
    assert torch.equal(m["correction"], c_m["correction"])
    record = tally_metrics(m["correction"])
    assert record["correction_by_length"]["1-16"]["tokens"] == 4  # policy tokens only


def test_non_finite_log_ratios_and_the_clamp_before_exp():
    """A token the trainer gives probability 0 (log k = -inf) weighs 0, and a sequence holding one
    has g = 0; one whose two log-probs are infinite (NaN) is masked. The weight is exp(min(log k,
    50)), finite; a band tests the unclamped log k (52 is above a band ending at e**51)."""
    inf = math.inf
    beh = t([[-1.0, -1.0], [-inf, -1.0], [-1.0, -1.0]])
    new = t([[-inf, -1.0], [-inf, -1.0], [51.0, -1.0]]).requires_grad_()
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv = t([-1.0, 1.0, -1.0])
    for cfg in (
        GRPOLossConfig(decoupled="recompute"),
        GRPOLossConfig(decoupled="recompute", seq_mask=(0.5, 2.0)),
        GRPOLossConfig(decoupled="recompute", token_mask=(0.0, math.exp(51.0))),
        GRPOLossConfig(decoupled="loglinear"),
    ):
        new.grad = None
        lag = torch.tensor([[2, 2]] * 3)
        loss, m = grpo_loss(new, beh, adv, mask, cfg, token_lag=lag, with_tally=True)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all(), cfg
        record = tally_metrics(m.pop("correction"))
        assert all(math.isfinite(v) for v in (record["behaviour_ratio_min"], record["behaviour_ratio_max"])), record
        assert new.grad[0, 0].item() == 0.0 and new.grad[1, 0].item() == 0.0  # k = 0 and NaN: nothing
        if cfg.seq_mask is not None:  # g of rows 0 (a -inf token), 1 (NaN) and 2 (e**26) are outside
            assert torch.equal(new.grad, torch.zeros_like(new.grad))
        elif cfg.token_mask is not None:  # log k = 52 > 51: masked, though e**50 (the clamp) is inside
            assert new.grad[2, 0].item() == 0.0 and new.grad[2, 1].item() == pytest.approx(1 / 6)
        elif cfg.decoupled == "recompute":  # weight e**50 (clamped), -A / 6 each
            assert new.grad[2, 0].item() == pytest.approx(math.exp(50.0) / 6, rel=1e-12)


# --- the tally: what the step record reports -------------------------------------------------------


def test_the_tally_by_version_lag_and_completion_length_by_hand():
    """Two completions: one of 3 tokens at lags 2, 2, 1 (k 1.05, 0.9, 1.2), one of 20 tokens at
    lag 0 (k 1, the first 2). Band 0.95,1.5 masks k 0.9; every lag and length by hand."""
    log_k = [[math.log(1.05), math.log(0.9), math.log(1.2)] + [math.nan] * 17, [math.log(2.0)] + [0.0] * 19]
    mask = torch.tensor([[True] * 3 + [False] * 17, [True] * 20])
    beh = torch.full((2, 20), -1.0, dtype=F64)
    lag = torch.tensor([[2, 2, 1] + [0] * 17, [0] * 20])
    _, _, m = run(GRPOLossConfig(token_mask=(0.95, 1.5)), log_k, mask, beh, t([1.0, 1.0]), token_lag=lag)
    record = tally_metrics(m["correction"])
    assert record["masked_token_frac"] == pytest.approx(2 / 23)  # k 0.9 and k 2
    assert record["masked_seq_frac"] == 0.0 and record["all_masked"] == 0.0
    assert record["behaviour_ratio_min"] == pytest.approx(0.9) and record["behaviour_ratio_max"] == pytest.approx(2.0)
    assert record["behaviour_ratio_mean"] == pytest.approx((1.05 + 0.9 + 1.2 + 2.0 + 19) / 23)
    by_lag = record["correction_by_lag"]
    assert set(by_lag) == {"0", "1", "2"}
    assert by_lag["2"]["tokens"] == 2 and by_lag["2"]["masked_token_frac"] == 0.5 and by_lag["2"]["sequences"] == 1
    assert by_lag["1"]["tokens"] == 1 and by_lag["1"]["sequences"] == 0  # a completion counts at its oldest token
    assert by_lag["1"]["ratio_min"] == by_lag["1"]["ratio_max"] == pytest.approx(1.2)
    assert by_lag["0"]["tokens"] == 20 and by_lag["0"]["masked_token_frac"] == pytest.approx(1 / 20)
    by_length = record["correction_by_length"]
    assert set(by_length) == {"1-16", "17-32"} and LENGTH_KEYS[-1] == "32769+"
    assert by_length["1-16"]["tokens"] == 3 and by_length["17-32"]["ratio_mean"] == pytest.approx(21 / 20)
    # merged with itself: counts double, shares and extremes stay
    twice = tally_metrics(merge(m["correction"], m["correction"]))
    assert twice["correction_by_lag"]["0"]["tokens"] == 40 and twice["behaviour_ratio_max"] == pytest.approx(2.0)


def test_no_correction_changes_nothing_and_reports_nothing_new():
    log_k, mask, beh, adv = batch()
    new = new_from(log_k, beh, mask)
    _, m = grpo_loss(new, beh, adv, mask, GRPOLossConfig(), with_tally=True)
    assert "correction" not in m and not GRPOLossConfig().corrected


# --- the options: bad values are one line ------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainer.loss.token_mask", "5,0.5"], "token_mask must be a band lo,hi with 0 <= lo <= hi"),
        (["--trainer.loss.seq_mask", "-0.1,1.1"], "seq_mask must be a band lo,hi with 0 <= lo <= hi"),
        (["--trainer.loss.seq_mask", "nan,1"], "seq_mask must be a band"),
        (["--trainer.loss.token_mask", "0.5"], "expected 2 comma-separated values"),
        (["--trainer.loss.decoupled", "exact"], "decoupled must be one of off, recompute, loglinear"),
        (["--trainer.loss.decoupled", "recompute", "--trainer.loss.policy_loss", "gspo"], "needs policy_loss ppo_clip"),
        (["--trainer.loss.seq_tis_cap", "2"], "needs --trainer.loss.decoupled recompute"),
        (
            ["--trainer.loss.decoupled", "recompute", "--trainer.loss.seq_tis_cap", "2", "--trainer.loss.tis_cap", "2"],
            "set one of them to none",
        ),
        (["--trainer.loss.opsm_delta", "-1"], "opsm_delta must be >= 0"),
    ],
)
def test_bad_correction_options_are_one_line_naming_the_flag(flags, message):
    from asyncrl.rl.config.grpo import GRPOConfig

    with pytest.raises(ConfigError) as info:
        parse_overrides(GRPOConfig(), flags)
    text = str(info.value)
    assert message in text and "\n" not in text and text.startswith("--trainer.loss."), text


def test_good_bands_parse():
    from asyncrl.rl.config.grpo import GRPOConfig

    loss = parse_overrides(
        GRPOConfig(), ["--trainer.loss.token_mask", "0,inf", "--trainer.loss.seq_mask", "0.999,1.001"]
    ).trainer.loss
    assert loss.token_mask == (0.0, math.inf) and loss.seq_mask == (0.999, 1.001) and loss.corrected


@pytest.mark.e2e
def test_help_lists_the_options_and_a_bad_band_exits_2_in_one_line(tmp_path):
    from launch_support import launch_example

    shown = launch_example("grpo_countdown.py", tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr
    for option in ("decoupled off", "token_mask none", "seq_mask none", "seq_tis_cap none", "opsm_delta none"):
        assert f"--trainer.loss.{option}" in shown.stdout, option
    refused = launch_example("grpo_countdown.py", tmp_path, "--trainer.loss.token_mask", "5,0.5")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--trainer.loss.token_mask 5,0.5: token_mask must be a band lo,hi" in refused.stderr
    assert not (tmp_path / "runs").exists()
