"""The trainer section (``--trainer.*``) and its GRPO loss (``--trainer.loss.*``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
DECOUPLED = ("off", "recompute", "loglinear")
AGGREGATIONS = ("token_mean", "seq_mean", "fixed_tokens")
EMBEDDED_LR = 1e-4
"""``--trainer.lr`` auto on the embedded model, and a `TrainerConfig`'s own: the best rate tried on the
1M-parameter default (docs/grpo.md: 2e-4 no better, 3e-4 worse, 1e-3 collapsed it within 25 steps)."""
CHECKPOINT_LR = 1e-6
"""``--trainer.lr`` auto for a checkpoint (``--model_path``): TRL's GRPOTrainer default (1.16) and
what verl's GRPO example scripts pass for pretrained LLMs. The embedded model's 1e-4 is far too high for one:
on a 358M model warm-started here 6e-5 already fell from 0.37 to 0.10 held-out greedy (docs/gpu.md)."""
LORA_LR_SCALE = 10.0
"""LoRA's adapters want a larger rate than full fine-tuning: auto with ``--trainer.lora.rank`` is 10x
(1e-3 on the embedded model, as docs/lora.md measured; 1e-5 for a checkpoint)."""


@dataclass(frozen=True, kw_only=True)
class GRPOLossConfig:
    """The GRPO loss: a policy-gradient term (PPO's clipped surrogate, GSPO or CISPO), with
    optional off-policy corrections (truncated importance weights, decoupled PPO, token and
    sequence masks), KL penalty and DAPO's overlong reward shaping, aggregated over tokens,
    sequences or a fixed token budget (docs/algorithms.md)."""

    policy_loss: str = "ppo_clip"
    """'ppo_clip': the token-level clipped surrogate (``eps_low``, ``eps_high``). 'gspo': GSPO's
    sequence-level ratio, the geometric mean of the token ratios, clipped per sequence
    (``gspo_eps_low``, ``gspo_eps_high``; Zheng et al. 2025). 'cispo': REINFORCE on every token
    weighted by the clipped, detached importance ratio (``cispo_eps_low``, ``cispo_eps_high``;
    MiniMax-M1, 2025). Formulas and when to use which: docs/algorithms.md."""

    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at ``1 - eps_low`` (matters for negative advantages)."""
    eps_high: float = 0.28
    """Upper clip: the ratio is clipped at ``1 + eps_high`` (matters for positive advantages).
    Above ``eps_low`` it is DAPO's "clip-higher", which keeps low-probability tokens exploring."""
    tis_cap: float | None = None
    """Truncated importance sampling: when set, each token's clipped-surrogate term is multiplied
    by the detached factor ``min(1, tis_cap / ratio)``, so an unclipped token's gradient is
    ``min(ratio, tis_cap) * A * grad(log pi)`` instead of ``ratio * A * grad(log pi)``. This bounds
    the one case the PPO clip leaves open: a negative advantage with a huge ratio. With
    ``decoupled``, the behaviour weight ``k = pi_prox / mu`` is truncated instead: ``min(k,
    tis_cap)``. ``None``: off."""
    decoupled: str = "off"
    """Decoupled PPO (AReaL, Fu et al. 2025, eq. 5). 'off': the clip is on ``pi / mu``, mu the
    sampler's policy. 'recompute' or 'loglinear': the clip is on ``pi / pi_prox``, pi_prox the
    policy before this step, and each token is weighted by the detached behaviour ratio ``k =
    pi_prox / mu`` (``tis_cap``, ``seq_tis_cap`` truncate it). 'recompute': pi_prox exact, taken
    from the step's own forward pass (the trainer takes one optimiser step a batch, so that pass
    runs with the weights before the step: no second pass). 'loglinear': AReaL's approximation
    ``log pi_prox = log mu + lag / (lag + 1) * (log pi - log mu)``, by each token's version lag.
    ppo_clip only. docs/algorithms.md."""
    token_mask: tuple[float, float] | None = None
    """A band ``lo,hi`` on each token's behaviour ratio ``k = pi_prox / mu`` (``pi / mu`` without
    ``decoupled``): a token outside it leaves the policy term (still counted by the normaliser).
    IcePop (Ring-1T): 0.5,5. Token-level MIS (masked, not truncated, importance sampling) at cap
    C: 0,C. None: off."""
    seq_mask: tuple[float, float] | None = None
    """A band ``lo,hi`` on each completion's geometric-mean ratio ``exp(mean over its tokens of
    log k)``: a completion outside it leaves the policy term whole (verl 0.999,1.001; SkyRL
    0.99,1.01). None: off."""
    seq_tis_cap: float | None = None
    """Sequence-level truncated importance sampling (needs ``decoupled``): every token of a
    completion is weighted by ``min(g, seq_tis_cap)``, g its geometric-mean ratio, instead of its
    own ``k``. None: off."""
    opsm_delta: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a token of negative advantage leaves the policy
    term when its completion's mean ``log(mu / pi_prox)`` exceeds ``opsm_delta`` (the policy has
    moved away from what the sampler drew). None: off."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (needs ``ref_logprobs``); 0: no KL."""
    aggregation: str = "token_mean"
    """'token_mean': sum over every valid token / number of valid tokens in the batch (long
    completions weigh more). 'seq_mean': mean over each sequence's valid tokens, then mean over
    the sequences that have at least one valid token (each completion weighs the same; GSPO's
    own objective). 'fixed_tokens': sum over every valid token / (sequences x ``token_budget``),
    Dr. GRPO's constant normaliser: a token's weight depends neither on its completion's length
    nor on the batch's."""
    token_budget: int = 0
    """The constant of 'fixed_tokens' (Dr. GRPO's MAX_TOKENS); 0: ``--sampler.max_new_tokens``."""
    gspo_eps_low: float = 3e-4
    """GSPO: the sequence ratio is clipped below at ``1 - gspo_eps_low`` (the paper's 3e-4)."""
    gspo_eps_high: float = 4e-4
    """GSPO: the sequence ratio is clipped above at ``1 + gspo_eps_high`` (the paper's 4e-4)."""
    cispo_eps_low: float = 1.0
    """CISPO: the importance weight is clipped below at ``1 - cispo_eps_low``; 1: no lower bound
    (MiniMax-M1's choice)."""
    cispo_eps_high: float = 0.28
    """CISPO: the importance weight is clipped above at ``1 + cispo_eps_high`` (MiniMax-M1 tuned
    this bound alone; 0.28 is clip-higher's value, our choice)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a completion longer than ``overlong_max_tokens -
    overlong_buffer`` tokens loses reward linearly, ``overlong_penalty`` at ``overlong_max_tokens``
    (and beyond); added to the task's reward before the advantages. 0: off."""
    overlong_max_tokens: int = 0
    """DAPO's L_max, the length at which the whole penalty applies; 0: ``--sampler.max_new_tokens``."""
    overlong_penalty: float = 1.0
    """The reward taken from a completion of ``overlong_max_tokens`` tokens or more (DAPO: 1)."""
    distill_coef: float = 0.0
    """On-policy distillation (needs ``--teacher.model_path``): each completion token's advantage
    gets ``- distill_coef * (log p_sampler(token) - log p_teacher(token))``, the per-token
    reverse KL to the teacher on the sampled token (Thinking Machines' on-policy distillation);
    with ``--teacher.top_k`` K > 0 the loss gets ``distill_coef`` times the reverse KL over the
    teacher's top-K tokens and a rest bucket instead (GKD's form; docs/algorithms.md). 0: no
    teacher term."""

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {', '.join(POLICY_LOSSES)}, not {self.policy_loss!r}")
        self._check_corrections()
        if self.tis_cap is not None and self.policy_loss != "ppo_clip":
            raise ValueError(
                f"tis_cap applies to policy_loss ppo_clip only ({self.policy_loss} bounds its own "
                "importance weight): set --trainer.loss.tis_cap none"
            )
        for name in ("gspo_eps_low", "cispo_eps_low"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {getattr(self, name)!r}")
        for name in ("gspo_eps_high", "cispo_eps_high"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        for name in ("token_budget", "overlong_buffer", "overlong_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        if self.overlong_max_tokens and self.overlong_buffer > self.overlong_max_tokens:
            raise ValueError(
                f"overlong_buffer {self.overlong_buffer} must be at most overlong_max_tokens {self.overlong_max_tokens}"
            )
        if not self.distill_coef >= 0:
            raise ValueError(f"distill_coef must be >= 0, not {self.distill_coef!r}")
        if not self.overlong_penalty >= 0:
            raise ValueError(f"overlong_penalty must be >= 0, not {self.overlong_penalty!r}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), not {self.eps_low!r}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, not {self.eps_high!r}")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"tis_cap must be >= 1 or None, not {self.tis_cap!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, not {self.kl_coef!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, not {self.aggregation!r}")

    def _check_corrections(self) -> None:
        if self.decoupled not in DECOUPLED:
            raise ValueError(f"decoupled must be one of {', '.join(DECOUPLED)}, not {self.decoupled!r}")
        if self.decoupled != "off" and self.policy_loss != "ppo_clip":
            raise ValueError(
                f"decoupled {self.decoupled} is PPO's clip against the policy before the step: it needs "
                f"policy_loss ppo_clip, not {self.policy_loss} (or set --trainer.loss.decoupled off)"
            )
        for name in ("token_mask", "seq_mask"):
            band = getattr(self, name)
            if band is not None and not (len(band) == 2 and 0 <= band[0] <= band[1]):  # NaN fails too
                raise ValueError(
                    f"{name} must be a band lo,hi with 0 <= lo <= hi (e.g. 0.5,5), not {','.join(map(str, band))}"
                )
        if self.seq_tis_cap is not None:
            if self.decoupled == "off":
                raise ValueError(
                    "seq_tis_cap weights each token by its completion's ratio instead of its own: it needs "
                    "--trainer.loss.decoupled recompute (or loglinear)"
                )
            if self.tis_cap is not None:
                raise ValueError("tis_cap and seq_tis_cap are two truncations of one weight: set one of them to none")
            if not self.seq_tis_cap >= 1:
                raise ValueError(f"seq_tis_cap must be >= 1 or None, not {self.seq_tis_cap!r}")
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"opsm_delta must be >= 0 or None, not {self.opsm_delta!r}")

    @property
    def corrected(self) -> bool:
        """Whether an off-policy correction is on (besides the policy term's own clip): the loss
        then reports what it masked and the behaviour ratio's statistics."""
        return (
            self.decoupled != "off"
            or self.tis_cap is not None
            or self.seq_tis_cap is not None
            or self.opsm_delta is not None
            or self.token_mask is not None
            or self.seq_mask is not None
        )


LORA_SYNC_MODES = ("merged", "adapter")
AUTO_CPU_MICRO_BATCH_TOKENS = 16384
"""``micro_batch_tokens`` 0 (auto) on CPU: the fixed default it always was."""
AUTO_MICRO_BATCH_TOKENS_MAX = 65536
"""The most ``micro_batch_tokens`` 0 (auto) picks on a GPU, however much memory is free."""
LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters trained with peft on a frozen base model (docs/lora.md); rank 0: full
    fine-tuning."""

    rank: int = 0
    """Rank of each adapter (peft's ``r``); 0: no LoRA, every parameter trains."""
    alpha: float = 16.0
    """peft's ``lora_alpha``: an adapter's output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (peft's ``lora_dropout``)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear modules that get an adapter (peft's ``target_modules``)."""
    sync: str = "merged"
    """How samplers get the weights: 'merged' (base + B·A·alpha/rank under the base model's names,
    through the usual bucketed sync: every sampler backend) or 'adapter' (only the A and B
    matrices travel; the HF sampler applies them with peft, vLLM through its own LoRA path)."""
    bf16_base: bool = False
    """On GPU, keep the frozen base in bf16 (the adapters and their optimiser state stay fp32)."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, not {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, not {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one module")
        if self.sync not in LORA_SYNC_MODES:
            raise ValueError(f"sync must be one of {LORA_SYNC_MODES}, not {self.sync!r}")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The trainer actor: its AdamW optimiser, micro-batches, the temperature it scores at and the
    GRPO loss."""

    lr: float = 0.0
    """AdamW's peak learning rate. 0 (auto): 1e-4 on the embedded model, 1e-6 for a checkpoint
    (``--model_path``), 10x either with LoRA; a run's log says which it took. A larger embedded
    model (``--model.*``) wants less than 1e-4: 1.5e-5 at 358M parameters (docs/gpu.md)."""
    lr_schedule: str = "constant"
    """'constant', 'cosine' or 'linear': after the warm-up, keep ``lr``, or decay it to
    ``lr * lr_min_ratio`` by step ``lr_decay_steps`` along half a cosine or a line."""
    lr_warmup_steps: int = 0
    """Steps of a linear warm-up from ``lr / lr_warmup_steps`` to ``lr`` (0: none)."""
    lr_decay_steps: int = 0
    """The step at which a decaying schedule reaches its floor (0: the run's last, ``--run.steps``)."""
    lr_min_ratio: float = 0.1
    """A decaying schedule's floor, as a share of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping)."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward (padded length x sequences). 0: auto, chosen by the
    trainer at its first step: 16384 on CPU; on a GPU from the memory free once the policy, its
    optimiser state (counted before it exists) and a colocated vLLM engine hold theirs, the model's
    shape and ``activation_checkpointing``, with a safety margin, in [1024, 65536] by steps of 1024
    (``trainer/memory_budget.py``; logged once, and each step's metrics report it)."""
    temperature: float | None = None
    """Log-probs are taken of logits / temperature. None: the samplers' ``--sampler.temperature``
    (1 for a trainer used on its own), the one value that gives the sampled tokens' true
    log-probs; a GRPO run refuses a value that differs from it."""
    normalize_std: bool = False
    """Divide each group's advantages by its reward std (GRPO); False: mean-centred only (Dr. GRPO).
    Off by default: the std division gives a group that differs only in the 0.1 format reward as
    much weight as one that differs in correctness; on the embedded model it measured better off."""
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    """Clipping, truncated importance weight, KL and aggregation of the GRPO loss."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning, and how their weights reach the samplers."""
    bf16: bool = True
    """bf16 autocast for the forward pass on GPU (parameters and optimiser stay fp32). With
    world_size > 1: parameters gathered in bf16 for the forward and backward, gradients reduced
    in fp32 (FSDP2's MixedPrecisionPolicy)."""
    world_size: int = 1
    """Trainer processes (one GPU each) that train as one group: the policy and the optimiser are
    sharded over them (FSDP2), each takes a share of the batch balanced by tokens, and the loss is
    normalised by the whole batch's count, so they compute what one process would (docs/trainer.md).
    1: a single trainer process, unsharded."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass: less memory for long
    micro-batches (what a large ``micro_batch_tokens`` on one GPU needs), about a third more
    compute. None (auto): off, unless a single trainer process on a GPU with ``micro_batch_tokens``
    auto meets a sequence longer than a micro-batch holds without it (long generations): then on
    from the first step that does, whichever it is (completions grow as a run learns), and logged."""
    pack_tokens: int = 0
    """Pack several prompt + completion sequences into rows of up to this many tokens, attention
    kept within each (``trainer/packing.py``); at most ``micro_batch_tokens`` (with auto, at most
    65536, and auto picks no less than it). 0: one padded
    sequence per row. Same loss and gradients either way; packing saves the padding's compute."""
    compile: bool | None = None
    """torch.compile each decoder layer for training (``trainer/compile.py``): the norms, rotary
    embedding, activation, casts and residual adds between the matmuls fused into a few kernels.
    The first step compiles (tens of seconds on a GPU; once for dynamic shapes). None (auto): on
    with one CUDA trainer process (shorter steps and a lower peak: docs/trainer.md), off on the CPU
    (compiling takes longer than a model this small saves) and with world_size > 1 (not measured
    there). False also keeps the fused head's
    per-chunk functions eager on a GPU (``scoring/chunked_head.py``: compiled by default there)."""
    attn_implementation: str = ""
    """The trainer model's attention implementation as transformers names it ("sdpa", "eager",
    "flash_attention_2", which needs the flash-attn package and a GPU); empty: the checkpoint's
    default (sdpa). Packed rows get a block-diagonal mask under sdpa/eager and flash attention's
    varlen path (sequence boundaries from the position ids) under flash_attention_*."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be > 0, or 0 for auto, not {self.lr!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, not {self.lr_schedule!r}")
        for name in ("lr_warmup_steps", "lr_decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"lr_min_ratio must be in [0, 1], not {self.lr_min_ratio!r}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 1, or 0 for auto, not {self.micro_batch_tokens!r}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, not {self.temperature!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, not {self.world_size!r}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, not {self.grad_clip!r}")
        # auto (0) resolves to at least pack_tokens, so a packed row is still one forward at most
        most = self.micro_batch_tokens or AUTO_MICRO_BATCH_TOKENS_MAX
        if not 0 <= self.pack_tokens <= most:
            raise ValueError(
                f"pack_tokens must be in [0, micro_batch_tokens = {most}"
                f"{' (auto: its most)' if not self.micro_batch_tokens else ''}] "
                f"(a packed row is one forward at most), not {self.pack_tokens!r}"
            )

    def peak_lr(self, *, checkpoint: bool = False) -> float:
        """``lr``, or where it is 0 (auto) the rate for the model trained: `CHECKPOINT_LR` for a
        ``checkpoint`` (``--model_path``), else `EMBEDDED_LR`; times `LORA_LR_SCALE` with LoRA."""
        if self.lr:
            return self.lr
        return (CHECKPOINT_LR if checkpoint else EMBEDDED_LR) * (LORA_LR_SCALE if self.lora.rank else 1.0)
