"""How many held-out problems the embedded model's warm start keeps out of its training, for a task.

`WarmStartConfig.heldout_reserve` (1000) problems of the task's held-out stream are never
warm-started on, so that a run's held-out set (``--run.n_heldout``, at most the reserve, the same
``data_seed``) is unseen. Two kinds of task get another number, said in one line:

- with ``--task.heldout_data`` the held-out problems are a file of their own, which the warm start
  never trains on whatever the reserve: the reserve is the file's rows (asking a 500-row file for
  1000 held-out problems stopped the warm start);
- a task whose problems are a list (the default `Task.splits`, a data file's) with fewer than
  twice the reserve:
  the reserve would take most of them from the warm start (1000 of 1200 left it 200 to train on),
  so it shrinks to the run's ``--run.n_heldout``, the least that keeps the held-out set unseen.

A task that makes its own splits (Countdown's generator) keeps the configured reserve. Torch-free:
the driver's preflight checks the warm start's split with it before anything starts.
"""

from __future__ import annotations

import dataclasses

from asyncrl.rl.config.model import WarmStartConfig
from asyncrl.rl.tasks.base import Task

FULL_RESERVE_SHARE = 2
"""A list task keeps the configured reserve when it has at least this many times as many problems."""


def fitted_warm_start(warm: WarmStartConfig, task: Task, n_heldout: int | None) -> tuple[WarmStartConfig, str]:
    """``warm`` with its ``heldout_reserve`` (and ``eval_problems``, at most the reserve) fitted to
    ``task``, and a line saying what changed and why ("" when nothing did). ``n_heldout``: the
    run's held-out problems (None: not known, the configured reserve is kept for a small task)."""
    reserve, why = warm.heldout_reserve, ""
    if task.heldout_data is not None:
        rows = len(task.heldout_data)
        if rows != reserve:
            reserve = rows
            why = (
                f"the warm start of task {task.task_name()} reserves the {rows} rows of --task.heldout_data "
                f"(not --warm_start.heldout_reserve {warm.heldout_reserve}): it never trains on that file"
            )
    elif _problems_listed(task) and n_heldout is not None:
        problems = len(task.problems())
        if problems < FULL_RESERVE_SHARE * reserve and n_heldout < reserve:
            reserve = n_heldout
            why = (
                f"task {task.task_name()} has {problems} problems: the warm start holds out --run.n_heldout "
                f"{n_heldout} of them, not --warm_start.heldout_reserve {warm.heldout_reserve}, and trains on "
                f"the other {problems - n_heldout}; a task needs {FULL_RESERVE_SHARE * warm.heldout_reserve} "
                "problems or more for the full reserve (or give --task.heldout_data)"
            )
    if reserve == warm.heldout_reserve:
        return warm, ""
    return dataclasses.replace(warm, heldout_reserve=reserve, eval_problems=min(warm.eval_problems, reserve)), why


def _problems_listed(task: Task) -> bool:
    """The task's splits are the default ones over its `Task.problems` list (a data file's too)."""
    from asyncrl.rl.tasks.dataset import RewardFunctionTask

    return type(task).splits in (Task.splits, RewardFunctionTask.splits)
