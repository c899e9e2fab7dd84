"""The config tree of a GRPO run, and the rules that tie two of its sections together.

Each section validates its own fields; a rule that reads two sections (the trainer's temperature
against the samplers', the held-out split against the warm start's) lives here, in
`GRPOConfig.__post_init__`, so no tree that breaks one can be built: not from flags, not from a
resumed config.json, not in code. Its error is a `ConfigError` that names both flags.

The task's own options are a section named after the task (``--countdown.max_count 5``): a task's
``Config`` is known only once its class is, so `grpo_config_type` makes the config type of a run on
that task, GRPOConfig with that one section more.
"""

from __future__ import annotations

import dataclasses
import keyword
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.config.sampler import SamplerConfig
from asyncrl.rl.config.task import DEFAULT_TASK, TaskConfig, TaskSpec
from asyncrl.rl.config.teacher import RewardModelConfig, TeacherConfig
from asyncrl.rl.config.trainer import TrainerConfig


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """A GRPO run: one section per part of the run (and, in the type `grpo_config_type` makes for
    a task with options, the task's own section)."""

    run: RunConfig = field(default_factory=RunConfig)
    """The loop: its schedule, the data split, checkpoints, deadlines and sampler restarts."""
    model_path: str = ""
    """A local Hugging Face checkpoint directory; empty: the embedded default model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the embedded default model."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the embedded default model (cached on disk)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """What the run trains on: a task class, or a data file and a reward function (default: countdown)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """The sampler actors: how many, and how they generate."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer actor: its optimiser, micro-batches and GRPO loss."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation's teacher, served by a scorer actor (docs/algorithms.md)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model whose score joins the task's reward, served by a scorer actor."""

    def __post_init__(self) -> None:
        check_temperature(self)
        check_adapter_sync(self)
        check_length_budgets(self)
        check_teacher(self)
        if not self.model_path:
            check_heldout_unseen(self)
            check_completion_fits(self)

    task_section: ClassVar[str] = ""
    """The field holding the task's own options ("" when the task has none): set by `grpo_config_type`."""

    def task_options(self) -> Any:
        """The task's own options (its ``Config``), or None when it has none."""
        return getattr(self, self.task_section) if self.task_section else None

    def task_spec(self) -> TaskSpec:
        """What every process builds the task from: the task section with its paths absolute, and
        the task's options as plain values."""
        task = self.task.resolved()
        options = self.task_options()
        return TaskSpec(
            task.name or ("" if task.reward else DEFAULT_TASK),
            options=msgspec.to_builtins(options) if options is not None else {},
            data=task.data,
            heldout_data=task.heldout_data,
            reward=task.reward,
            prompt_key=task.prompt_key,
            score_timeout_s=task.score_timeout_s,
            max_failure_rate=task.max_failure_rate,
            max_turns=task.max_turns,
        )

    def trainer_config(self) -> TrainerConfig:
        """The trainer's section with the samplers' temperature, its learning rate resolved for the
        model trained (``--trainer.lr`` auto), and the run's length as the end of a decaying
        learning rate unless it names its own: the one the actor is given."""
        loss, most = self.trainer.loss, self.sampler.length_limit
        loss = dataclasses.replace(
            loss, token_budget=loss.token_budget or most, overlong_max_tokens=loss.overlong_max_tokens or most
        )
        return dataclasses.replace(
            self.trainer,
            temperature=self.sampler.temperature,
            lr=self.trainer.peak_lr(checkpoint=bool(self.model_path)),
            lr_decay_steps=self.trainer.lr_decay_steps or self.run.steps,
            loss=loss,
        )


class TaskClass(Protocol):
    """What a run's config reads of a task class (`asyncrl.rl.tasks.base.Task`): its name, which
    names its options' section."""

    @classmethod
    def task_name(cls) -> str: ...


_TYPES: dict[type, type[GRPOConfig]] = {}
_TYPES_LOCK = threading.Lock()


def grpo_config_type(task_cls: type[TaskClass]) -> type[GRPOConfig]:
    """The config type of a run on the task class ``task_cls``: `GRPOConfig` with one more section,
    the task's ``Config`` under its name (``--countdown.*``: on the command line, in ``--help``, in
    config.json); GRPOConfig itself for a task without options. One type per class (cached), so
    configs of one task compare equal. A name that cannot be a section, or a ``Config`` that is not
    a frozen dataclass, is a `ConfigError`."""
    options = getattr(task_cls, "Config", None)
    if options is None:
        return GRPOConfig
    with _TYPES_LOCK:
        if task_cls not in _TYPES:
            _TYPES[task_cls] = _with_section(task_cls, options)
        return _TYPES[task_cls]


def _with_section(task_cls: type[TaskClass], options: type) -> type[GRPOConfig]:
    name = task_cls.task_name()
    where = f"task {task_cls.__module__}.{task_cls.__qualname__}"
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(
            f"{where}: its name {name!r} cannot name its options' section (--{name}.*): set the "
            "class's name to an identifier, e.g. name = 'my_task'"
        )
    if name in {f.name for f in dataclasses.fields(GRPOConfig)}:
        raise ConfigError(
            f"{where}: its name {name!r} is the run's own section --{name}.*, so its options "
            "cannot have it: set the class's name to another, e.g. name = 'my_task'"
        )
    params = getattr(options, "__dataclass_params__", None)
    if not (isinstance(options, type) and params is not None and params.frozen):
        raise ConfigError(
            f"{where}: its Config must be a frozen dataclass (@dataclass(frozen=True, kw_only=True)), not {options!r}"
        )
    doc = f"{(GRPOConfig.__doc__ or '').strip()}\n\nThis type: a run on task {name}, whose options are ``--{name}.*``."
    return dataclasses.make_dataclass(
        "GRPOConfig",
        [(name, options, field(default_factory=options))],
        bases=(GRPOConfig,),
        frozen=True,
        kw_only=True,
        namespace={"task_section": name, "__doc__": doc, "__module__": __name__},
    )


def check_temperature(config: GRPOConfig) -> None:
    """The trainer scores completions at the temperature they were sampled at: only then are its
    log-probs those of the sampled tokens."""
    trainer, sampler = config.trainer.temperature, config.sampler.temperature
    if trainer is not None and trainer != sampler:
        raise ConfigError(
            f"--trainer.temperature {trainer:g} differs from --sampler.temperature {sampler:g}: the "
            "trainer must score completions at the temperature they were sampled at; set "
            "--sampler.temperature alone (the trainer takes it), or --trainer.temperature none"
        )


def check_teacher(config: GRPOConfig) -> None:
    """A teacher and its weight come together: one without the other does nothing, or cannot run."""
    coef, path = config.trainer.loss.distill_coef, config.teacher.model_path
    if coef > 0 and not path:
        raise ConfigError(f"--trainer.loss.distill_coef {coef:g} needs a teacher: set --teacher.model_path DIR")
    if path and not coef > 0:
        raise ConfigError(
            f"--teacher.model_path {path} has no effect with --trainer.loss.distill_coef 0: set it "
            "(1 weighs the teacher's reverse KL as one reward unit a token; docs/algorithms.md)"
        )


def check_length_budgets(config: GRPOConfig) -> None:
    """Dr. GRPO's constant normaliser and DAPO's overlong shaping need a length in tokens: their
    own key, else the samplers' ``max_new_tokens`` (whose 0, the model's own limit, is not one)."""
    loss, most = config.trainer.loss, config.sampler.length_limit
    if loss.aggregation == "fixed_tokens" and not (loss.token_budget or most):
        raise ConfigError(
            "--trainer.loss.aggregation fixed_tokens divides by a token budget: set "
            "--trainer.loss.token_budget N or --sampler.max_new_tokens N"
        )
    if loss.overlong_buffer:
        limit = loss.overlong_max_tokens or most
        if not limit:
            raise ConfigError(
                "--trainer.loss.overlong_buffer needs a length limit: set "
                "--trainer.loss.overlong_max_tokens N or --sampler.max_new_tokens N"
            )
        if loss.overlong_buffer > limit:
            raise ConfigError(
                f"--trainer.loss.overlong_buffer {loss.overlong_buffer} is more than the length limit "
                f"{limit} (--trainer.loss.overlong_max_tokens, else --sampler.max_new_tokens)"
            )


def check_adapter_sync(config: GRPOConfig) -> None:
    """Adapter-only LoRA sync into vLLM goes through vLLM's LoRA path, which serves ranks up to 512
    ('auto' picks vLLM where it is installed), and is taken by each sampler, never for the clients
    of a shared engine."""
    lora = config.trainer.lora
    if lora.rank and lora.sync == "adapter" and config.sampler.clients_per_engine > 1:
        raise ConfigError(
            "--trainer.lora.sync adapter with --sampler.clients_per_engine > 1: adapters reach each sampler, "
            "not a shared engine; use --trainer.lora.sync merged"
        )
    if lora.rank > 512 and lora.sync == "adapter" and config.sampler.backend != "hf":
        raise ConfigError(
            f"--trainer.lora.rank {lora.rank} with --trainer.lora.sync adapter: vLLM serves LoRA ranks "
            "up to 512; use --sampler.backend hf, or --trainer.lora.sync merged"
        )


def check_heldout_unseen(config: GRPOConfig) -> None:
    """The embedded model is warm-started on one train split; refuse a held-out set it may have seen."""
    warm, data = config.warm_start, config.run.data
    if str(data.data_seed) != str(warm.data_seed):
        raise ConfigError(
            f"--run.data_seed {data.data_seed} differs from --warm_start.data_seed {warm.data_seed}: "
            "the held-out problems could be among the warm start's training problems"
        )
    if data.n_heldout > warm.heldout_reserve and not config.task.heldout_data:  # a file is never warm-started on
        raise ConfigError(
            f"--run.n_heldout {data.n_heldout} is more than --warm_start.heldout_reserve "
            f"{warm.heldout_reserve}: the held-out problems beyond it were trained on in the warm start"
        )


def check_completion_fits(config: GRPOConfig) -> None:
    """A completion must fit in the embedded model's positions, after its prompt (a checkpoint's
    positions are read from its config.json by `asyncrl.rl.driver.preflight.check_run`)."""
    tokens, positions = config.sampler.length_limit, config.model.max_positions
    if tokens >= positions:
        raise ConfigError(
            f"--sampler.max_new_tokens {tokens}: the embedded model (--model.max_positions) has "
            f"{positions} positions for prompt and completion together; give fewer than {positions} "
            "(0: the model's own limit)"
        )
