"""The config tree of a GRPO run, and the rules that tie two of its sections together.

Each section validates its own fields; a rule that reads two sections (the trainer's temperature
against the samplers', the held-out split against the warm start's) lives here, in
`GRPOConfig.__post_init__`, so no tree that breaks one can be built: not from flags, not from a
resumed config.json, not in code. Its error is a `ConfigError` that names both flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.config.task import CountdownConfig
from asyncrl.rl.config.trainer import TrainerConfig


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """A GRPO run on Countdown: one section per part of the run."""

    run: RunConfig = field(default_factory=RunConfig)
    """The loop: its schedule, the data split, checkpoints, deadlines and sampler restarts."""
    model_path: str = ""
    """A local Hugging Face checkpoint directory; empty: the embedded default model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the embedded default model."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the embedded default model (cached on disk)."""
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    """The Countdown problems: how many numbers, how large, which targets."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """The sampler actors: how many, and how they generate."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer actor: its optimiser, micro-batches and GRPO loss."""

    def __post_init__(self) -> None:
        check_temperature(self)
        check_weights_readable(self)
        if not self.model_path:
            check_heldout_unseen(self)
            check_completion_fits(self)

    def trainer_config(self) -> TrainerConfig:
        """The trainer's section with the samplers' temperature: the one the actor is given."""
        return dataclasses.replace(self.trainer, temperature=self.sampler.temperature)


def check_temperature(config: GRPOConfig) -> None:
    """The trainer scores completions at the temperature they were sampled at: only then are its
    log-probs those of the sampled tokens."""
    trainer, sampler = config.trainer.temperature, config.sampler.temperature
    if trainer is not None and trainer != sampler:
        raise ConfigError(f"--trainer.temperature {trainer:g} differs from --sampler.temperature {sampler:g}: the "
                          "trainer must score completions at the temperature they were sampled at; set "
                          "--sampler.temperature alone (the trainer takes it), or --trainer.temperature none")


def check_weights_readable(config: GRPOConfig) -> None:
    """``--run.check_weights`` reads every sampler's weights in its actor; a vLLM sampler keeps
    them in its engine (a sampler that *picks* vLLM under 'auto' is found once it starts)."""
    if config.run.check_weights and config.sampler.backend == "vllm":
        raise ConfigError("--run.check_weights true needs samplers that hold their weights in the actor, and "
                          "--sampler.backend vllm keeps them in the engine: use --sampler.backend hf, "
                          "or drop check_weights")


def check_heldout_unseen(config: GRPOConfig) -> None:
    """The embedded model is warm-started on one train split; refuse a held-out set it may have seen."""
    warm, data = config.warm_start, config.run.data
    if str(data.data_seed) != str(warm.data_seed):
        raise ConfigError(f"--run.data_seed {data.data_seed} differs from --warm_start.data_seed {warm.data_seed}: "
                          "the held-out problems could be among the warm start's training problems")
    if data.n_heldout > warm.heldout_reserve:
        raise ConfigError(f"--run.n_heldout {data.n_heldout} is more than --warm_start.heldout_reserve "
                          f"{warm.heldout_reserve}: the held-out problems beyond it were trained on in the warm start")


def check_completion_fits(config: GRPOConfig) -> None:
    """A completion must fit in the embedded model's positions, after its prompt (a checkpoint's
    positions are read from its config.json by `asyncrl.rl.driver.preflight.check_run`)."""
    tokens, positions = config.sampler.max_new_tokens, config.model.max_positions
    if tokens >= positions:
        raise ConfigError(f"--sampler.max_new_tokens {tokens}: the embedded model (--model.max_positions) has "
                          f"{positions} positions for prompt and completion together; give fewer than {positions} "
                          "(0: the model's own limit)")
