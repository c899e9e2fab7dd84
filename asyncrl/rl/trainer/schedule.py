"""The learning rate at each optimiser step (``--trainer.lr_schedule``).

A pure function of the step, not a stateful torch scheduler: a resumed trainer knows its step
from the checkpoint, and that is all the schedule needs to be exact again.
"""

from __future__ import annotations

import math

from asyncrl.rl.config.trainer import TrainerConfig


def learning_rate(config: TrainerConfig, step: int) -> float:
    """The rate of optimiser step ``step + 1`` (``step`` steps taken): a linear warm-up over
    ``lr_warmup_steps``, then constant, or a cosine or linear decay from ``lr`` to
    ``lr * lr_min_ratio`` at step ``lr_decay_steps`` (and flat after it)."""
    peak = config.peak_lr()
    if step < config.lr_warmup_steps:
        return peak * (step + 1) / config.lr_warmup_steps
    if config.lr_schedule == "constant" or config.lr_decay_steps <= config.lr_warmup_steps:
        return peak
    done = min(1.0, (step - config.lr_warmup_steps) / (config.lr_decay_steps - config.lr_warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * done)) if config.lr_schedule == "cosine" else 1 - done
    return peak * (config.lr_min_ratio + (1 - config.lr_min_ratio) * shape)


def set_learning_rate(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
