"""What ``asyncrl eval`` evaluates: the policy a path holds (a checkpoint directory, or a
checkpoint's ``model/``), the run directory it is in, and the run config whose task and settings
apply."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from asyncrl.rl.config import ConfigError, parse_overrides
from asyncrl.rl.config.files import RUN_CONFIG
from asyncrl.rl.config.stored import load_run_config
from asyncrl.rl.config.task import DEFAULT_TASK
from asyncrl.rl.launch import default_config


def find_policy(path: str) -> tuple[str, str]:
    """(the policy's checkpoint directory, the run directory it is in, "" if none) of ``path``;
    a path that holds no policy is a one-line `ConfigError` saying what would."""
    what = "give RUN_DIR/final, RUN_DIR/best, a checkpoint (RUN_DIR/checkpoints/step-N) or a Hugging Face checkpoint"
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such directory; {what}")
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is a file, not a directory; {what}")
    if _run_config(path) is not None:
        found = [os.path.join(path, name) for name in ("final", "best") if os.path.isdir(os.path.join(path, name))]
        found = found or [f"{path}/checkpoints/step-N"]
        raise ConfigError(f"{path} is a run directory, not a policy: evaluate {' or '.join(found)}")
    policy = path
    if not os.path.isfile(os.path.join(path, "config.json")):
        model = os.path.join(path, "model")
        if os.path.isfile(os.path.join(model, "config.json")):
            policy = model
        elif os.path.isfile(os.path.join(model, "adapter_config.json")):
            raise ConfigError(
                f"{path} holds LoRA adapters only (a checkpoint of a LoRA run): evaluate the run's final "
                "or best policy, saved merged"
            )
        else:
            raise ConfigError(f"{path} holds no policy (no config.json, nor model/config.json); {what}")
    return os.path.abspath(policy), _run_dir_of(os.path.abspath(policy))


def _run_dir_of(policy: str) -> str:
    """The run directory ``policy`` is in (final/, best/, checkpoints/step-N/model/), or ""."""
    parent = os.path.dirname(policy)
    for _ in range(3):
        if _run_config(parent) is not None:
            return parent
        parent = os.path.dirname(parent)
    return ""


def _run_config(path: str) -> dict | None:
    """``path/config.json`` when it is a run's (a table with a run section), else None."""
    try:
        with open(os.path.join(path, RUN_CONFIG)) as f:
            values = json.load(f)
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) and isinstance(values.get("run"), dict) else None


def eval_config(argv: list[str], run_dir: str, files: Sequence[Any] = ()) -> Any:
    """The run config whose task and evaluation settings apply: the run's config.json (when the
    policy is in a run directory) or the defaults of the task the line names, then ``files`` and
    the flags ``argv``."""
    default = default_config(argv, run_dir, DEFAULT_TASK, files)
    if run_dir:
        default = load_run_config(default, run_dir)
    return parse_overrides(default, argv, files)
