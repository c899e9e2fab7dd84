"""What the trainer answers of a train step: `TrainStepMetrics`, the step's metrics and its own
time, and `TrainMetrics`, the metrics alone, as the step record (``rl/observe/record.py``) holds
them. Torch-free: the record imports it, as it imports the sampler's answers to a sync, and the
driver loads no torch for it."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

M = TypeVar("M", bound="TrainMetrics")


class TrainMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A train step's metrics as the step record holds them (its ``train`` part, written flat
    into metrics.jsonl): the trainer's answer (`TrainStepMetrics`) without its own ``train_s``."""

    distill_kl: float | None = None
    """The token mean of the reverse KL to the teacher (with ``--trainer.loss.distill_coef`` > 0):
    the behaviour - teacher log-prob gap of the sampled token, or with ``--teacher.top_k`` the KL
    over the teacher's top-K and a rest bucket (docs/algorithms.md)."""
    kl: float | None = None
    """Mean per-token k3 KL to the reference policy (with a reference model)."""
    loss: float | None = None
    """The step's loss (None: no micro-batch was trained)."""
    pg_loss: float | None = None
    """The policy-gradient term of the loss."""
    ratio_mean: float | None = None
    """Mean per-token importance ratio new / behaviour policy."""
    clip_frac_low: float | None = None
    """Share of tokens clipped below 1 - eps_low."""
    clip_frac_high: float | None = None
    """Share of tokens clipped above 1 + eps_high."""
    tis_frac: float | None = None
    """Share of tokens whose ratio exceeds ``tis_cap`` (with ``--trainer.loss.tis_cap``)."""
    entropy: float | None = None
    """Mean per-token entropy of the policy (when the trainer computes it)."""
    grad_norm: float
    """Gradient norm before clipping."""
    lr: float
    """Learning rate of the step."""
    tokens: float
    """Completion tokens in the loss (mask 1)."""
    sequences: float
    """Completions trained on."""
    micro_batches: float
    """Micro-batches the step was cut into."""
    micro_batch_tokens: float
    """The token budget of a micro-batch."""
    peak_mem_gib: float | None = None
    """Peak device memory of the trainer's rank 0 (GPU only)."""
    mfu: float | None = None
    """Model FLOPs utilisation of the trainer's group (GPU whose peak is known only)."""
    masked_token_frac: float | None = None
    """With an off-policy correction (``--trainer.loss.decoupled``, ``tis_cap``, ``token_mask``,
    ``seq_mask``, ``seq_tis_cap``, ``opsm_delta``; docs/algorithms.md): the share of the step's
    policy tokens its masks took out of the policy term."""
    masked_seq_frac: float | None = None
    """With a correction: the share of completions none of whose tokens stayed in the policy term."""
    all_masked: float | None = None
    """With a correction: 1 when the masks took out every policy token of the step (its policy
    term was 0 and moved nothing), else 0; summed over a run, the steps lost so."""
    behaviour_ratio_mean: float | None = None
    """With a correction: the mean over the step's policy tokens of the behaviour ratio ``k =
    pi_prox / mu`` (the trainer's policy before the step against the sampler's), masked or not."""
    behaviour_ratio_min: float | None = None
    """With a correction: the smallest behaviour ratio of the step."""
    behaviour_ratio_max: float | None = None
    """With a correction: the largest behaviour ratio of the step."""
    correction_by_lag: dict[str, dict[str, float]] | None = None
    """With a correction: per version lag ("0" ... "7", "8+": the trainer's version minus the
    token's), the policy tokens, the share masked, the completions (by their oldest token's lag),
    the share wholly masked, and the behaviour ratio's mean, min and max. Buckets without a token
    are left out."""
    correction_by_length: dict[str, dict[str, float]] | None = None
    """With a correction: the same per completion length ("1-16", "17-32", ... "32769+": its policy
    tokens)."""

    @classmethod
    def of(cls: type[M], answer: dict[str, Any]) -> M:
        """The trainer's metrics, typed: a metric without a field here is a bug of this file."""
        try:
            return cls(**answer)
        except TypeError as exc:
            raise TypeError(
                f"the trainer's train_step answered metrics the step record cannot hold ({exc}): "
                f"give each a field in asyncrl/rl/trainer/metrics.py's TrainMetrics"
            ) from None


class TrainStepMetrics(TrainMetrics, kw_only=True, omit_defaults=True):
    """The trainer's answer to one train step (`TrainerActor.train_step`): the step's metrics and
    the trainer's own seconds of it."""

    train_s: float
    """Seconds the trainer took for the step, in its process (the step record's ``train_s`` is
    the driver's wall time of the call instead, which includes the round trip)."""

    def recorded(self) -> TrainMetrics:
        """The metrics the step record holds: these without ``train_s``."""
        return TrainMetrics(**{name: getattr(self, name) for name in TrainMetrics.__struct_fields__})
