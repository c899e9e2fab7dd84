"""Saving into the run directory through the trainer (a policy: final, best; a checkpoint), and a
full disk or a failing filesystem there as the run's one error, `RunDirError`.

The trainer's own write error (`CheckpointWriteError`) and the driver's (an `OSError` of a full,
read-only or failing disk) both become one line naming what could not be written, where, and the
system's reason; other errors are bugs and stay as they are.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable

import msgspec

from asyncrl.errors import RemoteError
from asyncrl.rl.checkpoint import CheckpointWriteError, write_reason
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.faults import RunStoppedError, trainer_phase
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks
from asyncrl.rl.driver.run_state import RunState

_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def _message(error: CheckpointWriteError) -> str:
    """The trainer's one line, without the remote call's prefix (one raised here has no prefix)."""
    return error.remote_message if isinstance(error, RemoteError) else str(error)


class RunDirError(RunStoppedError):
    """The run directory cannot be written (a full disk, a read-only or failing filesystem); the
    message names what could not be written, where, and the system's reason."""


def run_dir_error(exc: BaseException, run_dir: str) -> RunDirError | None:
    """A full disk or a failing filesystem under the run directory, as one line (a full one
    named, with what is left: `write_reason`); None for others."""
    if isinstance(exc, RunDirError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        path = exc.filename or run_dir
        return RunDirError(f"cannot write {path}: {write_reason(exc, path)}")
    return None


async def save_policy(
    trainer: TrainerRanks, run: RunConfig, path: str, phase: str, extra_files: dict[str, str] | None = None
) -> str:
    """The trainer's policy written whole at ``path``, with ``extra_files`` (name -> text) inside;
    returns the directory. ``phase`` names the write in the error of a trainer that dies or overruns."""
    t = run.deadlines.checkpoint_timeout_s
    try:
        return await trainer_phase(
            phase, "checkpoint_timeout_s", t, trainer.with_timeout(t).save(path, extra_files or {})
        )
    except CheckpointWriteError as exc:  # a full disk: one line, the run's own error (others are bugs: as they are)
        raise RunDirError(_message(exc)) from None


async def save_checkpoint(
    trainer: TrainerRanks,
    run: RunConfig,
    run_dir: str,
    step: int,
    state: RunState,
    log: Callable[[str], None],
    written_at_stop: Callable[[str], None],
) -> str:
    """The checkpoint of ``step`` with the driver's ``state`` in it; returns its path.
    ``written_at_stop`` is told the path when a stop came during the write and it finished."""
    t = run.deadlines.checkpoint_timeout_s
    call = asyncio.ensure_future(
        trainer_phase(
            f"writing the checkpoint of step {step}",
            "checkpoint_timeout_s",
            t,
            trainer.with_timeout(t).save_checkpoint(
                run_dir, step, run.checkpoints.keep_checkpoints, msgspec.json.encode(state)
            ),
        )
    )
    try:
        return await asyncio.shield(call)
    except CheckpointWriteError as exc:  # a full disk: one line, the run's own error (others are bugs: as they are)
        raise RunDirError(_message(exc)) from None
    except asyncio.CancelledError:
        # A stop (Ctrl-C) during the write: let it finish (bounded by its deadline), so the
        # resume hint names the checkpoint that will really be resumed. A second signal
        # cancels this wait too and stops at once (the write is atomic either way).
        if not call.done():
            log(f"stopping: finishing the checkpoint of step {step} first")
            await asyncio.wait({call})
        if not call.cancelled() and call.exception() is None:
            written_at_stop(call.result())
        raise


def quietly(fn: Callable[[], object]) -> None:
    """Clean-up writes while the run stops: a full disk fails them too, and the error that stopped
    the run (raised on) already says so; a second one would only bury it."""
    try:
        fn()
    except OSError:
        pass
