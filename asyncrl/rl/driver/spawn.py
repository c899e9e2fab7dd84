"""Where a run's actors go and what each is spawned with: the device plan, each actor's node and
the task every process builds (`plan_run`: a `RunPlan`), the trainer's ranks (`spawn_trainer`: a
`TrainerRanks`, one rank included), the samplers, at the start and by a scale-up
(`SamplerSpawner`, which is also where the fleet's `Scaler` gets and gives back samplers), and the
scorers (`spawn_scorer`). The actor classes are imported lazily: the driver itself never loads
torch.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.run import Placement
from asyncrl.rl.config.teacher import ScorerConfig, scorer_sections
from asyncrl.rl.config.trainer import LoRAConfig
from asyncrl.rl.driver.devices import DevicePlan, cluster_devices, plan_devices
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle, ScorerHandle
from asyncrl.rl.driver.fleet.scaling import least_loaded_node
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks, spawn_trainer_ranks
from asyncrl.rl.driver.start_checks import check_backend_readable, check_placement
from asyncrl.rl.scorer.specs import scorer_spec
from asyncrl.rl.tasks.loading import TaskSpec
from asyncrl.runtime.cluster.nodes import NodeStatus
from asyncrl.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from asyncrl.rl.sampler.vllm.shared import EngineShare


@dataclass(frozen=True)
class RunPlan:
    """Where a run's actors go."""

    devices: DevicePlan
    """What the actors compute on, and how many samplers share what."""
    trainer_nodes: list[int | None]
    """The node of each trainer rank (None: the supervisor's default)."""
    sampler_nodes: list[int | None]
    """The node of each of the samplers the run starts with (None: the supervisor's default)."""
    task: TaskSpec
    """What every process builds the task from (`GRPOConfig.task_spec`), derived once, here."""

    def env(self) -> dict[str, str]:
        """The environment of every actor. On CPU, one thread per actor: torch's default (a thread
        per core in every process) makes the actors of one host fight over the same cores, and
        throughput collapses."""
        return {"TQDM_DISABLE": "1"} | ({} if self.devices.device == "cuda" else {"OMP_NUM_THREADS": "1"})


def _one_a_gpu_where_placed(placement: str) -> int:
    """``--sampler.per_gpu`` auto where ``--run.placement`` names the samplers' nodes (or spreads
    them): one a GPU, so each sampler goes where it was placed (a second on a GPU would go where
    its GPU's first is); else 0, the plan's auto."""
    placed = Placement.parse(placement)
    return 1 if placed.sampler or placed.spread else 0


async def plan_run(config: GRPOConfig, sup: Supervisor) -> RunPlan:
    """The device plan over the cluster's devices (the scorers placed after the samplers) and
    ``--run.placement``'s nodes; with ``--run.check_weights``, the samplers' backend checked, and
    a GPU warm start asked for where this process sees none refused, all before the run directory,
    the trainer and a minute of vLLM engine start."""
    from asyncrl.runtime.devices import detect

    run, ranks = config.run, config.trainer.world_size
    devices = cluster_devices(*detect("auto"), sup.nodes())
    plan = plan_devices(
        run.device,
        *devices,
        config.sampler.count,
        trainer_ranks=ranks,
        scorers=len(scorer_sections(config)),
        per_gpu=config.sampler.per_gpu or _one_a_gpu_where_placed(run.placement),
        clients_per_engine=config.sampler.clients_per_engine,
    )
    trainer_nodes, sampler_nodes = check_placement(run.placement, ranks, plan.samplers, sup.config.nnodes, plan)
    if run.check_weights:
        await check_backend_readable(config.sampler.backend, plan.device)
    if not config.model_path and config.warm_start.device == "cuda":
        from asyncrl.rl.model.warm_start import warm_start_device

        warm_start_device("cuda", plan.device)  # refused here, not after the run directory is made
    return RunPlan(plan, trainer_nodes, sampler_nodes, config.task_spec())


async def spawn_trainer(sup: Supervisor, config: GRPOConfig, plan: RunPlan, model_path: str, log: Log) -> TrainerRanks:
    """The trainer's ranks as one trainer: N ranks, one group (docs/trainer.md), or one rank. No
    restarts: a new one would start from the initial weights. Losing it stops the run, which
    resumes from its last checkpoint instead."""
    run, ranks = config.run, config.trainer.world_size
    trainer = await spawn_trainer_ranks(
        sup,
        model_path,
        config.trainer_config(),
        timeout_s=run.deadlines.rendezvous_timeout_s,
        gpus=plan.devices.trainer_gpus,
        env=plan.env(),
        options={"device": plan.devices.device, "seed": run.seed, "task": plan.task, "data": run.data},
        nodes=plan.trainer_nodes,
    )
    if ranks > 1:
        log(f"trainer: {ranks} ranks, sharded (FSDP2, {'nccl' if plan.devices.device == 'cuda' else 'gloo'})")
    return trainer


class SamplerSpawner:
    """``spawner(i)`` spawns sampler ``i`` (`Supervisor.spawn`'s awaitable), at the run's start
    (`start_samplers`) and by a scale-up (`Scaler`, whose `SamplerSource` this is: it also stops a
    drained one and says what room the cluster has): ``config`` is the run's with its sampler
    section resolved for this host. One lost while it starts is started again, then left out
    (fleet/sampler_start.py)."""

    def __init__(self, sup: Supervisor, config: GRPOConfig, plan: RunPlan, model_path: str):
        self.sup, self.config, self.plan, self.model_path = sup, config, plan, model_path
        self.vllm = plan.devices.vllm_options(config.sampler.gpu_memory_utilization, plan.devices.samplers)
        devices = plan.devices
        self.device, self.colocated, self.per_gpu = devices.device, devices.colocated, devices.per_gpu
        self.clients_per_engine = devices.clients_per_engine
        self._tokens: dict[int, str] = {}  # a shared engine's host -> the token naming its sockets

    def seed_of(self, i: int) -> int:
        return self.config.run.seed * 1000 + i

    def __call__(self, i: int) -> Awaitable[SamplerHandle]:
        from asyncrl.rl.sampler.actor import SamplerActor

        sup, plan, run = self.sup, self.plan.devices, self.config.run
        owner = plan.gpu_owner(i)  # --sampler.per_gpu: the sampler whose GPU this one shares
        if owner is not None and not _running(sup, f"sampler{owner}"):
            owner = None  # its GPU went with it (given back): this one takes a GPU of its own
        shares = "trainer" if plan.colocated else None if owner is None else f"sampler{owner}"
        host = plan.engine_host(i)
        placed = i if host is None else host  # a client of a shared engine goes where the engine is
        nodes = self.plan.sampler_nodes
        return sup.spawn(
            SamplerActor,
            self.model_path,
            self.config.sampler,
            name=f"sampler{i}",
            gpus=0 if shares else plan.sampler_gpus,
            share_devices_with=shares,
            env=self.plan.env(),
            node=None if shares else nodes[placed] if placed < len(nodes) else _scaled_node(sup, plan.device == "cuda"),
            keep_if_lost=True,
            max_restarts=run.recovery.sampler_max_restarts,
            kwargs={
                "task": self.plan.task,
                "data": run.data,
                "seed": self.seed_of(i),
                "device": plan.device,
                "sync_timeout_s": run.deadlines.sync_timeout_s,
                "vllm": self.vllm,
                "adapter": _synced_adapter(self.config),
                "engine_share": self._share(i),
            },
        )

    def _share(self, i: int) -> EngineShare | None:
        """Sampler ``i``'s place among the clients of its vLLM engine (None: an engine of its own)."""
        from asyncrl.rl.sampler.vllm.shared import EngineShare

        clients = self.clients_per_engine
        if clients == 1:
            return None
        host = i - i % clients
        return EngineShare(
            token=self._tokens.setdefault(host, secrets.token_hex(8)),
            host=f"sampler{host}",
            client=i - host,
            clients=clients,
            incarnations=self.config.run.recovery.sampler_max_restarts + 1,
        )

    async def stop(self, handle: SamplerHandle) -> None:
        await self.sup.stop(handle)

    def free_gpus(self) -> int:
        """GPUs free over every node (0 on the CPU)."""
        return sum(n.devices_free for n in self.sup.nodes()) if self.device == "cuda" else 0

    def nodes(self) -> list[NodeStatus]:
        return self.sup.nodes()

    def cores(self) -> int:
        """The cores CPU samplers may use (0 on GPUs: the devices are the limit)."""
        return 0 if self.device == "cuda" else _cpu_cores(self.sup)


def spawn_scorer(
    sup: Supervisor, config: GRPOConfig, plan: RunPlan, model_path: str, section: ScorerConfig, name: str
) -> Awaitable[ScorerHandle]:
    """A scorer (teacher, reward model) serving its section's `ScorerSpec`, placed by
    `plan_devices`, restarted as a sampler is (driver/teacher.py)."""
    from asyncrl.rl.scorer.actor import ScorerActor

    devices = plan.devices
    return sup.spawn(
        ScorerActor,
        section.model_path,
        scorer_spec(section, model_path, config.sampler.temperature),
        name=name,
        gpus=devices.scorer_gpus,
        share_devices_with="trainer" if devices.scorers_colocated else None,
        env=plan.env(),
        node=None if devices.scorers_colocated else plan.sampler_nodes[0],
        max_restarts=config.run.recovery.sampler_max_restarts,
        kwargs={"device": devices.device, "batch_tokens": section.batch_tokens},
    )


def _running(sup: Supervisor, name: str) -> bool:
    return any(a.name == name and not a.state.final for a in sup.status())


def _scaled_node(sup: Supervisor, cuda: bool) -> int | None:
    """Where a sampler started by a scale-up goes: on GPUs, where the supervisor finds a free one
    (None); on the CPU, the node with the fewest samplers, so a node that joined an elastic
    cluster (--nnodes MIN:MAX) mid-run takes new ones."""
    if cuda or sup.config.nnodes == 1:
        return None
    return least_loaded_node(sup.nodes(), sup.status())


def _cpu_cores(sup: Supervisor) -> int:
    """The cores CPU samplers may use: those of every node joined, as each reported them (the
    ones this process may run on, here); a node whose agent reported none (an older agent)
    counts as many as this one."""
    here = len(os.sched_getaffinity(0))
    return max(sum(n.cores or here for n in sup.nodes() if n.joined), 1)


def _synced_adapter(config: GRPOConfig) -> LoRAConfig | None:
    """The LoRA adapters the samplers carry when only adapters are synced (else they hold merged
    weights, or the fully fine-tuned ones, under the base model's names)."""
    lora = config.trainer.lora
    return lora if lora.rank and lora.sync == "adapter" else None
