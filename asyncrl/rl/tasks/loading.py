"""Building the run's task from its `TaskSpec`, in each process that needs it.

Problems never cross a process boundary; the spec does (a few strings and the task's options as
plain values), and every process (the driver's checks, each sampler, the trainer) builds the task
from it with `load_task`, once per process (cached by spec). A task is a built-in (``countdown``),
a class in a user's file (``/abs/my_task.py:MyTask``) or in an importable module
(``package.module:MyTask``), or rows of a data file scored by a user's function (``reward``).

Every way this can fail on the user's side (a missing file, an import that raises, a name the file
does not define, a class that is not a `Task`, options its ``Config`` refuses) is a one-line
`TaskLoadError`, a `ConfigError`: ``asyncrl launch`` prints it and exits with status 2. A data file
that gives no rows is a `DatasetError` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.task import DEFAULT_TASK, TaskSpec, absolute_path, split_ref
from asyncrl.rl.tasks.agent import Agent, FunctionAgent
from asyncrl.rl.tasks.base import Environment, Task
from asyncrl.rl.tasks.dataset import DatasetError, RewardFunctionTask, read_rows

__all__ = ["BUILTIN_TASKS", "TaskLoadError", "TaskSpec", "describe_error", "load_task", "reward_function", "task_class"]

BUILTIN_TASKS = {"countdown": "asyncrl.rl.tasks.countdown:Countdown"}
"""Tasks named by a word on the command line (``--task.name countdown``)."""

_MISSING = object()
_LOCK = threading.RLock()  # imports and the cache: a process's threads build each task once
_CACHE: dict[bytes, Task] = {}


class TaskLoadError(ConfigError):
    """The task (or reward function) a run names cannot be loaded: its file or module is missing
    or raised on import, it defines no such name, or that is not a `Task` subclass (a callable,
    for a reward), or the task's options do not fit its ``Config``. One line naming the flag."""


def load_task(spec: TaskSpec) -> Task:
    """The task ``spec`` describes, with the rows of its data files read; one instance per spec
    in a process (later calls return the first one's task)."""
    key = msgspec.json.encode(spec)
    with _LOCK:
        task = _CACHE.get(key)
        if task is None:
            task = _CACHE[key] = _build(spec)
        return task


def task_class(name: str) -> type[Task]:
    """The `Task` subclass ``name`` names: a built-in (``countdown``), ``FILE.py:Class`` (a
    relative path is the working directory's) or ``module:Class``; an async function named so is
    an agent (`FunctionAgent`, its problems the rows of ``--task.data``)."""
    obj = _resolve(name, "--task.name", BUILTIN_TASKS)
    if inspect.iscoroutinefunction(obj):  # an agent: async def agent(problem, client) (tasks/agent.py)
        return FunctionAgent.of(obj)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TaskLoadError(
            f"--task.name {name}: {_described_value(name, obj)}, not a subclass of "
            "asyncrl.rl.tasks.Task nor an agent (an async function of a problem and a client)"
        )
    return obj


def reward_function(ref: str) -> Callable[..., Any]:
    """The function ``FILE.py:function`` (or ``module:function``) names, called as
    ``fn(row, completion)``."""
    obj = _resolve(ref, "--task.reward", {})
    if isinstance(obj, type) or not callable(obj):
        raise TaskLoadError(f"--task.reward {ref}: {_described_value(ref, obj)}, not a function fn(row, completion)")
    return obj


# --- building -------------------------------------------------------------------------------------


def _build(spec: TaskSpec) -> Task:
    if spec.reward:
        if spec.name:
            raise TaskLoadError(f"--task.name {spec.name} and --task.reward {spec.reward}: give one, not both")
        if spec.options:
            raise TaskLoadError(
                f"--task.reward {spec.reward}: a reward function takes no options, given {', '.join(spec.options)}"
            )
        fn = reward_function(spec.reward)
        task: Task = RewardFunctionTask.of(fn, spec.reward)(fn, spec.prompt_key)
        if not spec.data:
            raise TaskLoadError(f"--task.reward {spec.reward} needs --task.data, the rows it scores")
    else:
        task = _construct(task_class(spec.name or DEFAULT_TASK), spec)
    if spec.data:
        task.data = _rows(task, spec.data, "--task.data")
    if spec.heldout_data:
        task.heldout_data = _rows(task, spec.heldout_data, "--task.heldout_data")
    if spec.max_turns and isinstance(task, Agent):
        task.max_calls = spec.max_turns  # an agent's turns are its model calls
    elif spec.max_turns:
        if not isinstance(task, Environment):
            raise TaskLoadError(
                f"--task.max_turns {spec.max_turns}: task {task.task_name()} is single-turn (not an "
                "Environment); leave --task.max_turns at 0"
            )
        task.max_turns = spec.max_turns  # the instance's, over the class's
    return task


def _construct(cls: type[Task], spec: TaskSpec) -> Task:
    name = cls.task_name()
    options_type = cls.Config
    if options_type is None:
        if spec.options:
            raise TaskLoadError(f"task {name} has no options (no Config), but was given {', '.join(spec.options)}")
        args: tuple = ()
    else:
        known = [f.name for f in dataclasses.fields(options_type)] if dataclasses.is_dataclass(options_type) else []
        unknown = [k for k in spec.options if known and k not in known]
        if unknown:
            raise TaskLoadError(
                f"--{name}.{unknown[0]}: task {name} has no such option; its options: {', '.join(known)}"
            )
        try:
            args = (msgspec.convert(spec.options, options_type),)
        except msgspec.ValidationError as exc:  # a wrong type, or the Config's own __post_init__ check
            raise TaskLoadError(
                f"task {name}: its options (--{name}.*) do not fit {options_type.__name__}: {exc}"
            ) from None
    try:
        return cls(*args)
    except Exception as exc:  # the user's constructor: one line with where it raised
        raise TaskLoadError(
            f"task {name}: {cls.__qualname__}({'config' if args else ''}) raised {describe_error(exc)}"
        ) from None


def _rows(task: Task, path: str, flag: str) -> list[dict[str, Any]]:
    try:
        rows, where = read_rows(path)
        if isinstance(task, RewardFunctionTask):
            task.check_rows(rows, where, path)
    except DatasetError as exc:
        raise DatasetError(f"{flag} {exc}") from None
    return rows


# --- resolving a name -----------------------------------------------------------------------------


def _resolve(ref: str, flag: str, builtins: dict[str, str]) -> Any:
    """What ``file.py:name`` or ``module:name`` (or a built-in word) names."""
    if ":" not in ref:
        if ref in builtins:
            ref = builtins[ref]
        else:
            known = f"a built-in task ({', '.join(builtins)}), " if builtins else ""
            raise TaskLoadError(f"{flag} {ref}: give {known}FILE.py:NAME or MODULE:NAME")
    target, attr, is_file = split_ref(ref)
    if not target or not attr:
        raise TaskLoadError(f"{flag} {ref}: give FILE.py:NAME or MODULE:NAME, both parts")
    module = _import_file(target, ref, flag) if is_file else _import_module(target, ref, flag)
    obj: object = module
    for part in attr.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            where = module.__file__ if is_file else target
            raise TaskLoadError(f"{flag} {ref}: {where} has no {attr!r}{_candidates(module, flag)}")
    return obj


def _import_file(target: str, ref: str, flag: str) -> ModuleType:
    path = absolute_path(target)
    if not os.path.exists(path):
        raise TaskLoadError(f"{flag} {ref}: no such file {path}")
    if not os.path.isfile(path):
        raise TaskLoadError(f"{flag} {ref}: {path} is not a file")
    real = os.path.realpath(path)
    with _LOCK:
        # Already loaded, as the script `asyncrl launch` runs or as __main__: the same module, so
        # its classes are the script's own (and its body does not run twice).
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if isinstance(file, str) and os.path.realpath(file) == real:
                return module
        stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0])
        name = f"asyncrl_user_{stem}_{hashlib.sha256(real.encode()).hexdigest()[:12]}"  # stable per path
        spec = importlib.util.spec_from_file_location(name, real)
        if spec is None or spec.loader is None:
            raise TaskLoadError(f"{flag} {ref}: {path} cannot be imported (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses and msgspec look the module up
        folder = os.path.dirname(real)
        if folder not in sys.path:  # as for a script: the file imports its neighbours
            sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            del sys.modules[name]
            raise TaskLoadError(f"{flag} {ref}: importing {path} raised {describe_error(exc)}") from None
        return module


def _import_module(target: str, ref: str, flag: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise TaskLoadError(f"{flag} {ref}: no module named {exc.name} (a file is given as FILE.py:NAME)") from None
        raise TaskLoadError(f"{flag} {ref}: importing {target} raised {describe_error(exc)}") from None
    except (Exception, SystemExit) as exc:
        raise TaskLoadError(f"{flag} {ref}: importing {target} raised {describe_error(exc)}") from None


def _candidates(module: ModuleType, flag: str) -> str:
    """``; it defines: A, B`` (the Task subclasses, or for a reward the functions, defined there)."""

    def fits(value: Any) -> bool:
        if getattr(value, "__module__", None) != module.__name__:
            return False
        if flag == "--task.name":
            return isinstance(value, type) and issubclass(value, Task)
        return callable(value) and not isinstance(value, type)

    names = sorted(k for k, v in vars(module).items() if not k.startswith("_") and fits(v))
    return f"; it defines: {', '.join(names)}" if names else ""


def _described_value(ref: str, obj: Any) -> str:
    """``Name is a class`` / ``a function`` / ``a value of type int``: what the user named instead."""
    attr = ref.rpartition(":")[2]
    if isinstance(obj, type):
        return f"{attr} is a class"
    if isinstance(obj, ModuleType):
        return f"{attr} is a module"
    if inspect.isroutine(obj):
        return f"{attr} is a function"
    return f"{attr} is a value of type {type(obj).__name__}"


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message (file:line)``, the line being where it was raised: a
    user's error in one line."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen ")]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}{': ' + message[0] if message else ''}{where}"
