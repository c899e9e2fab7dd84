"""Every section of a GRPO run's config, and the ``--section.key value`` parser. Torch-free:
``--help`` and a flag error answer without loading torch or transformers."""

from asyncrl.rl.config.grpo import GRPOConfig, grpo_config_type
from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.config.parse import ConfigError, config_to_dict, help_text, parse_overrides, take_option
from asyncrl.rl.config.run import CheckpointConfig, DataConfig, DeadlineConfig, RecoveryConfig, RunConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.config.task import CountdownConfig, TaskConfig, TaskSpec
from asyncrl.rl.config.teacher import RewardModelConfig, TeacherConfig
from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "CountdownConfig",
    "DataConfig",
    "DeadlineConfig",
    "GRPOConfig",
    "GRPOLossConfig",
    "ModelConfig",
    "RecoveryConfig",
    "RewardModelConfig",
    "RunConfig",
    "SamplerConfig",
    "TaskConfig",
    "TaskSpec",
    "TeacherConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "config_to_dict",
    "grpo_config_type",
    "help_text",
    "parse_overrides",
    "take_option",
]
