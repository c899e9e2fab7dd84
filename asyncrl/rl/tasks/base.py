"""The public task API: what a user writes to train on their own problems.

A `Task` turns problems into prompts and scores completions; an `Environment` is a task whose
episodes take several turns (the model answers, the environment replies, up to ``max_turns``).
Subclass one and name it on the command line (``--task.name my_task.py:MyTask``); or give a data
file and a reward function alone (``--task.data problems.jsonl --task.reward my_reward.py:reward``).
docs/tasks.md is the guide; the contract in short:

- **Problems** are plain values: a row of ``--task.data`` (a dict, from JSONL or Parquet) unless the
  task overrides `Task.problems` or `Task.splits` (Countdown draws them from a seeded generator).
  They never cross a process boundary: every process that needs them (samplers, the trainer's
  evaluation, the driver's checks) builds the task and its splits itself, so `splits` must be
  deterministic for its arguments.
- **Prompts**: `Task.prompt` returns a ``str`` (one user message), a list of `Message` (or of
  ``{"role", "content"}`` dicts), or a `Prompt`. A checkpoint with a chat template gets the messages
  through it; the embedded model (and checkpoints without a template) gets the text as is.
- **Scores**: `Task.score` returns a ``float`` or a `Score` (reward, whether it solves the problem,
  named metrics that land in metrics.jsonl as ``task/<name>``), and may be ``async``. It runs in
  the sampler's and the trainer's processes under a deadline (``--task.score_timeout_s``): one that
  raises, hangs or returns something that is not a finite number scores 0 and is counted in the
  metrics by error kind, and the run stops with the first traceback only when more than
  ``--task.max_failure_rate`` of the scores fail.
- **Environments**: `Environment.step` is called after each model turn with the `Episode` so far
  and the model's text; it returns a `Reply`: more text for the model (a tool result, feedback),
  or ``done`` with the episode's reward. The environment's tokens are context, not actions: they
  get no log-probs and no loss. Generation of a turn stops at the model's stop token or at one of
  the environment's ``stop`` strings (e.g. the end of a tool call, ``</calc>``), which the turn's
  text then ends with.
- **Warm start** (the embedded model only): `Task.demonstration` gives the text a perfect model
  writes after the prompt (for an environment, its turns and the replies between them), used to
  warm-start the embedded model on the task; a task without demonstrations needs ``--model_path``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import msgspec

from asyncrl.errors import AsyncrlError

ProblemT = TypeVar("ProblemT")


class TaskError(AsyncrlError):
    """Base class of the errors a task (the user's code or data) causes."""


class TaskInputError(TaskError, TypeError):
    """A task was handed something that is not a problem or a completion of the kinds it takes
    (a completion as ``bytes``, a problem of another task); the message names the task and what."""


class Message(msgspec.Struct, frozen=True):
    """One turn of a conversation."""

    role: str
    """``system``, ``user``, ``assistant`` or ``tool``, as chat templates name them."""
    content: str


class Prompt(msgspec.Struct, frozen=True):
    """A problem as a policy is asked it: the conversation up to the completion."""

    messages: list[Message]
    """The turns before the completion, which is the next assistant turn."""
    compact: str = ""
    """A terse form for small models trained on it (the embedded model's "compact" prompt style),
    whose last character is the one before the completion; "" for the messages' text."""

    @property
    def text(self) -> str:
        """The conversation as plain text (for a policy without a chat template): the turns'
        contents, one per line; a single user turn is its content as is."""
        return "\n".join(m.content for m in self.messages)


class Score(msgspec.Struct, frozen=True):
    """A completion's score."""

    reward: float
    """A finite number; GRPO uses it relative to the other completions of the same prompt."""
    correct: bool | None = None
    """Whether the completion solves the problem (the train and held-out solve rates count these);
    None: ``reward >= task.correct_reward``."""
    metrics: dict[str, float] = {}
    """Named numbers (booleans count as 0/1), averaged per step into metrics.jsonl as ``task/<name>``."""


class Reply(msgspec.Struct, frozen=True):
    """What an environment answers a model turn with."""

    text: str = ""
    """What the environment says back (a tool result, feedback), appended to the context of the
    next turn: as a ``role`` message through a chat template, else verbatim. Not trained on."""
    done: bool = False
    """The episode is over: ``reward`` is its reward, and ``text`` is ignored."""
    reward: float = 0.0
    """The episode's reward, read when ``done``."""
    correct: bool | None = None
    """As `Score.correct`, read when ``done``."""
    metrics: dict[str, float] = {}
    """As `Score.metrics`; those of every reply of an episode are summed."""
    role: str = "tool"
    """The chat role ``text`` is given under a chat template (``tool`` or ``user``)."""


class Episode:
    """One rollout of an environment: the problem, the conversation so far, and a dict the
    environment may keep its own state in (a sandbox handle, the tool calls made)."""

    def __init__(self, problem: Any, prompt: Prompt):
        self.problem = problem
        self.prompt = prompt
        self.turns: list[Message] = []
        """The model's turns (``assistant``) and the environment's replies, in order."""
        self.state: dict[str, Any] = {}

    @property
    def model_turns(self) -> int:
        return sum(m.role == "assistant" for m in self.turns)


class Splits(NamedTuple, Generic[ProblemT]):
    """A task's problems for one run: ``train`` walked by the samplers, ``heldout`` never trained on."""

    train: Sequence[ProblemT]
    heldout: Sequence[ProblemT]


class Task(Generic[ProblemT]):
    """A single-turn task. Subclass it; override `prompt` and `score`, and where the problems do not
    come from ``--task.data``, `problems` or `splits`. See the module docstring for the contract.

    ``Config``: a frozen dataclass of the task's own options, or None. It becomes a section of the
    command line named after the task (``--countdown.max_count 5``), shown by ``--help``, saved in
    config.json; the task is built as ``cls(config)``. A task without one is built as ``cls()``.
    """

    name: ClassVar[str] = ""
    """Short name (metrics, logs, the options' section); "" means the class name in lower case."""
    correct_reward: ClassVar[float] = 1.0
    """A reward at or above this solves the problem (unless `Score.correct` says otherwise)."""
    Config: ClassVar[type | None] = None

    def __init__(self, config: Any = None):
        self.config = config
        self.data: Sequence[Any] = ()
        """The rows of ``--task.data`` (set by the loader before first use; empty without a file)."""
        self.heldout_data: Sequence[Any] | None = None
        """The rows of ``--task.heldout_data``, or None: then `splits` holds out part of ``data``."""

    @classmethod
    def task_name(cls) -> str:
        return cls.name or cls.__name__.lower()

    # --- problems -------------------------------------------------------------------------------

    def problems(self) -> Sequence[ProblemT]:
        """Every problem; by default the rows of ``--task.data``."""
        if not self.data:
            raise TaskError(
                f"task {self.task_name()}: no problems: give a data file with --task.data "
                "(JSONL or Parquet), or override problems() or splits()"
            )
        return self.data

    def splits(self, seed: int | str, n_train: int, n_heldout: int) -> Splits[ProblemT]:
        """Disjoint train and held-out problems, deterministic for the arguments; the held-out split
        depends on ``(seed, n_heldout)`` only (a prefix of a longer one), so runs of any length
        compare. By default: ``--task.heldout_data`` (its first ``n_heldout`` rows) if given, else
        the first ``n_heldout`` problems of a seeded shuffle of `problems`; the train split is (up
        to ``n_train`` of) the rest, in file order."""
        return default_splits(self, seed, n_train, n_heldout)

    # --- prompting and scoring ------------------------------------------------------------------

    def prompt(self, problem: ProblemT) -> Prompt | str | list[Message] | list[dict[str, str]]:
        """What the policy is asked for ``problem``."""
        raise NotImplementedError(f"task {self.task_name()} must define prompt(problem)")

    def score(self, problem: ProblemT, completion: str) -> float | Score | Awaitable[float | Score]:
        """The reward of ``completion`` (the policy's text after the prompt, stop token removed).
        Model text is untrusted: parse it, never ``eval`` it."""
        raise NotImplementedError(f"task {self.task_name()} must define score(problem, completion)")

    def demonstration(self, problem: ProblemT) -> str | list[str] | None:
        """What a perfect model writes for ``problem``, for the embedded model's warm start: the
        completion (a ``str``), or for an environment the turns alternating model, environment,
        model, ... (a list; the environment's are not trained on). None: the task has none."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the task's problems and formats, for the warm start's cache key: by
        default the name, the options and three problems' prompts and demonstrations."""
        return default_fingerprint(self)


class Environment(Task[ProblemT]):
    """A multi-turn task: `prompt` opens the episode, `step` answers each model turn.

    ``max_turns``: model turns per episode; an episode still open after the last one is truncated
    with reward ``truncated_reward`` (counted in metrics as ``episodes_truncated``). ``stop``:
    strings that end a model turn besides its stop token (a tool call's closing tag)."""

    max_turns: int = 4  # a class default an instance may override (`load_task`: --task.max_turns)
    stop: ClassVar[Sequence[str]] = ()
    truncated_reward: ClassVar[float] = 0.0

    def step(self, episode: Episode, completion: str) -> Reply | Awaitable[Reply]:
        """The environment's answer to the model's latest turn ``completion`` (also the last
        of ``episode.turns``)."""
        raise NotImplementedError(f"environment {self.task_name()} must define step(episode, completion)")

    def score(self, problem: ProblemT, completion: str) -> float | Score:
        raise TaskError(f"environment {self.task_name()}: episodes are scored by step(), not score()")


def as_prompt(value: Prompt | str | list) -> Prompt:
    """A task's `Task.prompt` result as a `Prompt`; `TaskInputError` for anything else."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, str):
        return Prompt([Message("user", value)], compact=value)
    if isinstance(value, list) and value:
        messages = []
        for m in value:
            if isinstance(m, Message):
                messages.append(m)
            elif isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
                messages.append(Message(m["role"], m["content"]))
            else:
                raise TaskInputError(
                    f"a prompt message must be a Message or a dict with 'role' and 'content' strings, not {m!r:.80}"
                )
        return Prompt(messages)
    raise TaskInputError(f"prompt() must return a str, a non-empty list of messages or a Prompt, not {value!r:.80}")


def as_score(value: Any, correct_reward: float) -> Score:
    """A `Task.score` result as a `Score`; `TaskInputError` unless it is a finite number or a
    `Score` with a finite reward and numeric metrics."""
    if isinstance(value, Score):
        score = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        score = Score(float(value))
    else:
        raise TaskInputError(f"score() must return a number or a Score, not {type(value).__name__}")
    reward = score.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TaskInputError(f"score() returned a reward of {reward!r}, not a finite number")
    metrics = {}
    for k, v in score.metrics.items():
        if not isinstance(k, str) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise TaskInputError(f"score() metric {k!r} is {v!r}, not a finite number")
        metrics[k] = float(v)
    correct = score.correct if score.correct is not None else reward >= correct_reward
    return Score(float(reward), bool(correct), metrics)


# --- the defaults of splits() and fingerprint() -------------------------------------------------

FINGERPRINT_PROBES = 3
"""Problems whose prompt and demonstration go into `default_fingerprint`."""


def default_splits(task: Task, seed: int | str, n_train: int, n_heldout: int, *, salt: str | None = None) -> Splits:
    """`Task.splits` of a task whose problems are a list: the first ``n_heldout`` rows of
    ``task.heldout_data`` when it has them (a `TaskError` if fewer), the train split then being the
    first ``n_train`` problems; otherwise the first ``n_heldout`` of a shuffle of the problems seeded
    by ``(salt, seed)`` (``salt``: the task's name), the train split being up to ``n_train`` of the
    others, in their order. The held-out split depends on ``(seed, n_heldout)`` and the problems
    only (a prefix of a longer one's); a `TaskError` when it would leave nothing to train on."""
    name = task.task_name()
    if task.heldout_data is not None:
        if len(task.heldout_data) < n_heldout:
            raise TaskError(
                f"task {name}: --run.n_heldout {n_heldout} is more than the {len(task.heldout_data)} "
                "rows of --task.heldout_data: give a smaller --run.n_heldout or more rows"
            )
        return Splits(list(task.problems()[:n_train]), list(task.heldout_data[:n_heldout]))
    problems = task.problems()
    if n_heldout >= len(problems):
        raise TaskError(
            f"task {name}: --run.n_heldout {n_heldout} holds out all {len(problems)} problems, leaving "
            "none to train on: give a smaller --run.n_heldout, more problems, or --task.heldout_data"
        )
    order = list(range(len(problems)))
    random.Random(f"{name if salt is None else salt}/{seed}/split").shuffle(order)
    held = order[:n_heldout]
    taken = set(held)
    train = [p for i, p in enumerate(problems) if i not in taken][:n_train]
    return Splits(train, [problems[i] for i in held])


def default_fingerprint(task: Task, prompts: bool = True) -> dict[str, Any]:
    """`Task.fingerprint` by default: the task's name, its options, and the prompt (compact form,
    else text; not with ``prompts`` False, for an agent, which has none) and demonstration of the
    first `FINGERPRINT_PROBES` train problems of ``splits(0, 3, 3)``; for a task with a data file,
    also a digest of its rows (and of the held-out rows), since the warm start trains on them.
    JSON values only."""
    config = task.config
    options = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else None
    probes = task.splits(0, FINGERPRINT_PROBES, FINGERPRINT_PROBES).train[:FINGERPRINT_PROBES]
    probe = []
    for problem in probes:
        if not prompts:
            probe.append([task.demonstration(problem)])
            continue
        prompt = as_prompt(task.prompt(problem))
        probe.append([prompt.compact or prompt.text, task.demonstration(problem)])
    fingerprint: dict[str, Any] = {"task": task.task_name(), "options": options, "probe": probe}
    if task.data:
        fingerprint["data"] = _digest(task.data)
    if task.heldout_data is not None:
        fingerprint["heldout_data"] = _digest(task.heldout_data)
    return fingerprint


def _digest(rows: Sequence[Any]) -> str:
    """Of the rows' values (not of the file: the same rows from JSONL and Parquet digest alike)."""
    return hashlib.sha256(msgspec.json.encode(list(rows), enc_hook=repr, order="sorted")).hexdigest()[:20]
