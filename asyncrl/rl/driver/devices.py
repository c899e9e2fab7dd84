"""Where a GRPO run's actors go on this host: CPU, a GPU each, or colocated on one GPU.

`plan_devices` decides from ``--run.device`` and the devices the supervisor sees, and says what it
decided in one line, so a run never falls back to the CPU (or squeezes onto one GPU) silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.rl.config.parse import ConfigError

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
        0 for the default: the engine's own alone on a GPU, `COLOCATED_VLLM_SHARE` split when colocated)."""
        if self.device != "cuda":
            return {}
        if share:
            return {"gpu_memory_utilization": share}
        return {"gpu_memory_utilization": round(COLOCATED_VLLM_SHARE / samplers, 4)} if self.colocated else {}


def plan_devices(
    asked: str, kind: str | None, ids: list[str], samplers: int, *, trainer_ranks: int = 1, scorers: int = 0
) -> DevicePlan:
    """``asked``: --run.device ("auto", "cpu", "cuda"); ``kind``/``ids``: the host's accelerators
    (`asyncrl.runtime.devices.detect`); ``samplers``: how many sampler actors the run has;
    ``trainer_ranks``: the trainer's processes (--trainer.world_size), a GPU each on CUDA;
    ``scorers``: its scorer actors (a teacher, a reward model), planned after the samplers: a GPU
    each when every one gets one, else on the trainer's GPU (a scorer never takes a sampler's)."""
    gpus = len(ids) if kind == "cuda" else 0
    wanted = trainer_ranks + samplers
    trainer = f"{trainer_ranks} trainer ranks" if trainer_ranks > 1 else "the trainer"
    host = "trainer rank 0's GPU" if trainer_ranks > 1 else "trainer's GPU"
    if asked == "cpu":
        also = f" ({gpus} CUDA device(s) left unused: --run.device auto uses them)" if gpus else ""
        return DevicePlan("cpu", False, "gloo", f"cpu, as asked{also}")
    if gpus == 0:
        if asked == "cuda":
            seen = f"{kind} devices {','.join(ids)}" if kind else "no accelerator"
            raise ConfigError(
                f"--run.device cuda, but this host shows no CUDA device ({seen}; CUDA_VISIBLE_DEVICES "
                "or the driver may hide them); drop --run.device for the CPU"
            )
        why = "Ascend NPUs are not yet placed by GRPO runs" if kind == "npu" else "no CUDA device found"
        return DevicePlan("cpu", False, "gloo", f"cpu ({why})")
    if gpus < trainer_ranks:
        raise ConfigError(
            f"--trainer.world_size {trainer_ranks} needs a GPU per rank, but this host shows {gpus}; "
            "lower it, or add --run.device cpu"
        )
    if gpus >= wanted + scorers:
        each = (
            f"{trainer}, {samplers} sampler(s) and {scorers} scorer(s)"
            if scorers
            else f"{trainer} and {samplers} sampler(s)"
        )
        return DevicePlan("cuda", False, "nccl", f"cuda: one GPU each for {each}")
    scorer_words = f"; the {scorers} scorer(s) share the {host}" if scorers else ""
    if gpus >= wanted:
        spare = f" ({gpus - wanted} GPU(s) left unused: too few for one a scorer)" if gpus > wanted else ""
        return DevicePlan(
            "cuda",
            False,
            "nccl",
            f"cuda: one GPU each for {trainer} and {samplers} sampler(s){scorer_words}{spare}",
            scorers_colocated=True,
        )
    unused = f"; {gpus - trainer_ranks} other GPU(s) unused" if gpus > trainer_ranks else ""
    return DevicePlan(
        "cuda",
        True,
        "ipc",
        f"cuda, colocated: {gpus} GPU(s) for {trainer} and {samplers} sampler(s), so the samplers share "
        f"the {host} and take weights over CUDA IPC{scorer_words}{unused}",
        scorers_colocated=True,
    )


def cluster_devices(kind: str | None, ids: list[str], nodes: list) -> tuple[str | None, list[str]]:
    """What `plan_devices` should count in a run over several nodes: node 0's device kind (``kind``,
    ``ids``: `asyncrl.runtime.devices.detect` here) with every joined node's devices (``nodes``:
    `Supervisor.nodes()`), so two hosts of one GPU each give the trainer and a sampler a GPU each
    instead of colocating them on node 0's. The ids stand for a count: placement finds the devices
    on their nodes. A node 0 without accelerators plans for the CPU whatever the others have."""
    joined = [n for n in nodes if n.state == "joined"]
    if kind is None or len(joined) <= 1:
        return kind, ids
    return kind, [str(i) for i in range(sum(n.devices_total for n in joined))]
