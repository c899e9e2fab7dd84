"""Resuming a GRPO run: which checkpoint to trust, what to do with damaged ones, the run's records
cut back to the checkpoint's step, and the line that tells a stopped run's user how to go on."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
import time

from asyncrl.errors import RemoteError, first_line
from asyncrl.rl.checkpoint import (
    Checkpoint,
    CheckpointError,
    DamagedCheckpointError,
    list_checkpoints,
    verify_checkpoint,
)
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.faults import append_event, trainer_phase
from asyncrl.rl.driver.fleet.handles import Log
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks
from asyncrl.rl.driver.run_state import read_run_state
from asyncrl.rl.observe.episodes_log import EPISODES_FILE
from asyncrl.rl.observe.metrics import truncate_metrics
from asyncrl.rl.observe.report import shown_path

DEFAULT_SCRIPT = "examples/grpo_countdown.py"
"""How the resume hint names the script when the run was not started by ``asyncrl launch``."""


async def choose_checkpoint(
    run_dir: str, candidates: list[Checkpoint], damaged: list[Checkpoint], log: Log, problems: list[str] | None = None
) -> Checkpoint:
    """The newest of ``candidates`` that passes `verify_checkpoint` (taken off the list with every
    newer one; the damaged ones go into ``damaged``); says in one line what was skipped (with
    ``problems`` found before). Runs before anything is spawned or written."""
    problems = list(problems or [])
    while candidates:
        checkpoint = candidates.pop()
        try:
            verified = await asyncio.to_thread(verify_checkpoint, checkpoint)  # reads every byte: off the loop
            read_run_state(checkpoint)
        except DamagedCheckpointError as exc:
            damaged.append(checkpoint)
            problems.append(str(exc))
            continue
        unverified = "" if verified else " (it has no manifest, written by an older version: unverified)"
        if problems:
            log("; ".join(problems) + f"; resuming from {checkpoint.name}{unverified}")
        elif unverified:
            log(
                f"checkpoint {checkpoint.name} has no manifest (written by an older version): resuming from it "
                "unverified"
            )
        return checkpoint
    raise CheckpointError(f"--resume {run_dir}: no usable checkpoint: " + "; ".join(problems))


async def load_checkpoint(
    trainer: TrainerRanks,
    run: RunConfig,
    run_dir: str,
    checkpoint: Checkpoint,
    candidates: list[Checkpoint],
    damaged: list[Checkpoint],
    log: Log,
) -> Checkpoint:
    """Load ``checkpoint`` into the trainer; one it cannot load (an unverified one, most likely)
    counts as damaged, and the next good one is tried. Returns the one loaded."""
    t = run.deadlines.checkpoint_timeout_s
    while True:
        try:
            await trainer_phase(
                "loading the checkpoint",
                "checkpoint_timeout_s",
                t,
                trainer.with_timeout(t).load_checkpoint(checkpoint.path),
            )
            return checkpoint
        except RemoteError as exc:  # the trainer is fine; the files are not (a load replaces all its state)
            damaged.append(checkpoint)
            reason = exc.remote_type + (f": {first_line(exc.remote_message)}" if exc.remote_message.strip() else "")
            problem = f"checkpoint {checkpoint.name} is damaged (the trainer cannot load it: {reason})"
            if not candidates:
                raise CheckpointError(f"--resume {run_dir}: no usable checkpoint: {problem}") from None
            checkpoint = await choose_checkpoint(run_dir, candidates, damaged, log, [problem])


def move_damaged_aside(damaged: list[Checkpoint], log: Log) -> None:
    """After a resume that skipped damaged checkpoints: they are newer than the one resumed from,
    so they would be listed first by the next resume and counted by pruning. Renamed (not
    deleted: what damaged them may be worth a look) to ``checkpoints/damaged-step-N``."""
    for checkpoint in damaged:
        aside = os.path.join(os.path.dirname(checkpoint.path), "damaged-" + os.path.basename(checkpoint.path))
        try:
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(checkpoint.path, aside)
            log(f"moved the damaged {checkpoint.name} aside to {aside} (delete it when done with it)")
        except OSError as exc:
            log(f"could not move the damaged {checkpoint.name} aside ({exc.strerror or exc}); it stays")


def resume_hint(run_dir: str) -> str:
    written = list_checkpoints(run_dir)  # on disk: the trainer may have died right after a rename
    if not written:
        return "no checkpoint was written yet; nothing to resume"
    return f"resume with: {resume_command(run_dir)} (checkpoint step {written[-1].step})"


def resume_command(run_dir: str) -> str:
    from asyncrl.runtime.worker import SCRIPT_MODULE

    script = getattr(sys.modules.get(SCRIPT_MODULE), "__file__", None) or DEFAULT_SCRIPT
    return f"asyncrl launch {shlex.quote(shown_path(script))} --resume {shlex.quote(shown_path(run_dir))}"


def resume_records(run_dir: str, checkpoint: Checkpoint, step: int, version: int, segment: int, log: Log) -> None:
    """A resumed run's records cut back to its checkpoint's ``step`` (metrics.jsonl and
    episodes.jsonl: the steps after it are trained again), said in a line and recorded as a
    ``resumed`` event (faults.jsonl) of run segment ``segment``."""
    kept = truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), step)
    truncate_metrics(os.path.join(run_dir, EPISODES_FILE), step)  # per step too
    log(
        f"resuming from {checkpoint.path}: step {step}, v{version}; "
        f"metrics.jsonl keeps its {kept} records up to that step"
    )
    append_event(
        os.path.join(run_dir, "faults.jsonl"),
        {
            "event": "resumed",
            "step": step,
            "at": time.time(),
            "detail": checkpoint.path,
            "segment": segment,
        },
    )
