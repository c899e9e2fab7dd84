"""The embedded model's shape (``--model.*``) and its supervised warm start (``--warm_start.*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the embedded Qwen2 model. The defaults (1.02M parameters) warm-start in minutes on
    one CPU core and sample fast enough for GRPO there
    (benchmarks/README.md, "Figures that were in the code")."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads; ``hidden_size / num_heads`` (head_dim) must be 32 or 64, which vLLM's CPU
    attention supports."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 512
    """Width of the SwiGLU MLP."""
    max_positions: int = 128
    """Longest prompt + completion, in tokens (characters, for the embedded tokenizer)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tie_embeddings: bool = True
    """Share input embedding and output head (saves vocab_size * hidden_size parameters)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, not {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads not in (32, 64):
            raise ValueError(
                f"hidden_size / num_heads (head_dim) must be 32 or 64, not {self.hidden_size} / {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, not {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised warm start of the embedded model on the task's demonstrations (`Task.demonstration`
    of its train split: Countdown's reference solutions, a data file's ``demonstration`` column, an
    environment's solver traces). The defaults aim at a held-out solve rate well inside (0, 1) so
    that GRPO has room to improve it (each task's warm-start solve rate: benchmarks/README.md,
    "Figures that were in the code")."""

    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW), reached after ``warmup_steps``, then cosine decay to lr / 10.
    On Countdown, training escapes a loss plateau (~0.9, format learnt, arithmetic not) around step
    150; at 3e-3 and above, some seeds stay on it."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    n_examples: int = 20000
    """Training problems, at most (a task may have fewer; each is seen ``steps * batch_size /
    n_examples`` times on average; those without a demonstration are skipped)."""
    seed: int = 0
    """Seed of the weight initialisation and the batch order."""
    data_seed: int | str = 0
    """Seed of the task's splits (`Task.splits`) whose train split is trained on. Use the same seed
    for GRPO's split (``--run.data_seed``): its first ``heldout_reserve`` held-out problems are never
    trained on."""
    heldout_reserve: int = 1000
    """Held-out problems excluded from training (the held-out stream is prefix-stable, so any
    held-out set of this size or smaller, from the same ``data_seed``, is unseen). A run fits it to
    its task (``model/reserve.py``): the rows of ``--task.heldout_data``; ``--run.n_heldout`` for a
    task with fewer than twice this many problems."""
    eval_problems: int = 200
    """Held-out problems solved greedily after training, recorded in the marker file (not logged: the
    GRPO run reports the held-out solve rate before training itself, on its own held-out set, and
    one number there is enough); 0 skips."""
    device: str = "auto"
    """Where the warm start trains: "cpu" (one thread: the same weights on any machine of one CPU
    kind), "cuda" (the first GPU the run sees: seconds instead of minutes for a larger
    ``--model.*`` shape; cached per GPU model, as GPUs of two kinds need not give the same bits),
    or "auto": cuda where the run's device plan is cuda, else cpu."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "n_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStartConfig.{name} must be >= 1, not {getattr(self, name)}")
        for name in ("warmup_steps", "heldout_reserve", "eval_problems"):
            if getattr(self, name) < 0:
                raise ValueError(f"WarmStartConfig.{name} must be >= 0, not {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, not {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, not {self.weight_decay}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.eval_problems > self.heldout_reserve:
            raise ValueError(
                f"eval_problems ({self.eval_problems}) must be <= heldout_reserve "
                f"({self.heldout_reserve}): only reserved problems are unseen"
            )
