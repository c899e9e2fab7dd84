"""The fully-async GRPO loop on Countdown: samplers stream groups, the trainer steps, weights sync.

    driver (this module)            trainer actor (rank 0)        sampler actors (ranks 1..)
    pump per sampler  <------------------------------------------ rollouts() stream
      -> RolloutQueue (bounded, staleness filter)
    step: get_batch -> train_step --------------> GRPO step
          send/receive weights  ----------------> WeightSender ===> WeightReceiver (between decoding steps)

In ``async`` mode the samplers never stop: while the trainer takes step k they generate for step
k+1 with weights at most ``max_staleness`` versions old, and the queue drops (and counts) older
groups. New weights go into a sampler between two decoding steps (``sampler.weight_update``), so
a sync never waits for a batch to finish; a group is tagged with the version it began under. In ``sync`` mode each step's groups are generated after the previous sync and nothing is
generated during training: the synchronous baseline, same code, staleness always 0.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncrl.errors import RemoteError, first_line
from asyncrl.rl.checkpoint import Checkpoint, CheckpointError, RunState, list_checkpoints, truncate_metrics, write_json_atomic
from asyncrl.rl.config import ConfigError, config_to_dict
from asyncrl.rl.countdown import CORRECT_REWARD, CountdownConfig, train_and_heldout
from asyncrl.rl.recovery import RunStoppedError, SamplerPool, append_event, trainer_phase
from asyncrl.rl.report import rates_text, shown_path, summary_text
from asyncrl.rl.resume import choose_checkpoint, load_checkpoint, move_damaged_aside, resume_hint
from asyncrl.rl.rollout import RolloutGroup, RolloutQueue
from asyncrl.rl.runlog import LOG_FILE, RunLog
from asyncrl.rl.sections import ModelConfig, TrainerConfig, WarmStartConfig
from asyncrl.runtime import signals

BEST_DIR, BEST_JSON = "best", "best.json"
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


class RunDirError(RunStoppedError):
    """The run directory cannot be written (a full disk, a read-only or failing filesystem); the
    message names what could not be written, where, and the system's reason."""


@dataclass(frozen=True)
class RunSection:
    steps: int = 500
    """Optimiser steps to take."""
    groups_per_step: int = 16
    """Prompts (groups of ``sampler.group_size`` completions) in one training batch."""
    mode: str = "async"
    """'async': samplers generate continuously; 'sync': generate, then train, then sync (baseline)."""
    max_staleness: int = 1
    """Async mode: train on groups at most this many weight versions old; older ones are dropped."""
    queue_capacity: int = 0
    """Rollout queue bound in groups (0: two batches). Samplers wait when it is full."""
    sync_every: int = 1
    """Send the weights to the samplers after every this many steps."""
    eval_every: int = 100
    """Held-out solve rates every this many steps (and before the first and after the last)."""
    eval_samples: int = 4
    """Sampled completions per held-out problem for the sampled solve rate (0: greedy only)."""
    n_train: int = 50000
    """Problems in the train split (a run of the default length sees most of them once, so the
    train solve rate is measured on problems new to the policy)."""
    n_heldout: int = 500
    """Problems in the held-out split (never trained on; at most the warm start's heldout_reserve)."""
    seed: int = 0
    """Seed of the samplers and the trainer (runs that differ only in it share the problems)."""
    data_seed: int = 0
    """Seed of the train and held-out splits. With the embedded model it must be the warm start's
    ``data_seed``: that is the split whose held-out problems the warm start never saw."""
    run_dir: str = ""
    """Where config.json, metrics.jsonl and checkpoints go (default: runs/grpo-<time>)."""
    checkpoint_every: int = 50
    """Write a resumable checkpoint (policy, optimiser, RNGs, step, weight version, data position)
    to run_dir/checkpoints every this many steps (0: none). Resume with ``--resume RUN_DIR``."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept, the newest; older ones are deleted after each write."""
    sampler_max_restarts: int = 3
    """Times the supervisor restarts a lost sampler; each replacement rejoins the weight-sync group
    and takes the current weights before it generates."""
    device: str = "auto"
    """'auto' (one GPU each for trainer and samplers when there are enough, else CPU), 'cpu' or 'cuda'."""
    generate_timeout_s: float = 600.0
    """Deadline of a sampler's next rollout group while the driver waits for it; a sampler that
    overruns it is lost (killed, restarted, rejoined) and the run goes on."""
    queue_timeout_s: float = 1800.0
    """Deadline of a step's batch from all samplers together (longer than generate_timeout_s, so a
    stuck sampler is replaced first); overrun: the run stops, naming each sampler's state."""
    train_timeout_s: float = 900.0
    """Deadline of one train step on the trainer; overrun: the run stops."""
    sync_timeout_s: float = 300.0
    """Deadline of a weight sync (and of agreeing on the layout) on every member; a sampler that
    does not finish it in time is lost, a trainer that does not stops the run."""
    eval_timeout_s: float = 3600.0
    """Deadline of one held-out evaluation on the trainer; overrun: the run stops."""
    checkpoint_timeout_s: float = 600.0
    """Deadline of writing a checkpoint (or the final policy); overrun: the run stops."""
    rendezvous_timeout_s: float = 120.0
    """Deadline of forming, or rebuilding, the weight-sync group."""
    restart_timeout_s: float = 300.0
    """How long a lost sampler's restart is awaited before it counts as gone for good."""
    check_weights: bool = False
    """After every sync, compare a digest of the weights on the trainer and on every sampler; a
    mismatch stops the run (tests and debugging: one pass over the weights per member and sync).
    HF samplers only: a run with a vLLM sampler is refused at the start."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', not {self.mode!r}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, not {self.eval_samples!r}")
        for name in ("steps", "groups_per_step", "sync_every", "eval_every", "n_train", "n_heldout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)!r}")
        for name in ("max_staleness", "queue_capacity", "checkpoint_every", "sampler_max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, not {self.keep_checkpoints!r}")
        for name in ("generate_timeout_s", "queue_timeout_s", "train_timeout_s", "sync_timeout_s", "eval_timeout_s",
                     "checkpoint_timeout_s", "rendezvous_timeout_s", "restart_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, not {getattr(self, name)!r}")
        if self.generate_timeout_s >= self.queue_timeout_s:
            raise ValueError(f"generate_timeout_s ({self.generate_timeout_s:g}) must be shorter than queue_timeout_s "
                             f"({self.queue_timeout_s:g}): a stuck sampler is replaced before the run gives up")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")


@dataclass(frozen=True)
class SamplerSection:
    count: int = 1
    """Number of sampler actors."""
    group_size: int = 8
    """Completions per prompt."""
    prompts_per_batch: int = 8
    """Prompts a sampler generates for at once."""
    max_new_tokens: int = 0
    """Completion length limit (0: what the model suggests)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    weight_update: str = "in_flight"
    """How new weights enter a sampler: 'in_flight' (between two decoding steps of the batch being
    generated, which finishes on them) or 'pause' (after that batch finishes)."""
    backend: str = "auto"
    """Inference engine: 'vllm', 'hf' (transformers), or 'auto' (vLLM where it is installed and
    supports the sampler's device, else hf; each sampler logs which it picked). See docs/vllm.md."""

    def __post_init__(self) -> None:
        if self.weight_update not in ("in_flight", "pause"):
            raise ValueError(f"weight_update must be 'in_flight' or 'pause', not {self.weight_update!r}")
        if self.backend not in ("auto", "vllm", "hf"):
            raise ValueError(f"backend must be 'auto', 'vllm' or 'hf', not {self.backend!r}")
        if self.count < 1 or self.group_size < 2 or self.prompts_per_batch < 1:
            raise ValueError("need count >= 1, group_size >= 2 (GRPO compares within a group), prompts_per_batch >= 1")


@dataclass(frozen=True)
class GRPOConfig:
    run: RunSection = field(default_factory=RunSection)
    model_path: str = ""
    """A local Hugging Face checkpoint directory; empty: the embedded default model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the embedded default model."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of the embedded default model (cached on disk)."""
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class Metrics:
    """metrics.jsonl in the run directory, and what the progress line shows."""

    def __init__(self, run_dir: str, steps: int):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.steps = steps
        self.tty = sys.stdout.isatty()
        self.start = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        heldout = record.get("heldout_solve_rate")
        line = (f"step {record['step']:>4}/{self.steps}  reward {record['reward_mean']:.3f}  "
                f"solve {record['train_solve_rate']:.2f}  stale {record['staleness_mean']:.2f}  "
                f"samples/s {record['samples_per_s']:.1f}  tok/s {record['tokens_per_s']:.0f}  "
                + (f"held-out {heldout:.2f} greedy {record.get('heldout_sampled_solve_rate', float('nan')):.2f} "
                   "sampled  " if heldout is not None else "")
                + f"{time.monotonic() - self.start:.0f}s")
        if self.tty:
            print("\r" + line, end="\n" if heldout is not None else "", flush=True)  # evals stay visible
        elif heldout is not None or record["step"] % max(1, self.steps // 50) == 0:  # a log, not a bar
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()
        self.file.close()


async def train(config: GRPOConfig, sup, *, log=print, resume: bool = False) -> dict[str, Any]:
    """Run GRPO with ``config`` on the actors of ``sup``; returns the summary (also in the run dir).
    ``resume``: continue the run in ``config.run.run_dir`` from its newest good checkpoint (checked
    against its manifest; a damaged one is skipped, and said so). Raises a `RunStoppedError` (its
    message names the cause and ends with how to resume) if the run cannot go on, a
    `CheckpointError` (one line) if there is nothing good to resume from. On every stop, a
    signal included, one line says what can be resumed and faults.jsonl gets a ``stopped``
    event. What the console shows is kept in RUN_DIR/log.txt (`RunLog`)."""
    from asyncrl.rl.model import default_model
    from asyncrl.rl.sampler import SamplerActor, SamplingParams
    from asyncrl.rl.trainer import TrainerActor
    from asyncrl.runtime.devices import detect
    from asyncrl.rl.preflight import check_run

    config = check_run(config, resume=resume)  # paths and limits, before anything is spawned or written
    run = config.run
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars would bury the progress line
    run_dir = os.path.abspath(run.run_dir or os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S")))
    os.makedirs(run_dir, exist_ok=True)
    console = RunLog(os.path.join(run_dir, LOG_FILE), log)
    log = console.log
    loop: _Loop | None = None
    committed = False  # config.json written: from here on a stop is recorded in the run directory

    def progress() -> dict[str, Any]:  # for `asyncrl status`, called on this event loop per request
        if loop is None:
            return {"phase": "starting", "steps": run.steps}
        if hasattr(loop, "progress"):
            return loop.progress()
        return {"phase": "training", "steps": run.steps, "version": loop.version, "samples": loop.samples,
                "queue_depth": len(loop.queue), "dropped_stale": loop.queue.stats().dropped_stale}

    def commit(checkpoint: Checkpoint | None) -> None:
        """The run is known to start (fresh) or to resume (the trainer loaded the checkpoint):
        only now is the run directory changed (a refused or failed resume leaves it as it was)."""
        nonlocal committed
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(config), f, indent=2, default=str)
        committed = True
        console.open(f"resumed from {checkpoint.name}" if checkpoint is not None else "new run")

    def stopped(cause: str, detail: str) -> tuple[str, str]:
        """Record a stop (faults.jsonl, once the run directory is ours); returns where the run
        stopped ("at step 137") and the line that says what resumes it."""
        where = loop.where() if loop is not None else "while starting"
        if committed:
            try:
                append_event(os.path.join(run_dir, "faults.jsonl"), {
                    "event": "stopped", "cause": cause, "step": loop.step_done + 1 if loop is not None else 0,
                    "at": time.time(), "detail": detail or f"stopped {where} by {cause}"})
            except OSError:
                pass  # a full disk: the stop itself is what the user needs to hear about
        return where, resume_hint(run_dir)

    status = await sup.serve_status(run_dir, progress=progress)
    console.__enter__()
    try:
        candidates = list_checkpoints(run_dir)
        if resume and not candidates:
            first = (f"the first is written at step {run.checkpoint_every}" if run.checkpoint_every
                     else "the run writes none")
            raise CheckpointError(f"--resume {run_dir}: no checkpoint was written yet ({first}, "
                                  f"--run.checkpoint_every {run.checkpoint_every}); nothing to resume")
        damaged: list[Checkpoint] = []
        checkpoint = await choose_checkpoint(run_dir, candidates, damaged, log) if resume else None
        if checkpoint is None:
            commit(None)
        stop_warm_start = threading.Event()  # a cancel (Ctrl-C) must stop the warm start's thread too:
        try:  # asyncio's shutdown waits for the thread, which would otherwise finish the warm start first
            model_path = config.model_path or await asyncio.to_thread(
                default_model, config.model, config.warm_start, config.countdown, log=log, stop=stop_warm_start)
        except asyncio.CancelledError:
            stop_warm_start.set()
            raise
        kind, ids = detect("auto")
        cuda = run.device == "cuda" or (run.device == "auto" and kind == "cuda" and len(ids) >= 1 + config.sampler.count)
        device, gpus = ("cuda", 1) if cuda else ("cpu", 0)
        train_split, heldout = train_and_heldout(run.data_seed, run.n_train, run.n_heldout, config.countdown)
        log(f"run dir {run_dir}; model {model_path}; {device}; {config.sampler.count} sampler(s); mode {run.mode}")

        trainer_fields = config_to_dict(config.trainer) | {"temperature": config.sampler.temperature}
        # On CPU, one thread per actor: torch's default (a thread per core in every process) makes the
        # actors of one host fight over the same cores, and throughput collapses.
        env = {"TQDM_DISABLE": "1"} | ({} if cuda else {"OMP_NUM_THREADS": "1"})
        # No restarts for the trainer: a new one would start from the initial weights. Losing it
        # stops the run, which resumes from its last checkpoint instead.
        trainer = await sup.spawn(TrainerActor, model_path, trainer_fields, name="trainer", gpus=gpus, env=env,
                                  kwargs={"device": device, "seed": run.seed})
        if checkpoint is not None:
            checkpoint = await load_checkpoint(trainer, run, run_dir, checkpoint, candidates, damaged, log)
            commit(checkpoint)
            move_damaged_aside(damaged, log)
        sampling = SamplingParams(max_new_tokens=config.sampler.max_new_tokens or _completion_limit(model_path),
                                  temperature=config.sampler.temperature, top_p=config.sampler.top_p)
        samplers = [await sup.spawn(SamplerActor, model_path, name=f"sampler{i}", gpus=gpus, env=env,
                                    max_restarts=run.sampler_max_restarts, kwargs={
                        "device": device, "seed": run.seed * 1000 + i, "countdown": config_to_dict(config.countdown),
                        "n_train_problems": run.n_train, "n_heldout_problems": run.n_heldout, "split_seed": run.data_seed,
                        "group_size": config.sampler.group_size, "prompts_per_batch": config.sampler.prompts_per_batch,
                        "sampling": sampling,
                        "sync_timeout_s": run.sync_timeout_s, "weight_update": config.sampler.weight_update,
                        "backend": config.sampler.backend})
                    for i in range(config.sampler.count)]
        if run.check_weights:
            await _check_digestible(samplers)
        host = os.environ.get("ASYNCRL_NODE_ADDR", "127.0.0.1")
        loop = _Loop(config, trainer, samplers, heldout, run_dir, log, host=host,
                     backend="nccl" if cuda else "gloo",
                     seeds=[run.seed * 1000 + i for i in range(config.sampler.count)], resume=checkpoint,
                     model_path=model_path, log_path=console.path)
        return await loop.execute()
    except asyncio.CancelledError:  # SIGINT/SIGTERM (asyncrl launch), or a caller's cancel
        signum = signals.cancelled_by_signal(asyncio.current_task())
        cause = signal.Signals(signum).name if signum else "cancellation"
        where, hint = stopped(cause, "")
        log(f"run stopped {where} by {cause}; {hint}")
        raise
    except ConfigError:
        raise  # refused before the run began (a CheckpointError too): nothing to record or resume
    except Exception as exc:
        stop = _run_dir_error(exc, run_dir) or exc
        if not isinstance(stop, RunStoppedError):  # a bug: its traceback follows
            where, hint = stopped(type(exc).__name__, first_line(exc))
            log(f"run stopped {where} by an error ({type(exc).__name__}); {hint}")
            raise
        where, hint = stopped(type(stop).__name__, str(stop))
        message = f"run stopped {where}: {stop}; {hint}"
        console.record(message)  # the caller prints the error; the log keeps it too
        raise type(stop)(message) from exc
    finally:
        console.__exit__()
        status.close()


def _run_dir_error(exc: BaseException, run_dir: str) -> RunDirError | None:
    """A full disk or a failing filesystem under the run directory, as one line; None for others."""
    if isinstance(exc, RunDirError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return RunDirError(f"cannot write {exc.filename or run_dir}: {exc.strerror}")
    return None


async def _check_digestible(samplers: list[Any]) -> None:
    """``--run.check_weights`` reads each sampler's weights in the actor; a vLLM sampler keeps
    them in its engine's process (repacked for its kernels on CPU), so refuse before the run."""
    for sampler, stats in zip(samplers, await asyncio.gather(*(s.stats() for s in samplers))):
        if stats["backend"] == "vllm":
            raise ConfigError(f"--run.check_weights needs samplers that hold their weights in the actor, but "
                              f"{stats['name']} uses the vLLM backend; add --sampler.backend hf, or drop check_weights")


class _Loop:
    """The driver's steps. Sampler faults are the `SamplerPool`'s to recover from; a fault on the
    trainer's side stops the run with a `RunStoppedError` (resume it from the last checkpoint)."""

    def __init__(self, config: GRPOConfig, trainer, samplers, heldout, run_dir: str, log, *, host: str,
                 backend: str, seeds: list[int], resume: Checkpoint | None = None, model_path: str = "",
                 log_path: str = ""):
        self.config, self.run = config, config.run
        self.trainer, self.heldout = trainer, heldout
        self.run_dir, self.log = run_dir, log
        capacity = self.run.queue_capacity or 2 * self.run.groups_per_step
        staleness = self.run.max_staleness if self.run.mode == "async" else 0
        self.queue = RolloutQueue(capacity, staleness)
        self.events_path = os.path.join(run_dir, "faults.jsonl")
        self.pool = SamplerPool(trainer, samplers, self.queue, run=self.run, seeds=seeds, host=host,
                                backend=backend, log=log, events_path=self.events_path)
        self.resume = resume
        self.state = resume.run_state() if resume is not None else RunState(step=0, version=0)
        self.step_done, self.version = self.state.step, self.state.version
        self.samples, self.tokens = self.state.samples, self.state.tokens  # completion tokens trained on
        self.heldout_before, self.heldout_last = dict(self.state.heldout_before), dict(self.state.heldout_last)
        self.phase = "starting"
        self.last_step_s, self.last_step_at = 0.0, 0.0
        self.checkpoint_path = resume.path if resume is not None else ""
        self.segment_start = time.monotonic()
        # Group ids restart in a new process tree (incarnation 1, sequence 1): the segment keeps
        # them unique along the run's history (the one metrics.jsonl records).
        self.segment = self.state.segment + 1 if resume is not None else 0
        self.pool.uid_prefix = f"resume{self.segment}/" if self.segment else ""
        self.model_path, self.log_path = model_path, log_path
        self.began = False  # training began (the held-out rates before it are known)
        self.after_step = ""  # what the driver does after a step's training, while it does it
        self.best = _read_best(run_dir) if resume is not None else None  # it may be newer than the checkpoint

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

    def fault_counts(self) -> dict[str, int]:
        carried = self.state.faults
        return {k: carried.get(k, 0) + v for k, v in self.pool.counters.items()}

    def progress(self) -> dict[str, Any]:
        """The run's progress as plain JSON values: written to RUN_DIR/progress.json after every
        step (atomically) and served live by `asyncrl status` (see docs/grpo.md)."""
        return {"phase": self.phase, "step": self.step_done, "steps": self.run.steps, "version": self.version,
                "samples": self.samples, "queue_depth": len(self.queue), "dropped_stale": self.dropped_stale(),
                "elapsed_s": round(self.elapsed_s(), 3), "last_step_s": round(self.last_step_s, 3),
                "last_step_at": self.last_step_at, "checkpoint": self.checkpoint_path,
                **self.pool.progress(), **self.fault_counts(), "updated_at": time.time()}

    def write_progress(self) -> None:
        write_json_atomic(os.path.join(self.run_dir, "progress.json"), self.progress())

    async def evaluate(self) -> dict[str, float]:
        t = self.run.eval_timeout_s
        return await trainer_phase("the held-out evaluation", "eval_timeout_s", t,
                                   self.trainer.with_timeout(t).evaluate(self.heldout, self.run.eval_samples))

    async def execute(self) -> dict[str, Any]:
        run = self.run
        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        if self.resume is not None:
            kept = truncate_metrics(metrics_path, self.step_done)
            self.log(f"resuming from {self.resume.path}: step {self.step_done}, v{self.version}; "
                     f"metrics.jsonl keeps its {kept} records up to that step")
            append_event(self.events_path, {"event": "resumed", "step": self.step_done, "at": time.time(),
                                            "detail": self.resume.path, "segment": self.segment})
        metrics = Metrics(self.run_dir, run.steps)
        completed = False
        try:
            await self.pool.start(self.version, list(self.state.samplers))
            if self.resume is None:
                self.heldout_before = self.heldout_last = await self.evaluate()
                self.log(f"held-out solve rate before GRPO ({len(self.heldout)} problems): "
                         + rates_text(self.heldout_before))
            self.phase, self.began = "training", True
            self.write_progress()
            for step in range(self.step_done + 1, run.steps + 1):
                started = time.monotonic()
                record = await self.step(step)
                evaluated = step % run.eval_every == 0 or step == run.steps
                if evaluated:
                    self.heldout_last = await self.evaluate()
                    record["heldout_solve_rate"] = self.heldout_last["greedy"]
                    if "sampled" in self.heldout_last:
                        record["heldout_sampled_solve_rate"] = self.heldout_last["sampled"]
                metrics.write(record)  # before the checkpoint: a resume from it keeps this record
                self.step_done, self.last_step_s, self.last_step_at = step, time.monotonic() - started, time.time()
                if evaluated and self.heldout_last["greedy"] > self.best_greedy():
                    self.after_step = "saving the best policy"
                    await self.save_best(step)  # before the checkpoint: a resume from it knows this best
                if run.checkpoint_every and step % run.checkpoint_every == 0:
                    self.after_step = "writing its checkpoint"
                    await self.checkpoint(step)
                self.after_step = ""
                self.write_progress()
            completed = True
        finally:
            if not completed:
                self.phase = "stopped"
            await self.pool.close()
            self.queue.close()
            # Best effort: on a full disk these fail too, and must not bury the error that stops the run.
            _quietly(metrics.close)
            _quietly(self.write_progress)
        self.after_step = "saving the final policy"
        final_dir = await self.save_policy(os.path.join(self.run_dir, "final"), "saving the final policy")
        self.after_step = ""
        self.phase = "finished"
        self.write_progress()
        wall = self.elapsed_s()
        summary = {"steps": run.steps, "mode": run.mode, "heldout_before": self.heldout_before,
                   "heldout_after": self.heldout_last, "heldout_problems": len(self.heldout), "wall_s": wall,
                   "samples": self.samples, "samples_per_s": self.samples / max(wall, 1e-9),
                   "tokens_per_s": self.tokens / max(wall, 1e-9), "dropped_stale": self.dropped_stale(),
                   "checkpoint": final_dir, "final": final_dir,
                   "best": ({"path": os.path.join(self.run_dir, BEST_DIR), **self.best} if self.best else None),
                   "initial_policy": self.model_path, "metrics": metrics_path, "log": self.log_path,
                   "resumed_from": self.resume.path if self.resume is not None else None,
                   "faults": self.fault_counts(), "fault_log": [f.to_dict() for f in self.pool.faults]}
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.log(summary_text(summary))
        return summary

    def best_greedy(self) -> float:
        """The held-out greedy solve rate to beat: the best saved, else the policy's before GRPO."""
        if self.best is not None:
            return self.best["heldout"]["greedy"]
        return self.heldout_before.get("greedy", -1.0)

    async def save_best(self, step: int) -> None:
        """RUN_DIR/best/: the policy of the best held-out greedy solve rate so far, with best.json
        (its step and rates) inside, written with it in one rename."""
        best = {"step": step, "heldout": dict(self.heldout_last), "heldout_before": dict(self.heldout_before),
                "heldout_problems": len(self.heldout), "saved_at": time.time()}
        await self.save_policy(os.path.join(self.run_dir, BEST_DIR), f"saving the best policy (step {step})",
                               {BEST_JSON: json.dumps(best, indent=2)})
        self.best = best
        self.log(f"best held-out greedy so far at step {step} ({self.heldout_last['greedy']:.3f}): "
                 f"saved to {shown_path(os.path.join(self.run_dir, BEST_DIR))}")

    async def save_policy(self, path: str, phase: str, extra_files: dict[str, str] | None = None) -> str:
        t = self.run.checkpoint_timeout_s
        try:
            return await trainer_phase(phase, "checkpoint_timeout_s", t,
                                       self.trainer.with_timeout(t).save(path, extra_files or {}))
        except RemoteError as exc:
            raise _write_error(exc) from None

    async def step(self, step: int) -> dict[str, Any]:
        run, n = self.run, self.run.groups_per_step
        self.pool.step = step
        t0 = time.monotonic()
        if run.mode == "sync":  # generate exactly this step's groups, with the current weights
            await self.pool.generate(n, self.version)
        batch: list[RolloutGroup] = await self.pool.next_batch(n, self.version)
        t1 = time.monotonic()
        train = await trainer_phase(f"train step {step}", "train_timeout_s", run.train_timeout_s,
                                    self.trainer.with_timeout(run.train_timeout_s).train_step(batch))
        t2 = time.monotonic()
        self.version += 1
        sync_s, digests = 0.0, {}
        if self.version % run.sync_every == 0:
            sync_s = await self.pool.sync(self.version)
            if run.check_weights:
                digests = await self.pool.verify_weights()
        rewards = [r for g in batch for r in g.rewards]
        staleness = [self.version - 1 - g.version for g in batch]
        self.samples += len(rewards)
        tokens = sum(len(c) for g in batch for c in g.completion_ids)
        self.tokens += tokens
        elapsed = self.elapsed_s()
        return {"step": step, "version": self.version, "reward_mean": sum(rewards) / len(rewards),
                "train_solve_rate": sum(r >= CORRECT_REWARD for r in rewards) / len(rewards),
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_hist": {str(s): staleness.count(s) for s in sorted(set(staleness))},
                "dropped_stale": self.dropped_stale(), "queue_depth": len(self.queue),
                "completion_tokens": tokens,
                "samples_per_s": self.samples / max(elapsed, 1e-9),
                "tokens_per_s": self.tokens / max(elapsed, 1e-9),
                "time_s": elapsed,
                "wait_s": t1 - t0, "train_s": t2 - t1, "sync_s": sync_s,
                "generate_s": sum(g.generate_s for g in batch) / len(batch),
                **{k: v for k, v in train.items() if k not in ("train_s",)},
                **self.pool.take_events(),
                "group_ids": [g.uid for g in batch],
                **({"weights_digests": digests} if digests else {})}

    async def checkpoint(self, step: int) -> None:
        run = self.run
        state = RunState(step=step, version=self.version, samples=self.samples, tokens=self.tokens,
                         dropped_stale=self.dropped_stale(), train_s=self.elapsed_s(),
                         heldout_before=self.heldout_before, heldout_last=self.heldout_last,
                         samplers=await self.pool.data_states(), faults=self.fault_counts(), segment=self.segment)
        t = run.checkpoint_timeout_s
        call = asyncio.ensure_future(trainer_phase(
            f"writing the checkpoint of step {step}", "checkpoint_timeout_s", t,
            self.trainer.with_timeout(t).save_checkpoint(self.run_dir, step, run.keep_checkpoints,
                                                         msgspec.json.encode(state))))
        try:
            self.checkpoint_path = await asyncio.shield(call)
        except RemoteError as exc:
            raise _write_error(exc) from None
        except asyncio.CancelledError:
            # A stop (Ctrl-C) during the write: let it finish (bounded by its deadline), so the
            # resume hint names the checkpoint that will really be resumed. A second signal
            # cancels this wait too and stops at once (the write is atomic either way).
            if not call.done():
                self.log(f"stopping: finishing the checkpoint of step {step} first")
                await asyncio.wait({call})
            if not call.cancelled() and call.exception() is None:
                self.checkpoint_path, self.after_step = call.result(), "its checkpoint written"
            raise


def _write_error(exc: RemoteError) -> BaseException:
    """The trainer's one-line `CheckpointWriteError` (a full disk) as the run's `RunDirError`;
    any other remote error as it is (a bug: its traceback tells more than a line could)."""
    if exc.remote_type == "CheckpointWriteError":
        return RunDirError(exc.remote_message)
    return exc


def _quietly(fn) -> None:
    """Clean-up writes while the run stops: a full disk fails them too, and the error that stopped
    the run (raised on) already says so; a second one would only bury it."""
    try:
        fn()
    except OSError:
        pass


def _read_best(run_dir: str) -> dict[str, Any] | None:
    """best/best.json of an earlier segment (None if there is none, or none readable)."""
    try:
        with open(os.path.join(run_dir, BEST_DIR, BEST_JSON)) as f:
            best = json.load(f)
        float(best["heldout"]["greedy"]), int(best["step"])
        return best
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _completion_limit(model_path: str) -> int:
    """The model's own hint for a complete answer's length (kept next to a checkpoint we built)."""
    from asyncrl.rl.model import CHAT_MAX_NEW_TOKENS, MARKER_FILE

    try:
        with open(os.path.join(model_path, MARKER_FILE)) as f:
            return int(json.load(f).get("max_new_tokens_hint", CHAT_MAX_NEW_TOKENS))
    except FileNotFoundError:
        return CHAT_MAX_NEW_TOKENS

