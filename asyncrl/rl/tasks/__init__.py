"""Tasks: what a policy is asked and how its answers are scored.

``base.py`` is the public task API a user subclasses (`Task`, `Environment`, `Score`, `Reply`, ...);
``dataset.py`` reads problems from JSONL or Parquet files and splits them; ``loading.py`` builds the
run's task from its `TaskSpec` in every process; ``countdown.py`` is the task shipped with asyncrl,
written on the public API alone, and ``arith.py`` the parser its reward reads model output with.
"""

from asyncrl.rl.tasks.agent import Agent, FunctionAgent
from asyncrl.rl.tasks.base import (
    Environment,
    Episode,
    Message,
    Prompt,
    Reply,
    Score,
    Splits,
    Task,
    TaskError,
    TaskInputError,
    as_prompt,
    as_score,
)
from asyncrl.rl.tasks.dataset import DatasetError, RewardFunctionTask, load_rows
from asyncrl.rl.tasks.loading import TaskLoadError, TaskSpec, load_task, task_class

__all__ = [
    "Agent",
    "DatasetError",
    "FunctionAgent",
    "Environment",
    "Episode",
    "Message",
    "Prompt",
    "Reply",
    "RewardFunctionTask",
    "Score",
    "Splits",
    "Task",
    "TaskError",
    "TaskInputError",
    "TaskLoadError",
    "TaskSpec",
    "as_prompt",
    "as_score",
    "load_rows",
    "load_task",
    "task_class",
]
