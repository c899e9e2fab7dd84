"""The task section (``--task.*``: which task a run trains on), the `TaskSpec` every process builds
the task from, and Countdown's own section (``--countdown.*``).

A task's own options are a section named after it (``--countdown.max_count 5``): the run's config
type gets that section once the task's class is known (`asyncrl.rl.config.grpo.grpo_config_type`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import msgspec

MAX_SOLVE_NUMBERS = 6
"""Most numbers ``solve`` accepts; its exhaustive search grows factorially with the count."""
DEFAULT_TASK = "countdown"
"""The task of a run that names none (no ``--task.name``, no ``--task.reward``)."""


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What the run trains on: a task class (``--task.name``), or a data file scored by a reward
    function (``--task.data`` with ``--task.reward``); with neither, Countdown."""

    name: str = ""
    """The task: a built-in name (countdown), FILE.py:CLASS or MODULE:CLASS naming a subclass of
    asyncrl.rl.tasks.Task; empty: countdown (unless --task.reward is given)."""
    data: str = ""
    """Problems, one per row: a JSONL file (one JSON object per line) or Parquet (.parquet, .pq);
    the rows are the task's problems unless it makes its own."""
    heldout_data: str = ""
    """Held-out problems in a file of their own (JSONL or Parquet): its first --run.n_heldout rows;
    empty: a seeded share of --task.data is held out."""
    reward: str = ""
    """FILE.py:FUNCTION scoring a completion of a --task.data row, fn(row, completion) -> float or
    Score (sync or async); the prompt is the row's --task.prompt_key."""
    prompt_key: str = "prompt"
    """With --task.reward: the key of a row holding its prompt (a string, or a list of
    {"role", "content"} messages)."""
    score_timeout_s: float = 10.0
    """Deadline of one score (or environment step) call; one that overruns it scores 0 and
    counts as failed. For an agent, of its whole episode (every model call included): give it
    room, e.g. 120."""
    max_failure_rate: float = 0.2
    """Share of a sampler's score and step calls that may fail (raise, overrun, return no finite
    number) before the run stops with the first traceback."""
    max_turns: int = 0
    """Model turns per episode of an environment (0: the environment's own max_turns); for an
    agent, its model calls per episode (0: the agent's own max_calls)."""

    def __post_init__(self) -> None:
        if self.name and self.reward:
            raise ValueError(
                f"--task.name {self.name} and --task.reward {self.reward} are two ways to give the "
                "task: give a task class, or a data file with a reward function, not both"
            )
        if self.reward and not self.data:
            raise ValueError(f"--task.reward {self.reward} needs --task.data, the rows it scores (JSONL or Parquet)")
        if self.data and not (self.name or self.reward):
            raise ValueError(
                f"--task.data {self.data} needs --task.reward (a function scoring its rows) or "
                f"--task.name (a task class reading them): {DEFAULT_TASK} makes its own problems"
            )
        if self.reward and ":" not in self.reward:
            raise ValueError(f"--task.reward {self.reward}: give FILE.py:FUNCTION (or MODULE:FUNCTION)")
        if not self.prompt_key:
            raise ValueError("prompt_key must not be empty")
        if not (math.isfinite(self.score_timeout_s) and self.score_timeout_s > 0):
            raise ValueError(f"score_timeout_s must be a finite number > 0, not {self.score_timeout_s!r}")
        if not 0 <= self.max_failure_rate <= 1:
            raise ValueError(f"max_failure_rate must be in [0, 1], not {self.max_failure_rate!r}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0 (0: the environment's own), not {self.max_turns!r}")

    def resolved(self) -> TaskConfig:
        """This section with its paths absolute (the data files, a task or reward file), so a run
        reads the same files from any working directory, a resumed one included."""
        return replace(
            self,
            name=absolute_ref(self.name),
            data=absolute_path(self.data),
            heldout_data=absolute_path(self.heldout_data),
            reward=absolute_ref(self.reward),
        )


class TaskSpec(msgspec.Struct, frozen=True):
    """Everything a process needs to build the run's task (``asyncrl.rl.tasks.loading.load_task``):
    it crosses the spawn to the samplers and the trainer, which build the task themselves."""

    name: str
    """A built-in task ("countdown"), "/ABS/PATH/file.py:Class" or "package.module:Class"; "" with
    ``reward``."""
    options: dict[str, Any] = {}
    """The task's ``Config`` as plain values (its section of the run's config)."""
    data: str = ""
    """Absolute path of the rows of ``Task.data`` (JSONL or Parquet); "" for none."""
    heldout_data: str = ""
    """Absolute path of the rows of ``Task.heldout_data``; "" for none."""
    reward: str = ""
    """"/ABS/PATH/file.py:function" scoring the rows of ``data``; "" for a task class."""
    prompt_key: str = "prompt"
    """With ``reward``: the key of a row's prompt."""
    score_timeout_s: float = 10.0
    """Deadline of one score or step call."""
    max_failure_rate: float = 0.2
    """Share of score and step calls that may fail before the run stops."""
    max_turns: int = 0
    """Model turns per episode of an environment; 0: its own."""


def split_ref(ref: str) -> tuple[str, str, bool]:
    """``"file.py:Name"`` or ``"module:Name"`` as (file or module, attribute, whether a file). A
    target ending in .py or holding a path separator is a file."""
    target, _, attr = ref.rpartition(":")
    return target, attr, target.endswith(".py") or os.sep in target


def absolute_ref(ref: str) -> str:
    """``ref`` with the file of a ``file.py:Name`` made absolute (~ expanded); anything else as is."""
    if ":" not in ref:
        return ref
    target, attr, is_file = split_ref(ref)
    return f"{absolute_path(target)}:{attr}" if is_file else ref


def absolute_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path)) if path else ""


@dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """What problems the generator draws. Every problem is solvable by construction."""

    min_count: int = 3
    """Fewest numbers in a problem."""
    max_count: int = 4
    """Most numbers in a problem (at most MAX_SOLVE_NUMBERS)."""
    max_number: int = 99
    """Numbers are drawn uniformly from 1..max_number, repeats allowed."""
    min_target: int = 1
    """Smallest target."""
    max_target: int = 100
    """Largest target."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_count <= self.max_count <= MAX_SOLVE_NUMBERS:
            raise ValueError(
                f"need 2 <= min_count <= max_count <= {MAX_SOLVE_NUMBERS}, not {self.min_count}..{self.max_count}"
            )
        if not 1 <= self.max_number < 10**6:
            raise ValueError(f"max_number must be in 1..999999, not {self.max_number}")
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError(f"need 1 <= min_target <= max_target, not {self.min_target}..{self.max_target}")
