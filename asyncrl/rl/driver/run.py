"""`train()`: one GRPO run from its config to its summary, or to a stop that says how to resume.

It checks the config (`preflight.check_run`) and what only the hosts can tell (start_checks.py:
the placement, the weight check's backends), makes the run directory, spawns the trainer and the
samplers on the caller's supervisor (a sampler that never comes up is left out: `fleet/sampler_start.py`),
loads a checkpoint to resume from (`resume.py`), and hands the steps to `GRPODriver` (grpo.py).
Every way a run can end passes through here once: a signal (SIGINT, SIGTERM) or any error is
recorded as a ``stopped`` event in faults.jsonl and told in one line that names what resumes the
run; a full disk under the run directory becomes `RunDirError` (saving.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
import traceback
from typing import Any

from asyncrl.errors import ActionableError, first_line, one_line
from asyncrl.rl.checkpoint import Checkpoint, CheckpointError, list_checkpoints
from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.stored import write_run_config
from asyncrl.rl.config.teacher import scorer_sections
from asyncrl.rl.config.trainer import LoRAConfig
from asyncrl.rl.driver.devices import cluster_devices, plan_devices
from asyncrl.rl.driver.faults import RunStoppedError, append_event
from asyncrl.rl.driver.fleet.endpoints import sampler_endpoints
from asyncrl.rl.driver.fleet.sampler_start import start_samplers
from asyncrl.rl.driver.fleet.scaling import Scaler, ScaleRefusedError, least_loaded_node
from asyncrl.rl.driver.fleet.trainer_ranks import node_address, spawn_trainer_ranks
from asyncrl.rl.driver.grpo import GRPODriver
from asyncrl.rl.driver.resume import choose_checkpoint, load_checkpoint, move_damaged_aside, resume_hint
from asyncrl.rl.driver.run_state import read_run_state
from asyncrl.rl.driver.saving import run_dir_error
from asyncrl.rl.driver.start_checks import check_backend_readable, check_digestible, check_placement
from asyncrl.rl.driver.teacher import RewardModel, Teacher, check_tokenizers, scorer_kwargs
from asyncrl.rl.observe.endpoint import open_endpoint
from asyncrl.rl.observe.runlog import LOG_FILE, RunLog
from asyncrl.runtime import signals
from asyncrl.runtime.loop_watch import LoopWatch


async def train(config: GRPOConfig, sup, *, log=print, resume: bool = False) -> dict[str, Any]:
    """Run GRPO with ``config`` on the actors of ``sup``; returns the summary (also in the run dir).
    ``resume``: continue the run in ``config.run.run_dir`` from its newest good checkpoint (checked
    against its manifest; a damaged one is skipped, and said so). Raises a `RunStoppedError` (its
    message names the cause and ends with how to resume) if the run cannot go on, a
    `CheckpointError` (one line) if there is nothing good to resume from. On every stop, a
    signal included, one line says what can be resumed and faults.jsonl gets a ``stopped``
    event. What the console shows is kept in RUN_DIR/log.txt (`RunLog`)."""
    from asyncrl.rl.driver.preflight import check_run
    from asyncrl.rl.model.warm_start import default_model
    from asyncrl.rl.sampler.actor import SamplerActor
    from asyncrl.rl.tasks.agent import Agent
    from asyncrl.rl.tasks.loading import load_task
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.runtime.devices import detect

    config = check_run(config, resume=resume)  # paths and limits, before anything is spawned or written
    run = config.run
    ranks = config.trainer.world_size
    scorers = scorer_sections(config)  # teacher, reward model: placed by plan_devices after the samplers
    devices = cluster_devices(*detect("auto"), sup.nodes())
    plan = plan_devices(
        run.device,
        *devices,
        config.sampler.count,
        trainer_ranks=ranks,
        scorers=len(scorers),
        per_gpu=config.sampler.per_gpu,
    )
    trainer_nodes, sampler_nodes = check_placement(run.placement, ranks, plan.samplers, sup.config.nnodes, plan)
    if run.check_weights:  # before the run directory, the trainer and a minute of vLLM engine start
        await check_backend_readable(config.sampler.backend, plan.device)
    spec = config.task_spec()
    task = load_task(spec)  # loaded (and its data read) by check_run already: cached
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars would bury the progress line
    run_dir = os.path.abspath(run.run_dir or os.path.join("runs", time.strftime("grpo-%Y%m%d-%H%M%S")))
    os.makedirs(run_dir, exist_ok=True)
    console = RunLog(os.path.join(run_dir, LOG_FILE), log)
    log = console.log
    driver: GRPODriver | None = None
    committed = False  # config.json written: from here on a stop is recorded in the run directory

    def progress() -> dict[str, Any]:  # for `asyncrl status`, called on this event loop per request
        if driver is None:
            return {"phase": "starting", "steps": run.steps}
        return driver.progress()

    def commit(checkpoint: Checkpoint | None) -> None:
        """The run is known to start (fresh) or to resume (the trainer loaded the checkpoint):
        only now is the run directory changed (a refused or failed resume leaves it as it was)."""
        nonlocal committed
        write_run_config(config, run_dir)
        committed = True
        console.open(f"resumed from {checkpoint.name}" if checkpoint is not None else "new run")

    def stopped(cause: str, detail: str) -> tuple[str, str]:
        """Record a stop (faults.jsonl, once the run directory is ours); returns where the run
        stopped ("at step 137") and the line that says what resumes it."""
        where = driver.where() if driver is not None else "while starting"
        hint = resume_hint(run_dir)
        if committed:
            try:
                append_event(
                    os.path.join(run_dir, "faults.jsonl"),
                    {
                        "event": "stopped",
                        "cause": cause,
                        "step": driver.step_done + 1 if driver is not None else 0,
                        "at": time.time(),
                        "detail": detail or f"stopped {where} by {cause}",
                        "resume": hint,  # what `asyncrl status` and `asyncrl scale` say of a stopped run
                    },
                )
            except OSError:
                pass  # a full disk: the stop itself is what the user needs to hear about
        return where, hint

    status = await sup.serve_status(run_dir, progress=progress)
    status.add_command("scale", lambda args: _scaler_of(driver).request(args))  # asyncrl scale (fleet/scaling.py)
    # asyncrl status RUN_DIR --endpoint: each sampler's OpenAI endpoint and token (fleet/endpoints.py)
    status.add_command("endpoint", lambda args: sampler_endpoints(driver and driver.pool.membership, args))
    endpoint = None
    console.__enter__()
    # A synchronous call on this loop would freeze every deadline and the status socket, silently.
    watch = LoopWatch("the driver", run.observe.loop_watch_s, log).start() if run.observe.loop_watch_s else None
    try:
        endpoint = open_endpoint(run.observe, sup, lambda: driver, log)  # --run.metrics_port: /metrics, /healthz
        candidates = list_checkpoints(run_dir)
        if resume and not candidates:
            first = (
                f"the first is written at step {run.checkpoints.checkpoint_every}"
                if run.checkpoints.checkpoint_every
                else "the run writes none"
            )
            raise CheckpointError(
                f"--resume {run_dir}: no checkpoint was written yet ({first}, "
                f"--run.checkpoint_every {run.checkpoints.checkpoint_every}); nothing to resume"
            )
        damaged: list[Checkpoint] = []
        checkpoint = await choose_checkpoint(run_dir, candidates, damaged, log) if resume else None
        if checkpoint is None:
            commit(None)
        stop_warm_start = threading.Event()  # a cancel (Ctrl-C) must stop the warm start's thread too:
        try:  # asyncio's shutdown waits for the thread, which would otherwise finish the warm start first
            model_path = config.model_path or await asyncio.to_thread(
                default_model,
                config.model,
                config.warm_start,
                task,
                log=log,
                stop=stop_warm_start,
                n_heldout=run.data.n_heldout,
                score_calls=(spec.score_timeout_s, spec.max_failure_rate),
            )
        except asyncio.CancelledError:
            stop_warm_start.set()
            raise
        cuda, device = plan.device == "cuda", plan.device
        for key, section in scorers:  # before anything is spawned: one that reads ids otherwise is refused in one line
            if section.shares_tokenizer:
                check_tokenizers(model_path, section.model_path, f"--{key}.model_path")
        log(f"plan: {plan.line}")
        log(
            f"run dir {run_dir}; task {task.task_name()}; model {model_path}; mode {run.mode}"
            + "".join(f"; {key.replace('_', ' ')} {section.model_path}" for key, section in scorers)
        )
        if isinstance(task, Agent):
            log(
                "agent: each sampler serves the OpenAI API on 127.0.0.1; code outside the episodes gets "
                f"each one's root URL and token from `asyncrl status {run_dir} --endpoint` (docs/agents.md)"
            )

        # On CPU, one thread per actor: torch's default (a thread per core in every process) makes the
        # actors of one host fight over the same cores, and throughput collapses.
        env = {"TQDM_DISABLE": "1"} | ({} if cuda else {"OMP_NUM_THREADS": "1"})
        # No restarts for the trainer: a new one would start from the initial weights. Losing it
        # stops the run, which resumes from its last checkpoint instead.
        trainer_kwargs = {"device": device, "seed": run.seed, "task": spec, "data": run.data}
        if ranks == 1:
            trainer = await sup.spawn(
                TrainerActor,
                model_path,
                config.trainer_config(),
                name="trainer",
                gpus=plan.trainer_gpus,
                env=env,
                kwargs=trainer_kwargs,
                node=trainer_nodes[0],
            )
        else:  # N ranks, one group (docs/trainer.md); the driver uses them as it uses one trainer
            trainer = await spawn_trainer_ranks(
                sup,
                TrainerActor,
                (model_path, config.trainer_config()),
                world_size=ranks,
                host=None,
                timeout_s=run.deadlines.rendezvous_timeout_s,
                gpus=plan.trainer_gpus,
                env=env,
                kwargs=trainer_kwargs,
                nodes=trainer_nodes,
            )
            log(f"trainer: {ranks} ranks, sharded (FSDP2, {'nccl' if cuda else 'gloo'})")
        # Trainer rank 0 hosts the weight-sync group's store: on its own node's address, which
        # every sampler reaches (the driver's node is another when the trainer was placed elsewhere).
        first_rank = trainer.handles[0] if ranks > 1 else trainer
        host = node_address(sup, first_rank)
        if checkpoint is not None:
            checkpoint = await load_checkpoint(trainer, run, run_dir, checkpoint, candidates, damaged, log)
            commit(checkpoint)
            move_damaged_aside(damaged, log)
        vllm = plan.vllm_options(config.sampler.gpu_memory_utilization, plan.samplers)
        # Resolved here, after config.json is written: it keeps 'auto' (0), so a run resumed on
        # another host resolves it for that host's devices.
        sampler = dataclasses.replace(config.sampler, count=plan.samplers, per_gpu=plan.per_gpu)
        prompts, auto = sampler.batch_prompts(device, run.groups_per_step), not sampler.prompts_per_batch
        sampler = dataclasses.replace(sampler, prompts_per_batch=prompts)
        streams = sampler.paced_streams(device, run.groups_per_step, run.max_staleness)
        config = dataclasses.replace(config, sampler=dataclasses.replace(sampler, streams=streams))
        paced = (
            f", {streams} paced batches in flight (--sampler.streams)" if streams > 1 and run.mode == "async" else ""
        )
        log(
            f"samplers: {prompts} prompts x {config.sampler.group_size} completions at once"
            + (" (--sampler.prompts_per_batch auto)" if auto else "")
            + paced
        )

        def spawn_sampler(i: int):  # one lost while it starts is started again, then left out: fleet/sampler_start.py
            owner = plan.gpu_owner(i)  # --sampler.per_gpu: the sampler whose GPU this one shares
            if owner is not None and not _running(sup, f"sampler{owner}"):
                owner = None  # its GPU went with it (given back): this one takes a GPU of its own
            shares = "trainer" if plan.colocated else None if owner is None else f"sampler{owner}"
            return sup.spawn(
                SamplerActor,
                model_path,
                config.sampler,
                name=f"sampler{i}",
                gpus=0 if shares else plan.sampler_gpus,
                share_devices_with=shares,
                env=env,
                node=None if shares else sampler_nodes[i] if i < len(sampler_nodes) else _scaled_node(sup, cuda),
                keep_if_lost=True,
                max_restarts=run.recovery.sampler_max_restarts,
                kwargs={
                    "task": spec,
                    "data": run.data,
                    "seed": run.seed * 1000 + i,
                    "device": device,
                    "sync_timeout_s": run.deadlines.sync_timeout_s,
                    "vllm": vllm,
                    "adapter": _synced_adapter(config),
                },
            )

        def spawn_scorer(section, name: str):  # placed by plan_devices, restarted as a sampler is (driver/teacher.py)
            from asyncrl.rl.scorer.actor import ScorerActor

            return sup.spawn(
                ScorerActor,
                section.model_path,
                name=name,
                gpus=plan.scorer_gpus,
                share_devices_with="trainer" if plan.scorers_colocated else None,
                env=env,
                node=None if plan.scorers_colocated else sampler_nodes[0],
                max_restarts=run.recovery.sampler_max_restarts,
                kwargs={
                    "device": device,
                    "temperature": config.sampler.temperature,
                    **scorer_kwargs(section, model_path),
                },
            )

        teacher = reward_model = None
        calls = {"restart_timeout_s": run.recovery.restart_timeout_s, "log": log}
        if config.teacher.model_path:
            teacher = Teacher(
                await spawn_scorer(config.teacher, "scorer"),
                top_k=config.teacher.top_k,
                timeout_s=config.teacher.timeout_s,
                **calls,
            )
        if config.reward_model.model_path:
            rm = config.reward_model
            reward_model = RewardModel(
                await spawn_scorer(rm, "reward_model"),
                weight=rm.weight,
                rule_weight=rm.rule_weight,
                judge=rm.kind == "judge",
                max_unparsed_rate=rm.max_unparsed_rate,
                timeout_s=rm.timeout_s,
                **calls,
            )
        # A run scaled by `asyncrl scale` resumes with the size it had (its checkpoint records it),
        # and keeps it as its target.
        scaled = read_run_state(checkpoint).samplers_target if checkpoint is not None else 0
        count = scaled or config.sampler.count
        if scaled:
            log(
                f"samplers: {scaled}, as the run was scaled before its checkpoint (--sampler.count "
                f"{config.sampler.count}; asyncrl scale changes it again)"
            )
        samplers = await start_samplers(
            spawn_sampler,
            count,
            waves=count if plan.colocated else plan.per_gpu,
            log=log,
            events_path=os.path.join(run_dir, "faults.jsonl"),
        )
        if sup.config.nnodes > 1:
            log(_where_line([first_rank, *(trainer.handles[1:] if ranks > 1 else [])], samplers, host))
        if run.check_weights:
            await check_digestible([s for s in samplers if not s.info().state.final])
        driver = GRPODriver(
            config,
            trainer,
            samplers,
            run_dir,
            log,
            host=host,
            correct_reward=task.correct_reward,
            backend=plan.sync_backend,
            seeds=[run.seed * 1000 + i for i in range(count)],
            resume=checkpoint,
            model_path=model_path,
            log_path=console.path,
            teacher=teacher,
            reward_model=reward_model,
        )
        driver.scaler = Scaler(
            driver.pool,
            spawn_sampler,
            sup.stop,
            seed_of=lambda i: run.seed * 1000 + i,
            device=plan.device,
            colocated=plan.colocated,
            log=log,
            free_gpus=lambda: sum(n.devices_free for n in sup.nodes()) if cuda else 0,
            started=config.sampler.count,
            target=scaled or None,
            nodes=sup.nodes,
            cores=lambda: 0 if cuda else _cpu_cores(sup),
            per_gpu=plan.per_gpu,
        )
        return await driver.execute()
    except asyncio.CancelledError:  # SIGINT/SIGTERM (asyncrl launch), or a caller's cancel
        signum = signals.cancelled_by_signal(asyncio.current_task())
        cause = signal.Signals(signum).name if signum else "cancellation"
        where, hint = stopped(cause, "")
        log(f"run stopped {where} by {cause}; {hint}")
        raise
    except ConfigError:
        raise  # refused before the run began (a CheckpointError too): nothing to record or resume
    except Exception as exc:
        stop = run_dir_error(exc, run_dir) or exc
        if not isinstance(stop, (RunStoppedError, ActionableError)):  # a bug: its traceback follows
            where, hint = stopped(type(exc).__name__, first_line(exc))
            log(f"run stopped {where} by an error ({type(exc).__name__}); {hint}")
            raise
        # The user's to fix (a start that overran, memory that ran out: `ActionableError`, its
        # own type even from an actor) or a stop the driver already put in words: one line.
        text = str(stop) if isinstance(stop, RunStoppedError) else one_line(stop)
        where, hint = stopped(type(stop).__name__, text)
        message = f"run stopped {where}: {text}; {hint}"
        console.record(message)  # the caller prints the error; the log keeps it too, with the traceback
        console.record("".join(traceback.format_exception(exc)).rstrip("\n"))
        if isinstance(stop, RunStoppedError):
            raise type(stop)(message) from exc
        raise RunStoppedError(message) from exc  # ``from``: the caller still finds exc by its type
    finally:
        if endpoint is not None:
            endpoint.close()
        if watch is not None:
            watch.close()
        console.__exit__()
        status.close()


def _running(sup, name: str) -> bool:
    return any(a.name == name and not a.state.final for a in sup.status())


def _scaled_node(sup, cuda: bool) -> int | None:
    """Where a sampler started by a scale-up goes: on GPUs, where the supervisor finds a free one
    (None); on the CPU, the node with the fewest samplers, so a node that joined an elastic
    cluster (--nnodes MIN:MAX) mid-run takes new ones."""
    if cuda or sup.config.nnodes == 1:
        return None
    return least_loaded_node(sup.nodes(), sup.status())


def _cpu_cores(sup) -> int:
    """The cores CPU samplers may use: this host's (those this process may run on) times the nodes
    joined, taken to be alike (a node's agent does not report its cores)."""
    nodes = sum(n.state == "joined" for n in sup.nodes()) if sup.config.nnodes > 1 else 1
    return len(os.sched_getaffinity(0)) * max(nodes, 1)


def _scaler_of(driver: GRPODriver | None) -> Scaler:
    """The run's `Scaler`, or a refusal while the run is not training yet."""
    phase = driver.phase if driver is not None else "starting"
    if driver is None or driver.scaler is None or phase != "training":
        raise ScaleRefusedError(
            f"the run is {phase}, not training: its samplers can be scaled while it trains "
            "(asyncrl status shows the phase)"
        )
    return driver.scaler


def _synced_adapter(config) -> LoRAConfig | None:
    """The LoRA adapters the samplers carry when only adapters are synced (else they hold merged
    weights, or the fully fine-tuned ones, under the base model's names)."""
    lora = config.trainer.lora
    return lora if lora.rank and lora.sync == "adapter" else None


def _where_line(trainer_ranks: list[Any], samplers: list[Any], host: str) -> str:
    """Which node each actor runs on, and where the weight-sync group meets (runs over several nodes)."""
    ranks = ",".join(str(h.info().node) for h in trainer_ranks)
    where = ", ".join(f"{s.name} on node {s.info().node}" for s in samplers)
    return (
        f"placement: trainer rank(s) on node(s) {ranks}, {where}; "
        f"the weight-sync group meets at {host} (trainer rank 0's node)"
    )
