"""`build_run`: a run's parts, built in the order a start needs them, as `RunParts`.

The checkpoint to resume from is chosen first (before anything is spawned or written: a refused
resume leaves the run directory as it was), then the policy (a given model, or the cached warm
start), the trainer's ranks (which load the checkpoint: only then is the run committed), the
scorers (teacher, reward model), the samplers (a sampler that never comes up is left out:
`fleet/sampler_start.py`), and last the driver, with the fleet's `Scaler`. On the CPU a fresh
run's scorers and samplers start while the trainer does (`_start_beside_the_trainer`). What each
actor is spawned with, and where, is spawn.py's.
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
from asyncrl.rl.config.teacher import scorer_sections
from asyncrl.rl.driver.devices import DevicePlan
from asyncrl.rl.driver.fleet.sampler_start import all_or_first_error, start_samplers
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks, node_address
from asyncrl.rl.driver.grpo import GRPODriver
from asyncrl.rl.driver.resume import choose_checkpoint, load_checkpoint, move_damaged_aside
from asyncrl.rl.driver.run_scope import RunScope
from asyncrl.rl.driver.run_state import read_run_state
from asyncrl.rl.driver.spawn import RunPlan, SamplerSpawner, fleet_scaler, spawn_scorer, spawn_trainer
from asyncrl.rl.driver.start_checks import check_digestible
from asyncrl.rl.driver.teacher import RewardModel, Teacher, check_tokenizers


@dataclasses.dataclass
class RunParts:
    """A built run: its actors and the driver that runs its steps."""

    config: GRPOConfig
    """The run's config with the samplers' section resolved for this host (config.json keeps 'auto')."""
    plan: DevicePlan
    trainer: TrainerRanks
    samplers: list[Any]
    """Every sampler's handle, those that never came up (DEAD) included."""
    teacher: Teacher | None
    reward_model: RewardModel | None
    driver: GRPODriver
    """The steps, with the fleet's `Scaler` (``driver.scaler``)."""


async def build_run(config: GRPOConfig, sup: Any, plan: RunPlan, scope: RunScope, *, resume: bool) -> RunParts:
    """Spawn a run's actors on ``sup`` where ``plan`` puts them and build its driver; commits the
    run directory (``scope.commit``) once the run is known to start. ``resume``: from the newest
    good checkpoint in the run directory (see `train`)."""
    from asyncrl.rl.tasks.loading import load_task

    task, log = load_task(config.task_spec()), scope.log  # loaded (and its data read) by check_run already: cached
    candidates = list_checkpoints(scope.run_dir)
    damaged: list[Checkpoint] = []
    chosen = await _checkpoint_to_resume(config, scope, candidates, damaged) if resume else None
    if chosen is None:
        scope.commit(None)
    model_path = config.model_path or await _warm_start(config, task, plan.devices.device, log)
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

    def start_scorers() -> Awaitable[tuple[Teacher | None, RewardModel | None]]:
        return _spawn_scorers(sup, config, plan, model_path, log, at_once=beside)

    def start_samplers(scaled: int = 0) -> Awaitable[list[Any]]:
        return _start_samplers(spawn, scaled, scope)

    if beside:
        starts = [asyncio.ensure_future(start()) for start in (start_trainer, start_scorers, start_samplers)]
        (trainer, checkpoint), (teacher, reward_model), samplers = await all_or_first_error(starts)
        scaled = 0
    else:
        trainer, checkpoint = await start_trainer()
        teacher, reward_model = await start_scorers()
        # A run scaled by `asyncrl scale` resumes with the size it had (its checkpoint records it),
        # and keeps it as its target.
        scaled = read_run_state(checkpoint).samplers_target if checkpoint is not None else 0
        samplers = await start_samplers(scaled)
    # Trainer rank 0 hosts the weight-sync group's store: on its own node's address, which
    # every sampler reaches (the driver's node is another when the trainer was placed elsewhere).
    host = node_address(sup, trainer.handles[0])
    if sup.config.nnodes > 1:
        log(_where_line(trainer.handles, samplers, host))
    if config.run.check_weights:
        await check_digestible([s for s in samplers if not s.info().state.final])
    driver = GRPODriver(
        config,
        trainer,
        samplers,
        scope.run_dir,
        log,
        host=host,
        correct_reward=task.correct_reward,
        backend=plan.devices.sync_backend,
        seeds=[spawn.seed_of(i) for i in range(len(samplers))],
        resume=checkpoint,
        model_path=model_path,
        log_path=scope.console.path,
        teacher=teacher,
        reward_model=reward_model,
        scaler=fleet_scaler(sup, spawn, scaled=scaled, log=log),
    )
    return RunParts(config, plan.devices, trainer, samplers, teacher, reward_model, driver)


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


async def _warm_start(config: GRPOConfig, task: Any, run_device: str, log) -> str:
    """The policy of a run given no ``--model_path``: the cached supervised warm start (on the GPU
    where ``--warm_start.device`` auto and the run's plan, ``run_device``, say so)."""
    from asyncrl.rl.model.warm_start import default_model

    spec, run = config.task_spec(), config.run
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
            run_device=run_device,
        )
    except asyncio.CancelledError:
        stop_warm_start.set()
        raise


def _announce(config: GRPOConfig, plan: DevicePlan, scope: RunScope, task: Any, model_path: str) -> None:
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


def resolve_samplers(config: GRPOConfig, plan: DevicePlan, log) -> GRPOConfig:
    """``config`` with the samplers' section resolved for this host's devices: their count and how
    many share a GPU, the prompts of a batch, the paced batches in flight, and with them the
    staleness bound (``--run.max_staleness`` auto); said in one line. Resolved after config.json
    is written: it keeps 'auto', so a run resumed on another host resolves it for that host's."""
    run, stale_auto = config.run, config.run.max_staleness is None
    if stale_auto:
        apart = plan.device == "cuda" and not plan.colocated
        run = dataclasses.replace(run, max_staleness=run.staleness_bound(samplers_apart=apart))
        config = dataclasses.replace(config, run=run)
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
        + (" (--run.max_staleness auto)" if stale and stale_auto else "")
    )
    return config


async def _spawn_scorers(
    sup: Any, config: GRPOConfig, plan: RunPlan, model_path: str, log, *, at_once: bool
) -> tuple[Teacher | None, RewardModel | None]:
    """The run's teacher and reward model (None where it has none), each on its scorer actor;
    ``at_once``: both started together (else the teacher first, as the device plan places them)."""
    teacher = reward_model = None
    calls = {"restart_timeout_s": config.run.recovery.restart_timeout_s, "log": log}
    sections = [(config.teacher, "scorer"), (config.reward_model, "reward_model")]
    wanted = [(section, name) for section, name in sections if section.model_path]
    if at_once:
        starts = [asyncio.ensure_future(spawn_scorer(sup, config, plan, model_path, *w)) for w in wanted]
        handles = await all_or_first_error(starts)
    else:
        handles = [await spawn_scorer(sup, config, plan, model_path, *w) for w in wanted]
    if config.teacher.model_path:
        teacher = Teacher(
            handles.pop(0),
            top_k=config.teacher.top_k,
            timeout_s=config.teacher.timeout_s,
            **calls,
        )
    if config.reward_model.model_path:
        rm = config.reward_model
        reward_model = RewardModel(
            handles.pop(0),
            weight=rm.weight,
            rule_weight=rm.rule_weight,
            judge=rm.kind == "judge",
            max_unparsed_rate=rm.max_unparsed_rate,
            timeout_s=rm.timeout_s,
            **calls,
        )
    return teacher, reward_model


async def _start_samplers(spawn: SamplerSpawner, scaled: int, scope: RunScope) -> list[Any]:
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


def _where_line(trainer_ranks: list[Any], samplers: list[Any], host: str) -> str:
    """Which node each actor runs on, and where the weight-sync group meets (runs over several nodes)."""
    ranks = ",".join(str(h.info().node) for h in trainer_ranks)
    where = ", ".join(f"{s.name} on node {s.info().node}" for s in samplers)
    return (
        f"placement: trainer rank(s) on node(s) {ranks}, {where}; "
        f"the weight-sync group meets at {host} (trainer rank 0's node)"
    )
