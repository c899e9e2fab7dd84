"""`build_run`: a run's parts, built in the order a start needs them, and its driver.

The checkpoint to resume from is chosen first (before anything is spawned or written: a refused
resume leaves the run directory as it was), then the policy (a given model, or the cached warm
start), the trainer's ranks (which load the checkpoint: only then is the run committed), the
scorers (teacher, reward model), the samplers (a sampler that never comes up is left out:
`fleet/sampler_start.py`), and last the driver, with the fleet's `Scaler`, from what was spawned
(`build_driver`: each part built once, from the run's config, and handed down whole). On the CPU a
fresh run's scorers and samplers start while the trainer does (`_start_beside_the_trainer`). What
each actor is spawned with, and where, is spawn.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import Awaitable
from typing import Any

from asyncrl.rl.checkpoint import Checkpoint, CheckpointError, list_checkpoints
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.lengths import LONG_COMPLETIONS
from asyncrl.rl.config.run import AUTO_STALENESS_ROOMY
from asyncrl.rl.config.teacher import scorer_sections
from asyncrl.rl.driver.devices import DevicePlan
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle
from asyncrl.rl.driver.fleet.membership import Membership
from asyncrl.rl.driver.fleet.pool import RolloutFlow, SamplerPool
from asyncrl.rl.driver.fleet.sampler_start import all_or_first_error, start_samplers
from asyncrl.rl.driver.fleet.scaling import SamplerSource, Scaler
from asyncrl.rl.driver.fleet.sync_group import SyncPlace
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks, node_address
from asyncrl.rl.driver.grpo import Console, DriverParts, GRPODriver, RunFiles, Segment
from asyncrl.rl.driver.heldout import HeldoutRecord
from asyncrl.rl.driver.pacing import rollout_flow
from asyncrl.rl.driver.resume import choose_checkpoint, load_checkpoint, move_damaged_aside
from asyncrl.rl.driver.run_scope import RunScope
from asyncrl.rl.driver.spawn import RunPlan, SamplerSpawner, spawn_scorer, spawn_trainer
from asyncrl.rl.driver.start_checks import check_digestible
from asyncrl.rl.driver.teacher import RewardModel, Teacher, check_tokenizers
from asyncrl.rl.observe.episodes_log import EpisodeLog
from asyncrl.rl.scorer.specs import scorer_spec
from asyncrl.rl.tasks.base import Task
from asyncrl.runtime.supervisor import Supervisor


@dataclasses.dataclass(frozen=True)
class Scorers:
    """The run's models that score its groups before they are queued (None where it has none)."""

    teacher: Teacher | None = None
    reward_model: RewardModel | None = None


@dataclasses.dataclass(frozen=True)
class Spawned:
    """A run's actors, as spawned, and where their weight-sync group meets."""

    trainer: TrainerRanks
    samplers: list[SamplerHandle]
    """Every sampler's handle, those that never came up (DEAD) included."""
    seeds: list[int]
    """Each sampler's data walk's seed."""
    place: SyncPlace
    scorers: Scorers = Scorers()
    hosts: list[int | None] = dataclasses.field(default_factory=list)
    """Per sampler, the one whose vLLM engine it is a client of (None: its own; empty: all)."""


async def build_run(config: GRPOConfig, sup: Supervisor, plan: RunPlan, scope: RunScope, *, resume: bool) -> GRPODriver:
    """Spawn a run's actors on ``sup`` where ``plan`` puts them and build its driver; commits the
    run directory (``scope.commit``) once the run is known to start. ``resume``: from the newest
    good checkpoint in the run directory (see `train`)."""
    from asyncrl.rl.tasks.loading import load_task

    task, log = load_task(plan.task), scope.log  # loaded (and its data read) by check_run already: cached
    candidates = list_checkpoints(scope.run_dir)
    damaged: list[Checkpoint] = []
    chosen = await _checkpoint_to_resume(config, scope, candidates, damaged) if resume else None
    if chosen is None:
        scope.commit(None)
    model_path = config.model_path or await _warm_start(config, plan, task, log)
    _announce(config, plan.devices, scope, task, model_path)
    trainer_config, config = config, resolve_samplers(config, plan.devices, log)
    spawn = SamplerSpawner(sup, config, plan, model_path)

    # A resume starts the rest once the trainer has loaded its checkpoint: a sampler's start writes
    # faults.jsonl, and a resume that fails leaves the run directory as it was.
    beside = _start_beside_the_trainer(plan.devices) and chosen is None

    async def start_trainer() -> tuple[TrainerRanks, Checkpoint | None]:
        trainer = await spawn_trainer(sup, trainer_config, plan, model_path, log)
        loaded = chosen
        if chosen is not None:
            loaded = await load_checkpoint(trainer, config.run, scope.run_dir, chosen, candidates, damaged, log)
            scope.commit(loaded)
            move_damaged_aside(damaged, log)
        return trainer, loaded

    def start_scorers() -> Awaitable[Scorers]:
        return _spawn_scorers(sup, config, plan, model_path, log, at_once=beside)

    def start_samplers(scaled: int = 0) -> Awaitable[list[SamplerHandle]]:
        return _start_samplers(spawn, scaled, scope)

    if beside:
        starts: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(start_trainer()),
            asyncio.ensure_future(start_scorers()),
        ]
        starts.append(asyncio.ensure_future(start_samplers()))
        started = await all_or_first_error(starts)
        (trainer, checkpoint), scorers, samplers = started
        segment = Segment.of(checkpoint)
    else:
        trainer, checkpoint = await start_trainer()
        scorers = await start_scorers()
        # A run scaled by `asyncrl scale` resumes with the size it had (its checkpoint records it),
        # and keeps it as its target (`build_driver`'s `Scaler`).
        segment = Segment.of(checkpoint)
        samplers = await start_samplers(segment.state.samplers_target)
    # Trainer rank 0 hosts the weight-sync group's store: on its own node's address, which
    # every sampler reaches (the driver's node is another when the trainer was placed elsewhere).
    host = node_address(sup, trainer.handles[0])
    if sup.config.nnodes > 1:
        log(_where_line(trainer, samplers, host))
    if config.sampler.length_limit:  # samplers run, a colocated engine with its share: memory as at the first step
        await trainer.with_timeout(config.run.deadlines.train_timeout_s).check_fits(config.sampler.length_limit)
    if config.run.check_weights:
        await check_digestible([s for s in samplers if not s.info().state.final])
    spawned = Spawned(
        trainer,
        samplers,
        [spawn.seed_of(i) for i in range(len(samplers))],
        SyncPlace(host, plan.devices.sync_backend),
        scorers,
        [plan.devices.engine_host(i) for i in range(len(samplers))],
    )
    files = RunFiles(scope.run_dir, model_path, scope.console.path)
    return build_driver(
        config, spawned, files, scope.log, segment=segment, correct_reward=task.correct_reward, source=spawn
    )


def build_driver(
    config: GRPOConfig,
    spawned: Spawned,
    files: RunFiles,
    write: Log,
    *,
    segment: Segment | None = None,
    correct_reward: float = 1.0,
    source: SamplerSource | None = None,
) -> GRPODriver:
    """The driver over ``spawned`` actors, its parts built once from ``config`` in the order they
    need each other: the console (``write``: the run's, which the progress bar shares), the queue
    and its pacer, the samplers' membership and pool, the fleet's `Scaler` (where the samplers
    have a ``source``; a resumed run's keeps the size it was scaled to), the held-out record, the
    episode log. ``segment``: where this run segment begins (None: a fresh run)."""
    run, segment = config.run, segment or Segment.of(None)
    state = segment.state
    console = Console(write)
    # Async mode: samplers begin only groups that will be trained in time (pacing.py).
    queue, pacer = rollout_flow(run, version=state.version, next_step=state.step + 1)
    membership = Membership(
        spawned.samplers,
        spawned.seeds,
        recovery=run.recovery,
        log=console.log,
        events_path=os.path.join(files.run_dir, "faults.jsonl"),
        hosts=spawned.hosts,
    )
    scorers = spawned.scorers
    flow = RolloutFlow(
        queue,
        pacer,
        batch_groups=config.sampler.prompts_per_batch,
        streams=config.sampler.streams,
        uid_prefix=segment.uid_prefix,
        teacher=scorers.teacher,
        reward_model=scorers.reward_model,
    )
    pool = SamplerPool(spawned.trainer, membership, flow, run=run, place=spawned.place, log=console.log)
    scaler = None
    if source is not None:  # asyncrl scale: fleet/scaling.py
        target = state.samplers_target or None
        scaler = Scaler(pool, source, log=console.log, started=config.sampler.count, target=target)
    observe = run.observe
    parts = DriverParts(
        spawned.trainer,
        pool,
        # The held-out rates before GRPO and at the last evaluation, the best policy (heldout.py).
        HeldoutRecord(spawned.trainer, run, files.run_dir, console.log, state, resumed=segment.resume is not None),
        EpisodeLog(files.run_dir, files.model_path, console.log, episodes=observe.episodes, ids=observe.episode_ids),
        console,
        scaler,
    )
    return GRPODriver(config, parts, segment, files, correct_reward=correct_reward)


def _start_beside_the_trainer(plan: DevicePlan) -> bool:
    """Whether a fresh run's scorers and samplers start while the trainer does: on the CPU, where
    their process starts and model loads (seconds of imports each) overlap the trainer's. On GPUs
    they start after it, as the device plan places them: a colocated engine measures the memory
    the trainer left, and the supervisor hands out GPUs first-fit, in the order they are asked for."""
    return plan.device == "cpu"


async def _checkpoint_to_resume(
    config: GRPOConfig, scope: RunScope, candidates: list[Checkpoint], damaged: list[Checkpoint]
) -> Checkpoint:
    """The newest good checkpoint of ``candidates`` (the damaged ones skipped go into ``damaged``),
    or a `CheckpointError` if the run wrote none."""
    every = config.run.checkpoints.checkpoint_every
    if not candidates:
        first = f"the first is written at step {every}" if every else "the run writes none"
        raise CheckpointError(
            f"--resume {scope.run_dir}: no checkpoint was written yet ({first}, "
            f"--run.checkpoint_every {every}); nothing to resume"
        )
    return await choose_checkpoint(scope.run_dir, candidates, damaged, scope.log)


async def _warm_start(config: GRPOConfig, plan: RunPlan, task: Task, log: Log) -> str:
    """The policy of a run given no ``--model_path``: the cached supervised warm start (on the GPU
    where ``--warm_start.device`` auto and the run's plan say so)."""
    from asyncrl.rl.model.warm_start import default_model

    spec, run = plan.task, config.run
    stop_warm_start = threading.Event()  # a cancel (Ctrl-C) must stop the warm start's thread too:
    try:  # asyncio's shutdown waits for the thread, which would otherwise finish the warm start first
        return await asyncio.to_thread(
            default_model,
            config.model,
            config.warm_start,
            task,
            log=log,
            stop=stop_warm_start,
            n_heldout=run.data.n_heldout,
            score_calls=(spec.score_timeout_s, spec.max_failure_rate),
            run_device=plan.devices.device,
        )
    except asyncio.CancelledError:
        stop_warm_start.set()
        raise


def _announce(config: GRPOConfig, plan: DevicePlan, scope: RunScope, task: Task, model_path: str) -> None:
    """The scorers' tokenizers checked, before anything is spawned (one that reads ids otherwise is
    refused in one line), then the plan and the run in the log."""
    from asyncrl.rl.tasks.agent import Agent

    scorers, run = scorer_sections(config), config.run
    for key, section in scorers:
        if section.shares_tokenizer:
            check_tokenizers(model_path, section.model_path, f"--{key}.model_path")
    scope.log(f"plan: {plan.line}")
    scope.log(
        f"run dir {scope.run_dir}; task {task.task_name()}; model {model_path}; mode {run.mode}"
        + "".join(f"; {key.replace('_', ' ')} {section.model_path}" for key, section in scorers)
    )
    if not config.trainer.lr:
        model = ("a checkpoint's" if config.model_path else "the embedded model's") + (
            " LoRA adapters" if config.trainer.lora.rank else ""
        )
        scope.log(f"learning rate {config.trainer_config().lr:g} (--trainer.lr auto: {model}; docs/grpo.md)")
    if isinstance(task, Agent):
        scope.log(
            "agent: each sampler serves the OpenAI API on 127.0.0.1; code outside the episodes gets "
            f"each one's root URL and token from `asyncrl status {scope.run_dir} --endpoint` (docs/agents.md)"
        )


def resolve_samplers(config: GRPOConfig, plan: DevicePlan, log: Log) -> GRPOConfig:
    """``config`` with the samplers' section resolved for this host's devices: their count and how
    many share a GPU, the prompts of a batch, the paced batches in flight, and with them the
    staleness bound (``--run.max_staleness`` auto); said in one line. Resolved after config.json
    is written: it keeps 'auto', so a run resumed on another host resolves it for that host's."""
    run, stale_auto, why = config.run, config.run.max_staleness is None, ""
    if stale_auto:
        apart = plan.device == "cuda" and not plan.colocated
        long_on_gpu = plan.device == "cuda" and config.sampler.length_limit >= LONG_COMPLETIONS
        run = dataclasses.replace(run, max_staleness=run.staleness_bound(apart, long_on_gpu))
        config = dataclasses.replace(config, run=run)
        if long_on_gpu and not apart and run.max_staleness == AUTO_STALENESS_ROOMY:
            why = f": completions up to {config.sampler.length_limit} tokens"
    sampler = dataclasses.replace(config.sampler, count=plan.samplers, per_gpu=plan.per_gpu)
    prompts, auto = sampler.batch_prompts(plan.device, run.groups_per_step), not sampler.prompts_per_batch
    sampler = dataclasses.replace(sampler, prompts_per_batch=prompts)
    streams = sampler.paced_streams(plan.device, run.groups_per_step, run.staleness_bound())
    config = dataclasses.replace(config, sampler=dataclasses.replace(sampler, streams=streams))
    paced = f", {streams} paced batches in flight (--sampler.streams)" if streams > 1 and run.mode == "async" else ""
    stale = ""
    if run.mode == "async":
        stale = f"; groups trained up to {run.staleness_bound()} version(s) after their weights"
    log(
        f"samplers: {prompts} prompts x {config.sampler.group_size} completions at once"
        + (" (--sampler.prompts_per_batch auto)" if auto else "")
        + paced
        + stale
        + (f" (--run.max_staleness auto{why})" if stale and stale_auto else "")
    )
    return config


async def _spawn_scorers(
    sup: Supervisor, config: GRPOConfig, plan: RunPlan, model_path: str, log: Log, *, at_once: bool
) -> Scorers:
    """The run's teacher and reward model (None where it has none), each on its scorer actor;
    ``at_once``: both started together (else the teacher first, as the device plan places them)."""
    restart_s = config.run.recovery.restart_timeout_s
    teacher, rm = config.teacher, config.reward_model
    sections = [(section, name) for section, name in ((teacher, "scorer"), (rm, "reward_model")) if section.model_path]
    if at_once:
        starts = [asyncio.ensure_future(spawn_scorer(sup, config, plan, model_path, *w)) for w in sections]
        handles = await all_or_first_error(starts)
    else:
        handles = [await spawn_scorer(sup, config, plan, model_path, *w) for w in sections]
    return Scorers(
        Teacher(handles.pop(0), teacher, restart_timeout_s=restart_s, log=log) if teacher.model_path else None,
        RewardModel(
            handles.pop(0),
            rm,
            judge=scorer_spec(rm, model_path, config.sampler.temperature).parses_verdicts,
            restart_timeout_s=restart_s,
            log=log,
        )
        if rm.model_path
        else None,
    )


async def _start_samplers(spawn: SamplerSpawner, scaled: int, scope: RunScope) -> list[SamplerHandle]:
    """The run's samplers, ``--sampler.count`` of them or the ``scaled`` count a resumed run had."""
    count, first = scaled or spawn.config.sampler.count, spawn.config.sampler.count
    if scaled:
        scope.log(
            f"samplers: {scaled}, as the run was scaled before its checkpoint (--sampler.count "
            f"{first}; asyncrl scale changes it again)"
        )
    return await start_samplers(
        spawn,
        count,
        wave_of=spawn.plan.devices.start_wave,
        log=scope.log,
        events_path=os.path.join(scope.run_dir, "faults.jsonl"),
    )


def _where_line(trainer: TrainerRanks, samplers: list[SamplerHandle], host: str) -> str:
    """Which node each actor runs on, and where the weight-sync group meets (runs over several nodes)."""
    ranks = ",".join(str(h.info().node) for h in trainer.handles)
    where = ", ".join(f"{s.name} on node {s.info().node}" for s in samplers)
    return (
        f"placement: trainer rank(s) on node(s) {ranks}, {where}; "
        f"the weight-sync group meets at {host} (trainer rank 0's node)"
    )
