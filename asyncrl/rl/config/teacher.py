"""The sections of the models that score the student's samples, each served by a scorer actor:
the teacher (``--teacher.*``, on-policy distillation) and the reward model (``--reward_model.*``)
(docs/algorithms.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """On-policy distillation's teacher: a local checkpoint served by a scorer actor, which scores
    every completion token the samplers make; ``--trainer.loss.distill_coef`` weighs it."""

    model_path: str = ""
    """A local Hugging Face checkpoint directory with the student's tokenizer; empty: no teacher."""
    timeout_s: float = 120.0
    """The longest one group's scoring may take, its wait in the scorer's queue included; past it
    the scorer is restarted (within --run.sampler_max_restarts) and the group scored again."""
    batch_tokens: int = 16384
    """Tokens (prompt + completion) of the requests one scorer pass takes together at most."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s!r}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, not {self.batch_tokens!r}")


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A reward model served by a scorer actor: a sequence-classification checkpoint with one
    scalar output, whose score of each completion joins the task's reward."""

    model_path: str = ""
    """A local Hugging Face sequence-classification checkpoint (num_labels 1, a ``score`` head)
    with the student's tokenizer; empty: no reward model."""
    weight: float = 1.0
    """The reward model's weight: reward = ``rule_weight`` x task reward + ``weight`` x its score."""
    rule_weight: float = 1.0
    """The task's (rule) reward's weight in that sum; 0: the reward model alone."""
    timeout_s: float = 120.0
    """The longest one group's scoring may take, as ``--teacher.timeout_s``."""
    batch_tokens: int = 16384
    """Tokens (prompt + completion) of one forward of the reward model at most."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s!r}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, not {self.batch_tokens!r}")
        for name in ("weight", "rule_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, not {getattr(self, name)!r}")
