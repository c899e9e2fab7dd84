"""The config sections of a GRPO run that are defined next to torch code (the embedded model's
shape and warm start, the trainer, the loss), kept here so that reading, parsing and checking a
config (``--help``, a flag error) loads in milliseconds, without torch. Their modules re-export
them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class GRPOLossConfig:
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at ``1 - eps_low`` (matters for negative advantages)."""
    eps_high: float = 0.28
    """Upper clip: the ratio is clipped at ``1 + eps_high`` (matters for positive advantages).
    Above ``eps_low`` it is DAPO's "clip-higher", which keeps low-probability tokens exploring."""
    tis_cap: float | None = None
    """Truncated importance sampling: when set, each token's clipped-surrogate term is multiplied
    by the detached factor ``min(1, tis_cap / ratio)``, so an unclipped token's gradient is
    ``min(ratio, tis_cap) * A * grad(log pi)`` instead of ``ratio * A * grad(log pi)``. This bounds
    the one case the PPO clip leaves open: a negative advantage with a huge ratio. ``None``: off."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (needs ``ref_logprobs``); 0: no KL."""
    aggregation: str = "token_mean"
    """'token_mean': sum over every valid token / number of valid tokens in the batch (long
    completions weigh more). 'seq_mean': mean over each sequence's valid tokens, then mean over
    the sequences that have at least one valid token (each completion weighs the same)."""

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), not {self.eps_low!r}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, not {self.eps_high!r}")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"tis_cap must be >= 1 or None, not {self.tis_cap!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, not {self.kl_coef!r}")
        if self.aggregation not in ("token_mean", "seq_mean"):
            raise ValueError(f"aggregation must be 'token_mean' or 'seq_mean', not {self.aggregation!r}")


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-4
    """AdamW learning rate (the default suits the small embedded model; use ~1e-6 for real LLMs;
    on the embedded model 1e-3 collapsed the policy within 25 steps)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping)."""
    micro_batch_tokens: int = 16384
    """Token budget of one forward/backward (padded length x sequences)."""
    temperature: float = 1.0
    """Log-probs are taken of logits / temperature: must equal the samplers' temperature."""
    normalize_std: bool = False
    """Divide each group's advantages by its reward std (GRPO); False: mean-centred only (Dr. GRPO).
    Off by default: the std division gives a group that differs only in the 0.1 format reward as
    much weight as one that differs in correctness; on the embedded model it measured better off."""
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """Clipping, truncated importance weight, KL and aggregation of the GRPO loss."""
    bf16: bool = True
    """bf16 autocast for the forward pass on GPU (parameters and optimiser stay fp32)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, not {self.lr!r}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, not {self.micro_batch_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, not {self.temperature!r}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, not {self.grad_clip!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the embedded Qwen2 model. The defaults (1.02M parameters) warm-start in about two
    minutes on one CPU core (122 s measured, 400 steps) and sample fast enough for GRPO there."""

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
            raise ValueError(f"hidden_size / num_heads (head_dim) must be 32 or 64, not "
                             f"{self.hidden_size} / {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, not {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised warm start on reference solutions of the Countdown train split. The defaults aim
    at a held-out solve rate well inside (0, 1) so that GRPO has room to improve it."""

    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW), reached after ``warmup_steps``, then cosine decay to lr / 10.
    Training escapes a loss plateau (~0.9, format learnt, arithmetic not) around step 150; at 3e-3
    and above, some seeds stay on it."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    n_examples: int = 20000
    """Distinct training problems (each seen ``steps * batch_size / n_examples`` times on average)."""
    seed: int = 0
    """Seed of the weight initialisation and the batch order."""
    data_seed: int | str = 0
    """Seed of :func:`countdown.train_and_heldout` whose train split is trained on. Use the same
    seed for GRPO's split: its first ``heldout_reserve`` held-out problems are never trained on."""
    heldout_reserve: int = 1000
    """Held-out problems excluded from training (the held-out stream is prefix-stable, so any
    held-out set of this size or smaller, from the same ``data_seed``, is unseen)."""
    eval_problems: int = 200
    """Held-out problems solved greedily after training, recorded in the marker file (not logged: the
    GRPO run reports the held-out solve rate before training itself, on its own held-out set, and
    one number there is enough); 0 skips."""

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
        if self.eval_problems > self.heldout_reserve:
            raise ValueError(f"eval_problems ({self.eval_problems}) must be <= heldout_reserve "
                             f"({self.heldout_reserve}): only reserved problems are unseen")
