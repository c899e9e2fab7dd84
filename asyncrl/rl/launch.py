"""The main of a GRPO script, shared by ``examples/grpo.py`` (any task) and
``examples/grpo_countdown.py`` (the README's command): read the command line, check everything,
train, and turn the outcome into an exit status.

The config is parsed in two phases, both before torch is imported (``--help`` and a typo answer at
once): first the task (``--task.name``/``--task.reward`` from the command line, else from a
``--config`` file, else from the run's config.json on ``--resume``) is looked up, since its class
decides the config's shape (its options are a section of their own, ``--countdown.*``); then
every key is parsed against that shape, in layers: the script's defaults, the resumed run's
config.json, the ``--config`` files in order, and the flags, which win wherever they stand on the
line. ``--print_config`` writes the result as a TOML file (`config_file_text`) instead of running.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from asyncrl import Supervisor
from asyncrl.rl.config import GRPOConfig, TaskConfig, grpo_config_type, help_text, parse_overrides, take_option
from asyncrl.rl.config.files import ConfigFile, config_file_text, read_config_file
from asyncrl.rl.config.task import DEFAULT_TASK, split_ref
from asyncrl.rl.tasks.loading import reward_function, task_class
from asyncrl.runtime.titles import name_run

OPTIONS = [
    ("--help", "Show this help and exit."),
    (
        "--resume RUN_DIR",
        "Continue the run in RUN_DIR from its newest checkpoint, with its config.json; keys "
        "given with it apply on top (e.g. --run.steps to go further).",
    ),
    (
        "--config FILE",
        "Read keys from FILE: TOML (.toml), YAML (.yaml, where PyYAML is installed) or a run's "
        "config.json (or its directory), a table per section ([run], [trainer.loss]); the flags win "
        "over it. Repeat it to layer files, the later winning.",
    ),
    (
        "--print_config",
        "Write every key of the run these flags (and files) make, defaults included, as a TOML "
        "file on stdout, and exit: --config reads it back to the same run.",
    ),
]
"""The flags a GRPO script takes besides its config keys."""


async def grpo_main(
    argv: list[str] | None = None, doc: str = "", default_task: str = DEFAULT_TASK, defaults: Sequence[str] = ()
) -> int:
    """Run GRPO as the command line ``argv`` (default: ``sys.argv[1:]``) says; returns the exit
    status: 0 done, 1 the run could not go on (one line on stderr says why and how to resume).
    ``doc``: the script's description for ``--help``. ``default_task``: the task when the command
    line names none (a built-in name, FILE.py:CLASS or MODULE:CLASS, as ``--task.name`` takes; a
    relative FILE.py is in the script's directory, so a copied script finds the task beside it).
    ``defaults``: flags that set this script's own defaults (``["--run.steps", "800"]``): ``--help``
    shows them, the command line overrides them.

    Every mistake in a flag, a path or the task is a `ConfigError` raised before anything is
    spawned or written: ``asyncrl launch`` prints its one line and exits with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "grpo.py"
    target, attr, is_file = split_ref(default_task)
    if is_file and not os.path.isabs(os.path.expanduser(target)) and sys.argv and sys.argv[0]:
        default_task = f"{os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), target)}:{attr}"
    if "--help" in argv or "-h" in argv:
        default = parse_overrides(default_config(argv, _flag_value(argv, "--resume"), default_task), list(defaults))
        usage = (
            f"usage: asyncrl launch [LAUNCH FLAGS] {script} [--resume RUN_DIR] [--config FILE] [--print_config] "
            "[--section.key VALUE ...]"
        )
        print("\n\n".join(part for part in (usage, doc.strip(), help_text(default, OPTIONS)) if part))
        return 0
    files, argv = take_config_files(argv)
    printing, argv = take_switch(argv, "--print_config")
    resume, argv = take_option(argv, "--resume", "RUN_DIR")
    default = parse_overrides(default_config(argv, resume, default_task, files), list(defaults))
    if not resume:  # the flags are parsed before the driver (torch and all) is imported: a typo answers at once
        config = parse_overrides(default, argv, files)
    else:  # the files and flags apply over the resumed run's config.json
        from asyncrl.rl.driver import resumed_config

        config = parse_overrides(resumed_config(default, resume), [*argv, "--run.run_dir", resume], files)
    if printing:
        header = f"Every key of a GRPO run, defaults included (--print_config).\nasyncrl launch {script} --config FILE"
        print(config_file_text(config, header), end="")
        return 0
    from asyncrl.rl.driver import RunStoppedError, check_run, train

    config = check_run(config, resume=bool(resume))
    name_run(os.path.basename(config.run.run_dir))  # in this process's title, its zygote's and its actors'
    try:
        from asyncrl.runtime.config import ENV_PREFIX
        from asyncrl.runtime.zygotes.zygote import PRELOAD

        # Its actors import torch and transformers: once, in a zygote, where no device is visible.
        chosen = os.environ.get(ENV_PREFIX + "ZYGOTE_PRELOAD")  # `asyncrl launch`'s or the caller's
        async with Supervisor(zygote_preload=",".join(PRELOAD) if chosen is None else chosen) as sup:
            await train(config, sup, resume=bool(resume))
    except RunStoppedError as exc:  # every actor is gone by now (the supervisor stopped them)
        print(f"{os.path.splitext(script)[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


def take_config_files(argv: list[str]) -> tuple[list[ConfigFile], list[str]]:
    """Every ``--config FILE`` of ``argv``, read in order (`read_config_file`), and the rest."""
    files: list[ConfigFile] = []
    while True:
        path, argv = take_option(argv, "--config", "FILE")
        if not path:
            return files, argv
        files.append(read_config_file(path))


def take_switch(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """Whether ``flag`` (``--print_config``, or its spelling with -) is in ``argv``, and the rest."""
    spellings = {flag, flag.replace("_", "-")}
    return any(arg in spellings for arg in argv), [arg for arg in argv if arg not in spellings]


def default_config(
    argv: list[str], resume: str, default_task: str = DEFAULT_TASK, files: Sequence[ConfigFile] = ()
) -> GRPOConfig:
    """The default config of the run ``argv`` asks for: of the type of its task (the one
    ``--task.name`` names, else the last ``files``' ``[task]`` table that names one, else that of
    the resumed run's config.json, else ``default_task``; none with a reward function instead),
    whose options are a section of it. A task that cannot be loaded is a one-line `ConfigError`."""
    layers = [_saved_task(resume) if resume else {}]
    layers += [_file_task(file) for file in files]
    layers.append({"name": _flag_value(argv, "--task.name"), "reward": _flag_value(argv, "--task.reward")})
    chosen: dict[str, str] = next((layer for layer in reversed(layers) if layer.get("name") or layer.get("reward")), {})
    name, reward = chosen.get("name") or None, chosen.get("reward") or None
    if reward:
        reward_function(reward)  # its mistakes named as typed, before the rest is parsed
        return GRPOConfig()
    config_type = grpo_config_type(task_class(name or default_task))
    if name or default_task == DEFAULT_TASK:
        return config_type()
    return config_type(task=TaskConfig(name=default_task))  # a script's own default task, kept in config.json


def _flag_value(argv: list[str], flag: str) -> str:
    """The value of the last ``flag value`` or ``flag=value`` in ``argv`` ("" if none), read
    without judging the rest: the full parse names any mistake."""
    value = ""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _file_task(file: ConfigFile) -> dict[str, Any]:
    """The task's name and reward function a config file's ``[task]`` table gives (strings only:
    the full parse names what else is wrong with it)."""
    task = file.values.get("task")
    if not isinstance(task, dict):
        return {}
    return {k: v for k, v in task.items() if k in ("name", "reward") and isinstance(v, str)}


def _saved_task(run_dir: str) -> dict[str, Any]:
    """The task section of the config.json of the run in ``run_dir``; {} when there is none to
    read (`resumed_config` then says what is wrong with the directory)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            task = json.load(f).get("task")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in task.items() if isinstance(v, str)} if isinstance(task, dict) else {}
