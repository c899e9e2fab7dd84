"""What the trainer answers of a train step: `TrainStepMetrics`, the step's metrics and its own
time, and `TrainMetrics`, the metrics alone, as the step record (``rl/observe/record.py``) holds
them. Torch-free: the record imports it, as it imports the sampler's answers to a sync, and the
driver loads no torch for it."""

from __future__ import annotations

from typing import TypeVar

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

    @classmethod
    def of(cls: type[M], answer: dict[str, float]) -> M:
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
