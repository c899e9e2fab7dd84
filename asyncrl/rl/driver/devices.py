"""Where a GRPO run's actors go on this host: CPU, a GPU each, or colocated on one GPU.

`plan_devices` decides from ``--run.device`` and the devices the supervisor sees, and says what it
decided in one line, so a run never falls back to the CPU (or squeezes onto one GPU) silently.

With ``--sampler.count`` left at 0 (auto), every GPU works: the trainer's ranks take one each, a
scorer one each where one is left for it after a sampler, and every other GPU gets a sampler of its
own (``--sampler.per_gpu`` of them: engines sharing one GPU overlap their steps); one GPU alone is
shared (colocated). Each GPU added to a host then adds engines to the run, and one weight broadcast
reaches them all (fleet/sync_group.py; in tiers where engines share a GPU, comm/tiered.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncrl.rl.config.parse import ConfigError

OWN_GPU_VLLM_SHARE = 0.85
"""The share of a sampler GPU's memory its vLLM engines get together (`VLLMBackend`'s default for
one engine alone), split among the ``--sampler.per_gpu`` engines that share it."""
AUTO_PER_GPU = 2
"""What ``--sampler.per_gpu`` 0 means with ``--sampler.count`` 0: two samplers share each sampler GPU
(more samples/s than one alone, its GPU kept busier; four contend: docs/gpu.md)."""
COLOCATED_VLLM_SHARE = 0.3
"""The share of a colocated GPU's memory the vLLM samplers get together, by default: vLLM reserves
its share up front, and the rest must hold the trainer (a 0.5B model with AdamW in fp32: ~8 GB plus
activations; see docs/gpu.md)."""


@dataclass(frozen=True)
class DevicePlan:
    device: str
    """"cpu" or "cuda": what the trainer and samplers compute on."""
    colocated: bool
    """The samplers share the trainer's GPU (fewer GPUs than trainer ranks and samplers)."""
    sync_backend: str
    """The weight-sync communicator: gloo on CPU, nccl between GPUs, ipc on one GPU."""
    line: str
    """What was decided, for the run's log."""
    scorers_colocated: bool = False
    """The scorers (teacher, reward model) share the trainer's GPU: too few GPUs for one each
    after the trainer's and the samplers'."""
    samplers: int = 1
    """How many samplers the run starts: ``--sampler.count``, or what its 0 (auto) resolved to."""
    per_gpu: int = 1
    """Samplers that share each sampler GPU (``--sampler.per_gpu``; 1 where they share the trainer's
    or run on the CPU). Sampler ``i`` is on the GPU of sampler ``i - i % per_gpu``."""
    clients_per_engine: int = 1
    """Samplers that share one vLLM engine (``--sampler.clients_per_engine``): sampler ``i`` is a
    client of sampler ``i - i % clients_per_engine``'s (`engine_host`), on its GPU."""

    @property
    def trainer_gpus(self) -> int:
        return int(self.device == "cuda")

    @property
    def sampler_gpus(self) -> int:
        """GPUs each sampler asks for itself (a colocated one takes the trainer's)."""
        return int(self.device == "cuda" and not self.colocated)

    @property
    def scorer_gpus(self) -> int:
        """GPUs each scorer asks for itself (a colocated one takes the trainer's)."""
        return int(self.device == "cuda" and not self.scorers_colocated)

    def vllm_options(self, share: float, samplers: int) -> dict:
        """`VLLMBackend` options for each sampler: its share of GPU memory (``share``: the config's,
        0 for the default: the engine's own alone on a GPU, `OWN_GPU_VLLM_SHARE` split among the
        ``per_gpu`` engines of a GPU, `COLOCATED_VLLM_SHARE` split when colocated)."""
        if self.device != "cuda":
            return {}
        if share:
            return {"gpu_memory_utilization": share}
        if self.colocated:
            return {"gpu_memory_utilization": round(COLOCATED_VLLM_SHARE / -(-samplers // self.clients_per_engine), 4)}
        engines = self.per_gpu // self.clients_per_engine  # on each sampler GPU
        return {"gpu_memory_utilization": round(OWN_GPU_VLLM_SHARE / engines, 4)} if engines > 1 else {}

    def engine_host(self, sampler: int) -> int | None:
        """The sampler whose vLLM engine sampler ``sampler`` is a client of (None: its own)."""
        host = sampler - sampler % self.clients_per_engine
        return host if host != sampler else None

    def gpu_owner(self, sampler: int) -> int | None:
        """The sampler whose GPU sampler ``sampler`` shares (None: it takes a GPU, or the trainer's)."""
        owner = sampler - sampler % self.per_gpu
        return owner if owner != sampler else None

    def start_wave(self, sampler: int) -> int:
        """The wave sampler ``sampler`` starts in (`fleet.sampler_start.start_samplers`): the
        engines of one GPU each in a wave of their own (vLLM measures the free memory as it starts,
        and two starting at once on one GPU would each count the other's); a client of a shared
        engine with its host, whose engine it waits for."""
        engine = sampler if self.colocated else sampler % self.per_gpu
        return engine // self.clients_per_engine


def auto_samplers(gpus: int, trainer_ranks: int, scorers: int, per_gpu: int = 1) -> int:
    """What ``--sampler.count`` 0 means on a host of ``gpus`` CUDA devices (0: the CPU): ``per_gpu``
    samplers on every GPU the trainer's ranks and the scorers leave (a scorer gets one of its own
    only where a sampler still has one: it answers prefill alone, and shares the trainer's GPU
    otherwise); one, sharing the trainer's GPU, where none is left; one on the CPU."""
    left = gpus - trainer_ranks
    if left < 1:
        return 1
    return per_gpu * (left - scorers if left - scorers >= 1 else left)


def plan_devices(
    asked: str,
    kind: str | None,
    ids: list[str],
    samplers: int,
    *,
    trainer_ranks: int = 1,
    scorers: int = 0,
    per_gpu: int = 0,
    clients_per_engine: int = 1,
) -> DevicePlan:
    """``asked``: --run.device ("auto", "cpu", "cuda"); ``kind``/``ids``: the host's accelerators
    (`asyncrl.runtime.devices.detect`); ``samplers``: how many sampler actors the run has (0: auto,
    `auto_samplers`); ``trainer_ranks``: the trainer's processes (--trainer.world_size), a GPU each on
    CUDA; ``scorers``: its scorer actors (a teacher, a reward model), planned after the samplers: a
    GPU each when every one gets one, else on the trainer's GPU (a scorer never takes a sampler's);
    ``per_gpu``: samplers sharing each sampler GPU (0: auto, `AUTO_PER_GPU` with ``samplers`` auto,
    else as few as spread ``samplers`` over the GPUs left); ``clients_per_engine``: samplers
    sharing each vLLM engine (it divides ``samplers`` and, on GPUs of their own, ``per_gpu``)."""
    plan = _plan(asked, kind, ids, samplers, trainer_ranks=trainer_ranks, scorers=scorers, per_gpu=per_gpu)
    c = clients_per_engine
    if c == 1:
        return plan
    if plan.samplers % c:
        raise ConfigError(
            f"--sampler.clients_per_engine {c}: the {plan.samplers} sampler(s) do not make whole engines; "
            f"ask for a multiple of {c} (--sampler.count)"
        )
    if plan.device == "cuda" and not plan.colocated and plan.per_gpu % c:
        raise ConfigError(
            f"--sampler.clients_per_engine {c}: the {plan.per_gpu} sampler(s) of a GPU do not make whole "
            f"engines; make --sampler.per_gpu a multiple of {c}"
        )
    line = f"{plan.line}; {c} samplers a vLLM engine (--sampler.clients_per_engine)"
    return dataclasses.replace(plan, line=line, clients_per_engine=c)


def _plan(
    asked: str, kind: str | None, ids: list[str], samplers: int, *, trainer_ranks: int, scorers: int, per_gpu: int
) -> DevicePlan:
    gpus = len(ids) if kind == "cuda" else 0
    auto = samplers == 0
    if asked == "cpu" or gpus == 0:
        samplers = samplers or 1
    elif auto:
        per_gpu = per_gpu or AUTO_PER_GPU
        samplers = auto_samplers(gpus, trainer_ranks, scorers, per_gpu)
    per_gpu = per_gpu or _spread(samplers, gpus - trainer_ranks - scorers, gpus - trainer_ranks)
    counted = f"{samplers} sampler(s)" + (" (--sampler.count auto)" if auto else "")
    sampler_gpus = -(-samplers // per_gpu)
    wanted = trainer_ranks + sampler_gpus
    trainer = f"{trainer_ranks} trainer ranks" if trainer_ranks > 1 else "the trainer"
    host = "trainer rank 0's GPU" if trainer_ranks > 1 else "trainer's GPU"
    if asked == "cpu":
        also = f" ({gpus} CUDA device(s) left unused: --run.device auto uses them)" if gpus else ""
        return DevicePlan("cpu", False, "gloo", f"cpu, as asked{also}; {counted}", samplers=samplers)
    if gpus == 0:
        if asked == "cuda":
            seen = f"{kind} devices {','.join(ids)}" if kind else "no accelerator"
            raise ConfigError(
                f"--run.device cuda, but this host shows no CUDA device ({seen}; CUDA_VISIBLE_DEVICES "
                "or the driver may hide them); drop --run.device for the CPU"
            )
        why = "Ascend NPUs are not yet placed by GRPO runs" if kind == "npu" else "no CUDA device found"
        return DevicePlan("cpu", False, "gloo", f"cpu ({why}); {counted}", samplers=samplers)
    if gpus < trainer_ranks:
        raise ConfigError(
            f"--trainer.world_size {trainer_ranks} needs a GPU per rank, but this host shows {gpus}; "
            "lower it, or add --run.device cpu"
        )
    if gpus >= wanted:
        own = gpus >= wanted + scorers
        roles = _gpu_roles(trainer_ranks, sampler_gpus, scorers if own else 0, per_gpu)
        shared = f"; the {scorers} scorer(s) share the {host}" if scorers and not own else ""
        spare = gpus - wanted - (scorers if own else 0)
        unused = f"; {spare} GPU(s) left unused" + (": too few for one a scorer" if scorers else "") if spare else ""
        return DevicePlan(
            "cuda",
            False,
            "nccl",
            f"cuda, {gpus} GPU(s): {roles}{shared}{unused}; {counted}, one weight broadcast reaches them all"
            + (" (NCCL between GPUs, CUDA IPC within one)" if per_gpu > 1 and samplers > 1 else ""),
            scorers_colocated=not own,
            samplers=samplers,
            per_gpu=per_gpu,
        )
    scorer_words = f"; the {scorers} scorer(s) share the {host}" if scorers else ""
    unused = f"; {gpus - trainer_ranks} other GPU(s) unused" if gpus > trainer_ranks else ""
    return DevicePlan(
        "cuda",
        True,
        "ipc",
        f"cuda, colocated: {gpus} GPU(s) for {trainer} and {counted}, so the samplers share "
        f"the {host} and take weights over CUDA IPC{scorer_words}{unused}",
        scorers_colocated=True,
        samplers=samplers,
    )


def _spread(samplers: int, *lefts: int) -> int:
    """The fewest samplers a GPU must hold to place ``samplers`` on the first of ``lefts`` (GPUs
    left for them: with the scorers given theirs, else without) that has room for one each."""
    for left in lefts:
        if left >= samplers:
            return 1
    left = next((n for n in lefts if n >= 1), 0)
    return -(-samplers // left) if left else 1


def _gpu_roles(trainer_ranks: int, sampler_gpus: int, scorers: int, per_gpu: int = 1) -> str:
    """What each GPU does, in placement order ("GPU 0 the trainer, GPUs 1-3 a sampler each"). The
    numbers count GPUs over the hosts of a run (the supervisor picks which device of which node)."""
    parts, first = [], 0
    engines = "a sampler" if per_gpu == 1 else f"{per_gpu} samplers"
    for count, one, each in (
        (trainer_ranks, "the trainer", "a trainer rank each (FSDP2)"),
        (sampler_gpus, engines, f"{engines} each"),
        (scorers, "a scorer", "a scorer each"),
    ):
        if count == 1:
            parts.append(f"GPU {first} {one}")
        elif count > 1:
            parts.append(f"GPUs {first}-{first + count - 1} {each}")
        first += count
    return ", ".join(parts)


def cluster_devices(kind: str | None, ids: list[str], nodes: list) -> tuple[str | None, list[str]]:
    """What `plan_devices` should count in a run over several nodes: node 0's device kind (``kind``,
    ``ids``: `asyncrl.runtime.devices.detect` here) with every joined node's devices (``nodes``:
    `Supervisor.nodes()`), so two hosts of one GPU each give the trainer and a sampler a GPU each
    instead of colocating them on node 0's. The ids stand for a count: placement finds the devices
    on their nodes. A node 0 without accelerators plans for the CPU whatever the others have."""
    joined = [n for n in nodes if n.joined]
    if kind is None or len(joined) <= 1:
        return kind, ids
    return kind, [str(i) for i in range(sum(n.devices_total for n in joined))]
