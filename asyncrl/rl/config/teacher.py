"""The teacher section (``--teacher.*``): a model that scores the student's samples, served by
the scorer actor, for on-policy distillation (docs/algorithms.md)."""

from __future__ import annotations

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
