"""The driver's side of a checkpoint (`RunState`, in ``run_state.json``): what it
saves besides the trainer's files, and how a resume reads it back. The trainer writes the bytes
the driver gives it into the checkpoint (``trainer/checkpoint.py``); only the driver reads them."""

from __future__ import annotations

import os

import msgspec

from asyncrl.errors import first_line
from asyncrl.rl.checkpoint import RUN_STATE, Checkpoint, DamagedCheckpointError, SamplerDataState


class RunState(msgspec.Struct):
    """The driver's side of a checkpoint (``run_state.json``)."""

    step: int
    version: int
    samples: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    uniform_skipped: int = 0
    """Groups left out for having one reward for every completion (``run.skip_uniform_groups``)."""
    train_s: float = 0.0
    """Wall seconds of training up to this checkpoint, over every resumed segment."""
    heldout_before: dict[str, float] = {}
    heldout_last: dict[str, float] = {}
    samplers: list[SamplerDataState] = []
    faults: dict[str, int] = {}
    """Fault counters so far (sampler losses, rejoins, ...), carried into the resumed run."""
    segment: int = 0
    """How many resumes led to this checkpoint (0: written by the run's first process tree). The
    group ids of a segment carry it, so that a resumed run (whose samplers number their groups
    from 1 again) never reuses an id of the steps it continues from."""
    samplers_target: int = 0
    """The fleet's size last asked by ``asyncrl scale`` (0: never scaled): a resumed run starts this
    many samplers, not ``--sampler.count``, and keeps it as its target (fleet/scaling.py)."""


def read_run_state(checkpoint: Checkpoint) -> RunState:
    """``checkpoint``'s `RunState`; `DamagedCheckpointError` if it cannot be read or does not decode
    (a resume checks this after `verify_checkpoint`, before it trusts the checkpoint)."""
    try:
        with open(os.path.join(checkpoint.path, RUN_STATE), "rb") as f:
            return msgspec.json.decode(f.read(), type=RunState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DamagedCheckpointError(checkpoint, f"{RUN_STATE}: not a valid run state ({first_line(exc)})") from None
    except OSError as exc:
        raise DamagedCheckpointError(checkpoint, f"{RUN_STATE}: unreadable ({exc.strerror or exc})") from None
