"""`GRPODriver`: the steps of a GRPO run on any task: samplers stream groups, the trainer steps,
weights sync.

    driver (GRPODriver, SamplerPool)  trainer actor (rank 0)        sampler actors (ranks 1..)
    pump per sampler  <------------------------------------------ rollouts() stream
      -> RolloutQueue (bounded, staleness filter)
    step: get_batch -> train_step --------------> GRPO step
          send/receive weights  ----------------> WeightSender ===> WeightReceiver (between decoding steps)

In ``async`` mode the samplers generate while the trainer trains: while it takes step k they
generate for the steps after it, paced by the `Pacer` (pacing.py) so that they begin only groups
that will be trained at most ``max_staleness`` versions after their weights; the queue still
drops (and counts) any older group. New weights go into a sampler between two decoding steps
(``sampler.weight_update``), so
a sync never waits for a batch to finish; a group is tagged with the version it began under. In
``sync`` mode each step's groups are generated after the previous sync and nothing is generated
during training: the synchronous baseline, same code, staleness always 0.

`build_run()` (build.py) spawns the actors and builds the driver's parts, each once, from the run's
config (`DriverParts`; `build_driver`); the samplers, their faults and the weight-sync group are
the `SamplerPool`'s (fleet/pool.py). A step's record is assembled in
step_record.py, the progress (progress.json, ``asyncrl status``) is typed in run_progress.py, the
held-out evaluation and the best policy are heldout.py's, and what the trainer writes into the run
directory (a policy, a checkpoint) saving.py's.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from asyncrl.rl.checkpoint import Checkpoint
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import config_to_dict
from asyncrl.rl.driver.faults import trainer_phase
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle
from asyncrl.rl.driver.fleet.pool import SamplerPool
from asyncrl.rl.driver.fleet.scaling import Scaler
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks
from asyncrl.rl.driver.heldout import BEST_DIR, HeldoutRecord
from asyncrl.rl.driver.resume import resume_records
from asyncrl.rl.driver.run_progress import DriverProgress
from asyncrl.rl.driver.run_state import RunState, read_run_state
from asyncrl.rl.driver.saving import quietly, save_checkpoint, save_policy
from asyncrl.rl.driver.step_record import (
    RunTotals,
    SamplersAfter,
    StepBatch,
    StepResults,
    StepTimes,
    step_record,
)
from asyncrl.rl.observe.episodes_log import EpisodeLog
from asyncrl.rl.observe.metrics import Metrics
from asyncrl.rl.observe.painter import CurvesPainter
from asyncrl.rl.observe.progress import Progress, make_progress
from asyncrl.rl.observe.record import StepRecord, scalars_of
from asyncrl.rl.observe.report import RunSummary, summary_text
from asyncrl.rl.observe.stall import StallWatch
from asyncrl.rl.observe.sync_metrics import preemption_line, sync_record
from asyncrl.rl.observe.writers import MetricWriters
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.sampler.stats import SamplerStats
from asyncrl.runtime.files import write_json_atomic


class Phase(enum.Enum):
    """Where the run is, as progress.json and ``asyncrl status`` say it (``phase``)."""

    STARTING = "starting"
    EVALUATING = "evaluating"
    """The held-out rates before GRPO (a fresh run): it may take a while."""
    TRAINING = "training"
    STOPPED = "stopped"
    FINISHED = "finished"


class Wait(enum.Enum):
    """What the step under way waits for (a stall's line names it)."""

    NOTHING = ""
    BATCH = "batch"
    TRAIN = "train"
    SYNC = "sync"
    CHECK = "check"


class Console:
    """The run's console (``write``: RUN_DIR/log.txt and the terminal) as the driver's parts write
    to it: above the progress bar (``display``) while there is one."""

    def __init__(self, write: Log):
        self.write = write
        self.display: Progress | None = None  # while steps run: the bar (or lines) the console shares

    def log(self, line: str) -> None:
        (self.display.guard(self.write) if self.display is not None else self.write)(line)


@dataclass(frozen=True)
class Segment:
    """Where this segment of the run begins: its run state (a fresh run's zeros, or the one the
    checkpoint resumed from carries) and that checkpoint."""

    state: RunState
    resume: Checkpoint | None = None

    @classmethod
    def of(cls, resume: Checkpoint | None) -> Segment:
        return cls(read_run_state(resume) if resume is not None else RunState(step=0, version=0), resume)

    @property
    def number(self) -> int:
        """Group ids restart in a new process tree (incarnation 1, sequence 1): the segment keeps
        them unique along the run's history (the one metrics.jsonl records)."""
        return self.state.segment + 1 if self.resume is not None else 0

    @property
    def uid_prefix(self) -> str:
        return f"resume{self.number}/" if self.number else ""


@dataclass(frozen=True)
class RunFiles:
    """What the run reads and writes beside its records: its directory, the policy it starts from
    (episodes decode with its tokenizer; the summary names it), RUN_DIR/log.txt."""

    run_dir: str
    model_path: str = ""
    log_path: str = ""


@dataclass(frozen=True)
class DriverParts:
    """What the steps run on, each built once by `build_driver` and handed down whole."""

    trainer: TrainerRanks
    pool: SamplerPool
    """The samplers, with the queue and the pacer their groups go through."""
    heldout: HeldoutRecord
    episodes: EpisodeLog
    console: Console
    scaler: Scaler | None = None
    """``asyncrl scale`` (fleet/scaling.py), where the run has one."""


class GRPODriver:
    """The driver's steps. Sampler faults are the `SamplerPool`'s to recover from; a fault on the
    trainer's side stops the run with a `RunStoppedError` (resume it from the last checkpoint).
    ``correct_reward``: the task's, for groups from a sampler that sends no verdicts."""

    def __init__(
        self,
        config: GRPOConfig,
        parts: DriverParts,
        segment: Segment,
        files: RunFiles,
        *,
        correct_reward: float = 1.0,
    ):
        """The driver's state, one assignment per part with what it is."""
        self.config, self.run = config, config.run
        self.trainer, self.pool, self.scaler = parts.trainer, parts.pool, parts.scaler
        self.queue, self.pacer = parts.pool.queue, parts.pool.pacer
        self.heldout, self.episodes, self.console = parts.heldout, parts.episodes, parts.console
        self.correct_reward = correct_reward
        self.run_dir, self.model_path, self.log_path = files.run_dir, files.model_path, files.log_path
        self.latest: StepRecord | None = None  # the last step's record, for the metrics endpoint
        self.resume, self.state, self.segment = segment.resume, segment.state, segment.number
        self.step_done = self.state.step  # the last step whose record is written
        self.version = self.state.version  # of the trainer's weights: the steps trained (== step_done between steps)
        self.samples, self.tokens = self.state.samples, self.state.tokens  # completion tokens trained on
        self.phase = Phase.STARTING
        self.trained_head: list[RolloutGroup] = []
        self.task_keys: set[str] = set()  # task/* and task_errors/* keys of the steps so far (task_metrics)
        self.last_step_s, self.last_step_at = 0.0, 0.0
        self.checkpoint_path = self.resume.path if self.resume is not None else ""
        self.segment_start = time.monotonic()
        self.began = False  # training began (the held-out rates before it are known)
        self.after_step = ""  # what the driver does after a step's training, while it does it
        self.waiting = Wait.NOTHING  # what the step under way waits for
        self.said_preemptions = False  # the first step whose engines preempted requests said so
        self.stall = StallWatch(
            self.run.observe.stall_factor,
            self.run.observe.stall_floor_s,
            describe=self.describe_stall,
            settled_at=self.pool.settled_at,
            log=self.log,
        )

    def log(self, line: str) -> None:
        """A line on the console (above the progress bar while there is one) and in log.txt."""
        self.console.log(line)

    def probes(self, timeout_s: float) -> dict[str, Callable[[], Awaitable[object]]]:
        """A trivial call per actor, for the deep /healthz: the trainer's communicator count and
        each sampler's counters, both answered from the actor's own memory."""
        probes: dict[str, Callable[[], Awaitable[object]]] = {
            self.trainer.name: lambda: self.trainer.with_timeout(timeout_s).sync_created()
        }
        for m in self.pool.members:
            probes[m.name] = partial(_stats, m.handle, timeout_s)
        return probes

    def snapshot(self) -> dict[str, float]:
        """The numbers of the last step's record and of the progress, for Prometheus."""
        progress = {f"progress_{k}": v for k, v in scalars_of(self.progress().to_dict()).items()}
        latest = self.latest.scalars() if self.latest is not None else {}
        return {
            **latest,
            **progress,
            "progress_step": float(self.step_done),
            "progress_stalled": float(bool(self.stall.reason)),
        }

    def where(self) -> str:
        """Where a stop leaves the run, in words ("at step 137")."""
        if not self.began:
            return "while starting"
        if self.after_step:
            return f"after step {self.step_done} ({self.after_step})"
        return f"at step {self.step_done + 1}"

    def elapsed_s(self) -> float:
        """Training wall time over every segment of the run (a resumed one continues the count)."""
        return self.state.train_s + time.monotonic() - self.segment_start

    def dropped_stale(self) -> int:
        return self.state.dropped_stale + self.queue.stats().dropped_stale

    def length_hists(self) -> dict[str, dict[str, int]]:
        stats = self.queue.stats()
        if not stats.offered_lengths:  # nothing made yet: left out of the progress
            return {}
        return {"generated": stats.offered_lengths, "trained": stats.trained_lengths, "dropped": stats.dropped_lengths}

    def uniform_skipped(self) -> int:
        return self.state.uniform_skipped + self.pool.uniform.total

    def fault_counts(self) -> dict[str, int]:
        carried = self.state.faults
        return {k: carried.get(k, 0) + v for k, v in self.pool.counters.items()}

    def progress(self) -> DriverProgress:
        """The run's progress (run_progress.py): its JSON is written to RUN_DIR/progress.json after
        every step (atomically) and served live by `asyncrl status` (see docs/grpo.md)."""
        return DriverProgress(
            phase=self.phase.value,
            step=self.step_done,
            steps=self.run.steps,
            version=self.version,
            samples=self.samples,
            queue_depth=len(self.queue),
            dropped_stale=self.dropped_stale(),
            uniform_skipped=self.uniform_skipped(),
            heldout_before=self.heldout.before,
            elapsed_s=round(self.elapsed_s(), 3),
            last_step_s=round(self.last_step_s, 3),
            last_step_at=self.last_step_at,
            checkpoint=self.checkpoint_path,
            stalled=self.stall.reason,
            pool=msgspec.structs.replace(self.pool.progress(), faults=self.fault_counts()),
            scaling=self.scaler.progress() if self.scaler is not None else None,
            pacing=self.pacer.stats() if self.pacer is not None else None,
            lengths=self.length_hists(),
            evaluating=self.heldout.under_way.progress() if self.heldout.under_way is not None else None,
            updated_at=time.time(),
        )

    async def describe_stall(self, waited_s: float, limit_s: float) -> str:
        """What the step under way waits for, and from whom (`StallWatch`'s line)."""
        n, queued = self.run.groups_per_step, len(self.queue)
        t = self.run.deadlines
        what = {
            Wait.BATCH: f"waits for {max(n - queued, 0)} of {n} groups ({queued} queued)",
            Wait.TRAIN: f"waits for the trainer's train step (--run.train_timeout_s {t.train_timeout_s:g})",
            Wait.SYNC: f"waits for the weight sync of v{self.version} (--run.sync_timeout_s {t.sync_timeout_s:g})",
            Wait.CHECK: "waits for the weight check",
        }.get(self.waiting, "has not begun")
        samplers = await self.pool.describe(self.run.observe.health_timeout_s)
        paced = f"; paced in flight {self.pacer.in_flight}" if self.pacer is not None else ""
        return (
            f"no step for {waited_s:.0f} s (recent steps took {self.stall.typical_s():.1f} s; a stall after "
            f"{limit_s:.0f} s): step {self.step_done + 1} {what}; {samplers}{paced}"
        )

    def write_progress(self) -> None:
        write_json_atomic(os.path.join(self.run_dir, "progress.json"), self.progress().to_dict())

    async def execute(self) -> dict[str, Any]:
        """The run: the samplers started and the held-out rates before GRPO (`begin`), the steps,
        each followed by what is due after it (`after_step_trained`), then the final policy and the
        summary (`finish`), which this returns."""
        run, observe = self.run, self.run.observe
        if self.resume is not None:
            resume_records(self.run_dir, self.resume, self.step_done, self.version, self.segment, self.log)
        self.console.display = make_progress(run.steps, self.step_done + 1, observe.progress_bar)
        writers = MetricWriters.open(
            self.run_dir, observe, config_to_dict(self.config), first_step=self.step_done + 1, log=self.log
        )
        tensorboard = self.run_dir if writers.tensorboard else ""  # for the summary (writers close before it)
        metrics = Metrics(self.run_dir, self.console.display, writers)
        painter = CurvesPainter(self.run_dir, self.log, enabled=observe.curves)
        completed = False
        watcher: asyncio.Future | None = None  # the stall watch, while the steps run
        try:
            await self.begin()
            watcher = asyncio.ensure_future(self.stall.run())
            for step in range(self.step_done + 1, run.steps + 1):
                started = time.monotonic()
                self.stall.step_began()
                record = await self.step(step)
                self.stall.step_ended(time.monotonic() - started)
                await self.after_step_trained(step, record, started, metrics, painter)
            completed = True
        finally:
            await self.end_steps(completed, watcher, metrics)
        return await self.finish(painter, tensorboard)

    async def begin(self) -> None:
        """The samplers started, where evaluations run, and (a fresh run) the held-out solve rates
        before GRPO; then the run is training."""
        await self.pool.start(self.version, list(self.state.samplers))
        await self.heldout.place(self.pool.membership)
        await asyncio.to_thread(self.episodes.load)
        if self.resume is None:
            self.phase = Phase.EVALUATING  # `asyncrl status` says so: it may take a while
            await self.heldout.before_grpo(self.version)
        self.phase, self.began = Phase.TRAINING, True
        self.write_progress()

    async def after_step_trained(
        self, step: int, record: StepRecord, started: float, metrics: Metrics, painter: CurvesPainter
    ) -> None:
        """What follows step ``step`` (begun at ``started``): its evaluation if due, its record,
        the best policy if it beat the last, its checkpoint if due, the progress."""
        run = self.run
        evaluated = self.heldout.due(step)
        if evaluated:
            await self.heldout.after_step(self.version, record)
        metrics.write(record)  # before the checkpoint: a resume from it keeps this record
        self.episodes.write(step, self.trained_head)
        self.latest = record
        self.step_done, self.last_step_s, self.last_step_at = step, time.monotonic() - started, time.time()
        if evaluated and self.heldout.last["greedy"] > self.heldout.best_greedy():
            self.after_step = "saving the best policy"
            await self.heldout.save_best(step)  # before the checkpoint: a resume from it knows this best
        if run.checkpoints.checkpoint_every and step % run.checkpoints.checkpoint_every == 0:
            self.after_step = "writing its checkpoint"
            await self.checkpoint(step)
        self.after_step = ""
        self.write_progress()
        if evaluated:
            painter.refresh()  # in its thread: the next step starts at once

    async def end_steps(self, completed: bool, watcher: asyncio.Future | None, metrics: Metrics) -> None:
        """The steps ended (``completed``, or stopped): the stall watch, the scaler, the pool and
        the queue closed, the metrics and the progress written as far as they go."""
        if not completed:
            self.phase = Phase.STOPPED
        if watcher is not None:
            watcher.cancel()
            await asyncio.wait({watcher})
        if self.scaler is not None:
            await self.scaler.close()
        await self.pool.close()
        self.queue.close()
        # Best effort: on a full disk these fail too, and must not bury the error that stops the run.
        quietly(metrics.close)
        self.console.display = None
        quietly(self.write_progress)

    async def finish(self, painter: CurvesPainter, tensorboard: str) -> dict[str, Any]:
        """The final policy saved, the curves drawn, the run finished: its summary written, shown
        and returned."""
        run = self.run
        # The last drawing, with every step in it, in its thread while the final policy is saved.
        drawing = asyncio.ensure_future(painter.close())
        self.after_step = "saving the final policy"
        try:
            final_dir = await save_policy(
                self.trainer, run, os.path.join(self.run_dir, "final"), "saving the final policy"
            )
            curves = await drawing
        finally:
            drawing.cancel()  # a failed save does not wait for a picture
        self.after_step = ""
        self.phase = Phase.FINISHED
        self.write_progress()
        wall = self.elapsed_s()
        summary = RunSummary(
            steps=run.steps,
            mode=run.mode,
            heldout_before=self.heldout.before,
            heldout_after=self.heldout.last,
            heldout_problems=self.heldout.problems,
            wall_s=wall,
            samples=self.samples,
            samples_per_s=self.samples / max(wall, 1e-9),
            tokens_per_s=self.tokens / max(wall, 1e-9),
            dropped_stale=self.dropped_stale(),
            uniform_skipped=self.uniform_skipped(),
            checkpoint=final_dir,
            final=final_dir,
            best=({"path": os.path.join(self.run_dir, BEST_DIR), **best} if (best := self.heldout.best) else None),
            initial_policy=self.model_path,
            metrics=os.path.join(self.run_dir, "metrics.jsonl"),
            log=self.log_path,
            curves=curves,
            tensorboard=tensorboard,
            resumed_from=self.resume.path if self.resume is not None else None,
            faults=self.fault_counts(),
            fault_log=[f.to_dict() for f in self.pool.faults],
        )
        summary.write(os.path.join(self.run_dir, "summary.json"))
        self.log(summary_text(summary))
        return summary.to_dict()

    async def step(self, step: int) -> StepRecord:
        run, n = self.run, self.run.groups_per_step
        self.pool.begin_step(step)
        t0 = time.monotonic()
        self.waiting = Wait.BATCH
        if run.mode == "sync":  # generate exactly this step's groups, with the current weights
            await self.pool.generate(n, self.version)
        batch: list[RolloutGroup] = await self.pool.next_batch(n, self.version)
        self.trained_head = batch  # its first episodes go to episodes.jsonl with the record (--run.episodes)
        t1 = time.monotonic()
        self.waiting = Wait.TRAIN
        trained = await trainer_phase(
            f"train step {step}",
            "train_timeout_s",
            run.deadlines.train_timeout_s,
            self.trainer.with_timeout(run.deadlines.train_timeout_s).train_step(batch),
        )
        t2 = time.monotonic()
        self.version = step  # the weights after step k are version k: the step is the one count of both
        synced, digests = sync_record(0.0, None, []), {}
        # An evaluation on the samplers evaluates the weights they hold: the step's, whatever sync_every.
        if self.version % run.sync_every == 0 or (self.heldout.on_samplers and self.heldout.due(step)):
            self.waiting = Wait.SYNC
            if self.scaler is not None:  # a scale request changes the group here, with the sync
                await self.scaler.at_sync()
            synced = await self.pool.sync(self.version)
            streams = self.config.sampler.streams if self.pacer is not None else 1
            if not self.said_preemptions and (line := preemption_line(step, synced, streams)):
                self.log(line)  # once: the step records have every step's
                self.said_preemptions = True
            if run.check_weights:
                self.waiting = Wait.CHECK
                digests = await self.pool.verify_weights()
        self.waiting = Wait.NOTHING
        done = StepBatch(step, self.version, batch, skipped=self.pool.uniform.take())
        self.samples += done.samples
        self.tokens += done.completion_tokens
        return step_record(
            done,
            StepTimes(began=t0, batch_ready=t1, trained=t2),
            StepResults(train=trained, sync=synced, digests=digests),
            RunTotals(self.samples, self.tokens, self.elapsed_s(), self.dropped_stale(), self.task_keys),
            SamplersAfter(len(self.queue), self.pacer, self.pool.take_events(), self.queue.stats().dropped_lengths),
            correct_reward=self.correct_reward,
        )

    async def checkpoint(self, step: int) -> None:
        run = self.run
        state = RunState(
            step=step,
            version=self.version,
            samples=self.samples,
            tokens=self.tokens,
            dropped_stale=self.dropped_stale(),
            uniform_skipped=self.uniform_skipped(),
            train_s=self.elapsed_s(),
            heldout_before=self.heldout.before,
            heldout_last=self.heldout.last,
            samplers=await self.pool.data_states(),
            faults=self.fault_counts(),
            segment=self.segment,
            samplers_target=(self.scaler.target or 0) if self.scaler is not None else 0,
        )
        self.checkpoint_path = await save_checkpoint(
            self.trainer, run, self.run_dir, step, state, self.log, written_at_stop=self.written_at_stop
        )

    def written_at_stop(self, path: str) -> None:
        """A stop came during a checkpoint's write, which finished: the stop's line names it."""
        self.checkpoint_path, self.after_step = path, "its checkpoint written"


async def _stats(handle: SamplerHandle, timeout_s: float) -> SamplerStats:
    return await handle.with_timeout(timeout_s).stats()
