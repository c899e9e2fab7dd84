"""What the sampler, the trainer and the driver need of a task, and nothing more.

A task turns problems into prompts and scores completions against them:

- ``splits(seed, n_train, n_heldout)``: the train split a sampler walks and the held-out split the
  driver reports solve rates on, disjoint and deterministic for their arguments;
- ``prompt(problem)``: the conversation a policy answers (`Prompt`), which a policy's
  ``PromptFormat`` renders as its tokenizer expects;
- ``score(problem, completion)``: the reward of one completion with its breakdown (`Scored`);
- ``correct_reward``: the reward at or above which a completion counts as solving its problem
  (train and held-out solve rates);
- ``name`` and ``problem_type``: how a run and a process boundary name the task's problems
  (problems cross processes as msgspec values, decoded as ``problem_type``).

`score` reads model output, which is untrusted: for any ``str`` it returns a score (a zero
reward for garbage, however long), and a completion that is not a ``str`` is a caller's bug,
refused with `TaskInputError`. Countdown (``tasks/countdown.py``) is the task this package ships;
``tasks/`` is where a user's own tasks and multi-turn environments will go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import msgspec

from asyncrl.errors import AsyncrlError

ProblemT = TypeVar("ProblemT")


class TaskInputError(AsyncrlError, TypeError):
    """A task was handed something that is not a problem or a completion of the kinds it takes
    (a completion as ``bytes``, a problem of another task); the message names the task and what."""


class Message(msgspec.Struct, frozen=True):
    """One turn of a conversation."""

    role: str
    """``system``, ``user`` or ``assistant``, as chat templates name them."""
    content: str


class Prompt(msgspec.Struct, frozen=True):
    """A problem as a policy is asked it: the conversation up to the completion."""

    messages: list[Message]
    """The turns before the completion, which is the next assistant turn."""
    compact: str = ""
    """A terse form for small models trained on it (the embedded model's "compact" prompt style),
    whose last character is the one before the completion; "" where the task has none."""

    @property
    def text(self) -> str:
        """The conversation as plain text (for a policy without a chat template): the turns'
        contents, one per line; a single user turn is its content as is."""
        return "\n".join(m.content for m in self.messages)


@runtime_checkable
class Scored(Protocol):
    """A completion's score; a task's breakdown type adds the parts it is made of (for metrics)."""

    @property
    def reward(self) -> float: ...

    @property
    def correct(self) -> bool:
        """``reward >= correct_reward``: the completion solves its problem."""
        ...

    @property
    def error(self) -> str:
        """Why the completion is not well formed ("" if it is)."""
        ...


class Splits(NamedTuple, Generic[ProblemT]):
    """A task's problems for one run: ``train`` walked by the samplers, ``heldout`` never trained on."""

    train: Sequence[ProblemT]
    heldout: Sequence[ProblemT]


@runtime_checkable
class Task(Protocol[ProblemT]):
    """A task: see the module docstring. Implementations are plain objects (no process, no
    device): each process that needs the task builds its own from its config."""

    @property
    def name(self) -> str:
        """Short name of the task, e.g. ``countdown``."""
        ...

    @property
    def correct_reward(self) -> float:
        """A reward at or above this solves the problem (solve rates count these)."""
        ...

    @property
    def problem_type(self) -> type[ProblemT]:
        """The msgspec-decodable type of the task's problems (how they cross a process boundary)."""
        ...

    def splits(self, seed: int | str, n_train: int, n_heldout: int) -> Splits[ProblemT]:
        """Disjoint train and held-out problems, deterministic for the arguments; the held-out
        split depends on ``(seed, n_heldout)`` only, so runs of any length compare."""
        ...

    def prompt(self, problem: ProblemT) -> Prompt:
        """What a policy is asked for ``problem``."""
        ...

    def score(self, problem: ProblemT, completion: str) -> Scored:
        """The score of ``completion`` (the policy's text after the prompt). Never raises for a
        ``str``; raises `TaskInputError` for anything else."""
        ...
