"""How a run fails and what it records: the errors that stop a run (`RunStoppedError` and its
kinds), `trainer_phase`, which turns a dead or silent trainer into one, a sampler loss (`Fault`),
and faults.jsonl (`append_event`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.errors import ActorDiedError, AsyncrlError, CallTimeoutError

T = TypeVar("T")


class RunStoppedError(AsyncrlError):
    """The run cannot go on; the message names the cause (and the checkpoint to resume from)."""


class TrainerLostError(RunStoppedError):
    """The trainer died or stopped answering; the run stops (resume it from a checkpoint)."""


class PhaseTimeoutError(RunStoppedError, TimeoutError):
    """A phase on the trainer's side, or the wait for a batch, overran its deadline."""


class NoSamplersError(RunStoppedError):
    """Every sampler is lost for good (its restarts used up)."""


class WeightsDivergedError(RunStoppedError):
    """``--run.check_weights``: a member's weights differ from the trainer's after a sync."""


class WeightsUncheckableError(RunStoppedError):
    """``--run.check_weights`` with a sampler whose weights cannot be read as sent (a
    `WeightsUnreadableError`): stopped at the first check, the sampler kept, the fix named."""


class TaskFailedError(RunStoppedError):
    """The task's own code failed too often in a sampler or in the held-out evaluation (its score
    or step raised, hung, or returned no number for more than ``--task.max_failure_rate`` of the
    calls); the message names the task, where, and the first traceback. Fix the task; resume from
    the checkpoint."""


async def trainer_phase(phase: str, knob: str, timeout_s: float, call: Awaitable[T]) -> T:
    """Await a trainer call, turning its death or its silence into a `RunStoppedError`."""
    try:
        return await call
    except ActorDiedError as exc:
        raise TrainerLostError(f"the trainer died during {phase} ({exc.reason})") from exc
    except CallTimeoutError as exc:
        raise PhaseTimeoutError(f"{phase}: the trainer did not answer within --run.{knob} {timeout_s:g} s") from exc


@dataclass
class Fault:
    """One sampler loss: when it was detected, and how long until the run was whole again."""

    sampler: str
    incarnation: int
    cause: str
    step: int
    detected_at: float  # time.time()
    detected_mono: float = field(default=0.0, repr=False)
    recovered_s: float | None = None
    """Detection -> the survivors in a rebuilt group with the current weights."""
    rejoined_s: float | None = None
    """Detection -> its replacement in the group with the current weights (None: never came back)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "detected_mono"}


def append_event(path: str, event: dict[str, Any]) -> None:
    """One line of faults.jsonl (unlike metrics.jsonl, never cut back on resume: it is the record
    of what went wrong, across every segment of a run)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")
