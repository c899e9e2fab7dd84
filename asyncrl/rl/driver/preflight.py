"""Checks of a GRPO run's paths and limits, made before anything is spawned or written.

A missing checkpoint, an unwritable run directory or a completion longer than the checkpoint's
positions would otherwise surface seconds later as a remote traceback from the trainer, after the
run directory was made. `check_run` finds them first, from the file system and a few small JSON
files only (no torch, no transformers: it runs in milliseconds), and raises a one-line
`ConfigError` naming the flag and its value; it creates nothing. It also builds the run's task
and its splits, as every sampler will (`load_task`), so a task file that fails to import, a class
that is not a task, a data file that is missing, empty or has a malformed line, or too few problems
for the splits is a one-line error here, not a sampler's traceback. What the config alone decides (a
rule across two sections included) is not checked here: `GRPOConfig` refuses it when it is built.
`resumed_config` reads the config of a run to continue, after checking that the directory is one.
`asyncrl.rl.launch.grpo_main` (the examples' main) calls both before it starts the supervisor;
`asyncrl.rl.driver.train` calls `check_run` again at its top, for callers that build their config
in code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import tempfile
import time
from typing import Any, TypeVar

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.observe import ObserveConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.teacher import RewardModelConfig, ScorerConfig
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import Task, TaskError

C = TypeVar("C", bound=GRPOConfig)
SC = TypeVar("SC", bound=ScorerConfig)

RUN_MARKERS = ("config.json", "metrics.jsonl", "progress.json", "summary.json", "checkpoints")
"""What a run writes into its directory: any of them there means the directory holds a run."""
LEFT_BY_A_START = ("supervisor.json", ".asyncrl-write-check-")
"""What a run killed while starting (before config.json) can leave in its directory, and this
check's own probe: a directory that holds only these is as good as empty for a new run."""
PSEUDO_FILESYSTEMS = ("/proc", "/sys")
"""Kernel views, not storage: a run directory there would fail on its first write (or worse)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_run(config: C, *, resume: bool = False) -> C:
    """``config`` (a `GRPOConfig`) with its paths made absolute and its default run directory
    named, once the model, the run directory and the limits are found usable. ``resume``: the
    run directory must hold the run to continue; otherwise it must not hold one."""
    run_dir = os.path.abspath(os.path.expanduser(config.run.run_dir or default_run_dir()))
    model_path = os.path.abspath(os.path.expanduser(config.model_path)) if config.model_path else ""
    if model_path:  # the embedded model's limits are GRPOConfig's own rules
        _check_max_new_tokens(
            config.sampler.length_limit, _checkpoint_positions(model_path, config.model_path), config.model_path
        )
    _check_run_dir(run_dir, config.run.run_dir, resume)
    # tokenizers are compared with the student's once it exists (build.py)
    teacher, reward_model = config.teacher, config.reward_model
    config = dataclasses.replace(
        config,
        model_path=model_path,
        task=config.task.resolved(),
        teacher=_checked_scorer("teacher", teacher) if teacher.model_path else teacher,
        reward_model=_checked_scorer("reward_model", reward_model) if reward_model.model_path else reward_model,
        run=dataclasses.replace(config.run, run_dir=run_dir),
    )
    check_task(config)
    _check_viewers(config.run.observe)
    return config


def _checked_scorer(key: str, section: SC) -> SC:
    """A scorer's section (``--key.*``) with its paths made absolute, once its checkpoint looks
    loadable and, for a judge, its template is a readable text file that shows the completion."""
    path = os.path.abspath(os.path.expanduser(section.model_path))
    _checkpoint_positions(path, section.model_path, f"--{key}.model_path")
    if not isinstance(section, RewardModelConfig) or not section.template:
        return dataclasses.replace(section, model_path=path)
    template = os.path.abspath(os.path.expanduser(section.template))
    flag = f"--{key}.template {shlex.quote(section.template)}"
    try:
        with open(template, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        raise ConfigError(
            f"{flag}: cannot be read ({type(exc).__name__}: {why}); "
            "give a UTF-8 text file with {prompt} and {completion} in it"
        ) from None
    if "{completion}" not in text:
        raise ConfigError(f"{flag} has no {{completion}}: the judge would never see what it judges")
    return dataclasses.replace(section, model_path=path, template=template)


def _check_viewers(observe: ObserveConfig) -> None:
    """A viewer the user asked for by name must be installed (the default ones are optional)."""
    import importlib.util

    if observe.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--run.wandb {shlex.quote(observe.wandb)} needs the wandb package, which is not installed: "
            "pip install wandb (or leave out --run.wandb)"
        )
    if observe.metrics_port and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"--run.metrics_port {observe.metrics_port} needs the prometheus-client package, which is not "
            "installed: pip install prometheus-client (or leave out --run.metrics_port)"
        )


def resumed_config(default: C, run_dir: str) -> C:
    """The config of the run in ``run_dir`` (its config.json over ``default``'s tree), once
    ``run_dir`` is found to be a run's directory."""
    from asyncrl.rl.config.stored import load_run_config

    _check_is_run(run_dir)
    return load_run_config(default, run_dir)


def default_run_dir() -> str:
    return os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S"))


# --- the model ------------------------------------------------------------------------------------


def _checkpoint_positions(path: str, given: str, key: str = "--model_path") -> int | None:
    """Check that ``path`` (``given`` on the command line, after ``key``) looks like a checkpoint
    transformers can load (a directory with a config.json naming its model_type, weights and a
    tokenizer) and return its ``max_position_embeddings`` (None when its config does not say)."""
    flag = f"{key} {shlex.quote(given)}"
    values = _config_json(
        path,
        flag,
        missing="give a local Hugging Face checkpoint directory"
        + (" (or no --model_path for the embedded model)" if key == "--model_path" else ""),
        not_dir="give the checkpoint's directory, the one holding config.json",
        no_config="so not a Hugging Face checkpoint directory",
    )
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ConfigError(f"{flag}: its config.json names no model_type, so transformers cannot load it")
    names = os.listdir(path)
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise ConfigError(f"{flag}: no weights there (no *.safetensors or *.bin file)")
    if not any(n in TOKENIZER_FILES for n in names):
        raise ConfigError(f"{flag}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
    positions = values.get("max_position_embeddings")
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def _check_max_new_tokens(max_new_tokens: int, positions: int | None, model_path: str) -> None:
    if positions is not None and max_new_tokens >= positions:
        raise ConfigError(
            f"--sampler.max_new_tokens {max_new_tokens}: the checkpoint {model_path} has {positions} "
            f"positions for prompt and completion together; give fewer than {positions} (0: the "
            "model's own limit)"
        )


# --- the task -------------------------------------------------------------------------------------


def check_task(config: GRPOConfig) -> None:
    """Build the run's task (cached: the driver reuses it) and its held-out split, and for a task
    whose problems are a list its train split too; the embedded model also needs the task's
    demonstrations to be warm-started on. Anything wrong is a one-line `ConfigError`.

    A task that makes its own splits (Countdown's generator) is asked for one train problem only:
    the 50000 of Countdown's default take seconds to draw, which every sampler does anyway."""
    from asyncrl.rl.tasks.loading import describe_error, load_task

    spec = config.task_spec()
    data = config.run.data
    try:
        task = load_task(spec)
        n_train = 1 if type(task).splits is not Task.splits else data.n_train
        splits = task.splits(data.data_seed, n_train, data.n_heldout)
        if not config.model_path:
            _check_demonstrations(task, [*splits.train[:1], *splits.heldout[:1]])
    except ConfigError:
        raise
    except TaskError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # the user's problems(), splits() or demonstration() raised: where, in one line
        raise ConfigError(
            f"task {spec.name or spec.reward}: building its problems raised {describe_error(exc)}"
        ) from None
    if isinstance(task, Agent):
        missing = missing_modules(AGENT_MODULES)
        if missing:
            raise ConfigError(
                f"task {task.task_name()} is an agent, which talks to the samplers through the OpenAI "
                f"API, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                "pip install 'asyncrl[agents]'"
            )
    if not splits.train or not splits.heldout:
        raise ConfigError(
            f"task {task.task_name()}: splits({data.data_seed}, {n_train}, {data.n_heldout}) gave "
            f"{len(splits.train)} train and {len(splits.heldout)} held-out problems: a run needs both"
        )


AGENT_MODULES = ("aiohttp", "openai")
"""What an agent run needs beyond asyncrl's own dependencies (the ``agents`` extra)."""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that cannot be imported here (looked up, not imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def _check_demonstrations(task: Task, problems: list) -> None:
    """The embedded model is warm-started on demonstrations: a task with none needs a checkpoint."""
    if problems and all(task.demonstration(p) is None for p in problems):
        raise ConfigError(
            f"task {task.task_name()} gives no demonstration for its problems, and the embedded model "
            "(no --model_path) is warm-started on them: give --model_path a checkpoint, or define "
            'demonstration() (with --task.reward: a "demonstration" string in each row)'
        )


# --- the run directory ----------------------------------------------------------------------------


def _check_run_dir(run_dir: str, given: str, resume: bool) -> None:
    """A new run needs a directory it can create, or an empty one (`_check_empty`), and never one
    that holds another run; a resumed one needs its run there. Either must be writable: probed by
    creating and removing a temporary entry, which also answers for read-only mounts and for root.
    Messages name the path as typed (``given``; empty: the default), since that is what the user
    will correct."""
    typed = shlex.quote(given) if given else shlex.quote(run_dir)
    shown = f"--run.run_dir {typed}" if given else f"the default run directory {typed}"
    real = os.path.realpath(run_dir)
    for pseudo in PSEUDO_FILESYSTEMS:
        if real == pseudo or real.startswith(pseudo + os.sep):
            raise ConfigError(
                f"{shown}: {pseudo} is a kernel pseudo-filesystem, not storage; choose another --run.run_dir"
            )
    if resume:
        _check_is_run(run_dir, shown)
    elif os.path.isdir(run_dir):
        found = [name for name in RUN_MARKERS if os.path.exists(os.path.join(run_dir, name))]
        if found and _has_checkpoint(run_dir):
            raise ConfigError(
                f"{shown} holds checkpoints of an earlier run: continue it with --resume {typed}, "
                "or choose another --run.run_dir"
            )
        if found:  # stopped before its first checkpoint: there is nothing to continue
            raise ConfigError(
                f"{shown} holds an earlier run that wrote no checkpoint ({', '.join(found)}), so "
                "nothing to resume: remove that directory, or choose another --run.run_dir"
            )
        _check_empty(run_dir, shown)
    existing = real
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == real else f"cannot be made: {existing} is a file"
        raise ConfigError(f"{shown} {where}, not a directory; choose another --run.run_dir")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".asyncrl-write-check-", dir=existing))
    except OSError as exc:
        verb = "cannot write in it" if existing == real else f"cannot create it in {existing}"
        raise ConfigError(f"{shown}: {verb} ({_reason(exc)}); choose another --run.run_dir") from None


def _check_empty(run_dir: str, shown: str) -> None:
    """A new run's directory, when it exists, is empty: a run writes config.json, log.txt,
    faults.jsonl and more, and among another program's files (``--run.run_dir /run``) they would
    be lost, or overwrite that program's."""
    try:
        names = sorted(n for n in os.listdir(run_dir) if not n.startswith(LEFT_BY_A_START))
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot list it ({_reason(exc)}); choose another --run.run_dir") from None
    if names:
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"{shown} is not empty ({listed}) and holds no run; a new run takes a new or empty "
            "directory: choose another --run.run_dir"
        )


def _has_checkpoint(run_dir: str) -> bool:
    """A whole checkpoint there (``checkpoints/step-N``: the name only a finished write gives)."""
    from asyncrl.rl.checkpoint import list_checkpoints

    return bool(list_checkpoints(run_dir))


def _check_is_run(run_dir: str, shown: str = "") -> None:
    shown = shown or f"--resume {shlex.quote(run_dir)}"
    values = _config_json(
        run_dir,
        shown,
        missing="give the directory of the run to continue",
        not_dir="give the directory of the run to continue",
        no_config="so not a run directory (a run writes config.json, metrics.jsonl and checkpoints/)",
    )
    if not isinstance(values, dict) or not isinstance(values.get("run"), dict):
        raise ConfigError(f"{shown}: its config.json is not a run's config (no run section)")


def _config_json(directory: str, shown: str, *, missing: str, not_dir: str, no_config: str) -> Any:
    """The parsed config.json of ``directory`` (a checkpoint's or a run's), or a one-line
    `ConfigError` naming ``shown`` (the flag as typed) and what to give instead."""
    if not os.path.exists(directory):
        raise ConfigError(f"{shown}: no such directory; {missing}")
    if not os.path.isdir(directory):
        raise ConfigError(f"{shown}: not a directory; {not_dir}")
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no config.json there, {no_config}") from None
    except (OSError, ValueError) as exc:  # unreadable, or not JSON (json.JSONDecodeError, UnicodeDecodeError)
        raise ConfigError(f"{shown}: cannot read its config.json ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
