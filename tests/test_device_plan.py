"""Where a GRPO run's actors go (rl/driver/devices.py): every case says what it decided, none
falls back to the CPU silently; and the ipc communicator refuses anything but CUDA."""

from __future__ import annotations

import asyncio
import types

import pytest

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.driver.devices import cluster_devices, plan_devices
from asyncrl.runtime.cluster.nodes import NodeStatus
from virtual_time import run_virtual


def test_enough_gpus_give_each_actor_its_own():
    plan = plan_devices("auto", "cuda", ["0", "1", "2"], 2)
    assert (plan.device, plan.colocated, plan.sync_backend) == ("cuda", False, "nccl")
    assert (plan.trainer_gpus, plan.sampler_gpus) == (1, 1)
    assert plan.vllm_options(0.0, 2) == {} and plan.vllm_options(0.5, 2) == {"gpu_memory_utilization": 0.5}


@pytest.mark.parametrize("asked", ["auto", "cuda"])
def test_fewer_gpus_than_actors_colocate_on_the_trainers(asked):
    plan = plan_devices(asked, "cuda", ["0"], 1)
    assert (plan.device, plan.colocated, plan.sync_backend) == ("cuda", True, "ipc")
    assert (plan.trainer_gpus, plan.sampler_gpus) == (1, 0)
    assert "colocated" in plan.line and "CUDA IPC" in plan.line
    assert plan.vllm_options(0.0, 2) == {"gpu_memory_utilization": 0.15}  # 0.3 split among the samplers
    assert [plan.start_wave(i) for i in range(2)] == [0, 1]  # colocated: one engine starts at a time
    assert "1 other GPU(s) unused" in plan_devices(asked, "cuda", ["0", "1"], 2, per_gpu=1).line
    # --sampler.per_gpu auto: two samplers asked for on two GPUs share the one the trainer leaves.
    spread = plan_devices(asked, "cuda", ["0", "1"], 2)
    assert not spread.colocated and spread.per_gpu == 2 and "GPU 1 2 samplers" in spread.line


def test_no_gpu_is_the_cpu_and_says_why():
    plan = plan_devices("auto", None, [], 1)
    assert (plan.device, plan.sync_backend) == ("cpu", "gloo") and "no CUDA device found" in plan.line
    assert "Ascend NPUs" in plan_devices("auto", "npu", ["0"], 1).line
    assert plan.vllm_options(0.3, 1) == {}


def test_cpu_asked_for_names_the_gpus_it_leaves():
    plan = plan_devices("cpu", "cuda", ["0", "1"], 1)
    assert plan.device == "cpu" and "2 CUDA device(s) left unused" in plan.line


def test_trainer_ranks_take_a_gpu_each_and_samplers_share_rank_0s():
    plan = plan_devices("auto", "cuda", ["0", "1"], 1, trainer_ranks=2)
    assert (plan.colocated, plan.trainer_gpus, plan.sampler_gpus) == (True, 1, 0)
    assert "2 trainer ranks" in plan.line and "trainer rank 0's GPU" in plan.line
    assert not plan_devices("auto", "cuda", ["0", "1", "2"], 1, trainer_ranks=2).colocated
    with pytest.raises(ConfigError, match="--trainer.world_size 4 needs a GPU per rank, but this host shows 2"):
        plan_devices("auto", "cuda", ["0", "1"], 1, trainer_ranks=4)


def test_cuda_asked_for_without_one_is_a_config_error():
    with pytest.raises(ConfigError, match="--run.device cuda, but this host shows no CUDA device"):
        plan_devices("cuda", None, [], 1)


def test_ipc_communicator_needs_a_cuda_device():
    from asyncrl.comm.join import make_communicator
    from asyncrl.comm.rendezvous import StoreGroup

    group = StoreGroup.create("127.0.0.1", 0, 0, 1, 10.0, name="ipc-test")
    try:
        with pytest.raises(ValueError, match="ipc communicator needs a CUDA device, not cpu"):
            make_communicator(group, "ipc", device="cpu")
    finally:
        group.close()


def test_prompts_per_batch_auto_is_8_on_the_cpu_and_each_samplers_share_of_a_step_on_a_gpu():
    from asyncrl.rl.config.sampler import SamplerConfig

    auto = SamplerConfig()
    assert auto.prompts_per_batch == 0
    assert auto.batch_prompts("cpu", groups_per_step=64) == 8  # the CPU default run is unchanged
    assert auto.batch_prompts("cuda", groups_per_step=16) == 16  # one sampler: the whole step at once
    assert SamplerConfig(count=3).batch_prompts("cuda", groups_per_step=16) == 6  # ceil(16 / 3): all three at once
    assert SamplerConfig(count=6).batch_prompts("cuda", groups_per_step=16) == 3  # 3 GPUs x 2 engines
    assert SamplerConfig(count=3).batch_prompts("cuda", groups_per_step=64) == 22  # ceil(64 / 3)
    assert SamplerConfig(prompts_per_batch=5).batch_prompts("cuda", groups_per_step=64) == 5  # asked for: kept
    with pytest.raises(ValueError, match="prompts_per_batch >= 0"):
        SamplerConfig(prompts_per_batch=-1)


def test_paced_streams_auto_is_one_with_the_defaults_and_fills_the_pacers_room_on_a_gpu():
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.config.sampler import SamplerConfig

    default = GRPOConfig()
    n, s = default.run.groups_per_step, default.run.staleness_bound()
    # The default run, on the CPU and on one GPU: one batch in flight, as before the flag.
    assert default.sampler.paced_streams("cpu", n, s) == 1
    assert default.sampler.paced_streams("cuda", n, s) == 1  # one batch of 16 is the whole room of 16
    assert default.sampler.paced_streams("cuda", n, 2) == 2  # max_staleness 2: room for two batches
    assert SamplerConfig(prompts_per_batch=4).paced_streams("cuda", 16, 2) == 8  # ceil(32 / 4), at most 8
    assert SamplerConfig(count=2).paced_streams("cuda", 16, 2) == 2  # each sampler's half: 16 / 8
    assert SamplerConfig(prompts_per_batch=4).paced_streams("cpu", 16, 2) == 1  # the CPU: one at a time
    assert SamplerConfig(streams=3).paced_streams("cpu", 16, 1) == 3  # asked for: kept
    with pytest.raises(ConfigError, match=r"^--sampler.streams -1: streams must be >= 0 \(0: auto\), not -1$"):
        parse_overrides(GRPOConfig(), ["--sampler.streams", "-1"])


def test_a_run_over_nodes_counts_every_joined_nodes_gpus():
    """Two hosts of one GPU each: the trainer and the sampler get one each (NCCL between the hosts),
    not both node 0's (colocated over CUDA IPC, which cannot reach the other host)."""
    nodes = [NodeStatus(0, "a", "10.0.0.1", 1, 1, "joined"), NodeStatus(1, "b", "10.0.0.2", 1, 1, "joined")]
    plan = plan_devices("auto", *cluster_devices("cuda", ["0"], nodes), 1)
    assert plan.device == "cuda" and not plan.colocated and plan.sync_backend == "nccl"
    lost = [nodes[0], NodeStatus(1, "b", "10.0.0.2", 1, 1, "lost: silent for 3 s")]
    assert cluster_devices("cuda", ["0"], lost) == ("cuda", ["0"])  # a lost node's GPUs are not counted
    assert plan_devices("auto", *cluster_devices("cuda", ["0"], lost), 1).colocated
    assert cluster_devices(None, [], nodes) == (None, [])  # a head node without GPUs plans for the CPU
    assert cluster_devices("cuda", ["0", "1"], nodes[:1]) == ("cuda", ["0", "1"])  # one node: its own devices


def test_scorers_get_a_gpu_each_when_every_one_can_else_share_the_trainers():
    # a host with exactly trainer + sampler GPUs: adding a teacher leaves the samplers on their own
    plan = plan_devices("auto", "cuda", ["0", "1"], 1, scorers=1)
    assert (plan.colocated, plan.sync_backend, plan.sampler_gpus) == (False, "nccl", 1)
    assert (plan.scorers_colocated, plan.scorer_gpus) == (True, 0)
    assert plan.line == (
        "cuda, 2 GPU(s): GPU 0 the trainer, GPU 1 a sampler; the 1 scorer(s) share the trainer's GPU; "
        "1 sampler(s), one weight broadcast reaches them all"
    )
    # one GPU short of a scorer each: none gets its own, and the spare one is named
    plan = plan_devices("auto", "cuda", ["0", "1", "2"], 1, scorers=2)
    assert (plan.colocated, plan.scorers_colocated) == (False, True)
    assert "2 scorer(s) share the trainer's GPU; 1 GPU(s) left unused: too few for one a scorer" in plan.line
    # enough: one each
    plan = plan_devices("auto", "cuda", ["0", "1", "2", "3"], 1, scorers=2)
    assert (plan.colocated, plan.scorers_colocated, plan.scorer_gpus, plan.sampler_gpus) == (False, False, 1, 1)
    assert plan.line.startswith("cuda, 4 GPU(s): GPU 0 the trainer, GPU 1 a sampler, GPUs 2-3 a scorer each; ")
    # too few for the samplers: everything on the trainer's GPU
    plan = plan_devices("auto", "cuda", ["0"], 1, scorers=1)
    assert (plan.colocated, plan.scorers_colocated, plan.scorer_gpus, plan.sync_backend) == (True, True, 0, "ipc")
    assert plan.line.endswith("take weights over CUDA IPC; the 1 scorer(s) share the trainer's GPU")
    # the CPU: nothing to share
    plan = plan_devices("auto", None, [], 1, scorers=2)
    assert (plan.device, plan.scorer_gpus, plan.scorers_colocated) == ("cpu", 0, False)


@pytest.mark.parametrize(
    ("gpus", "ranks", "scorers", "samplers", "roles"),
    [
        (1, 1, 0, 1, None),  # one GPU: a sampler shares it (colocated)
        (2, 1, 0, 2, "GPU 0 the trainer, GPU 1 2 samplers"),
        (4, 1, 0, 6, "GPU 0 the trainer, GPUs 1-3 2 samplers each"),
        (8, 1, 0, 14, "GPU 0 the trainer, GPUs 1-7 2 samplers each"),
        (8, 2, 0, 12, "GPUs 0-1 a trainer rank each (FSDP2), GPUs 2-7 2 samplers each"),
        (4, 1, 1, 4, "GPU 0 the trainer, GPUs 1-2 2 samplers each, GPU 3 a scorer"),
        (2, 1, 1, 2, "GPU 0 the trainer, GPU 1 2 samplers"),  # no GPU left for the scorer: it shares
        (2, 2, 0, 1, None),  # the ranks take both: a sampler shares rank 0's
    ],
)
def test_sampler_count_auto_puts_two_samplers_on_every_gpu_the_trainer_leaves(gpus, ranks, scorers, samplers, roles):
    plan = plan_devices("auto", "cuda", [str(i) for i in range(gpus)], 0, trainer_ranks=ranks, scorers=scorers)
    assert plan.samplers == samplers
    assert f"{samplers} sampler(s) (--sampler.count auto)" in plan.line
    if roles is None:
        assert plan.colocated and plan.sampler_gpus == 0
    else:
        assert not plan.colocated and plan.sampler_gpus == 1 and plan.sync_backend == "nccl"
        assert plan.line.startswith(f"cuda, {gpus} GPU(s): {roles}"), plan.line
        used = ranks + samplers // 2 + (0 if plan.scorers_colocated else scorers)
        assert used == gpus and "unused" not in plan.line  # every GPU works


def test_sampler_count_auto_is_one_on_the_cpu_and_a_count_asked_for_is_kept():
    assert plan_devices("auto", None, [], 0).samplers == 1
    assert plan_devices("cpu", "cuda", ["0", "1", "2"], 0).samplers == 1
    plan = plan_devices("auto", "cuda", ["0", "1", "2", "3"], 1)  # asked for one: the rest said unused
    assert plan.samplers == 1 and "2 GPU(s) left unused" in plan.line
    assert "(--sampler.count auto)" not in plan.line


def test_sampler_count_auto_over_two_hosts_counts_both():
    """Two hosts of two GPUs: the trainer on one, two samplers on each of the three others."""
    nodes = [NodeStatus(0, "a", "10.0.0.1", 2, 2, "joined"), NodeStatus(1, "b", "10.0.0.2", 2, 2, "joined")]
    plan = plan_devices("auto", *cluster_devices("cuda", ["0", "1"], nodes), 0)
    assert plan.samplers == 6 and not plan.colocated


def test_vllm_args_are_a_json_object_refused_in_one_line_otherwise():
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.config.sampler import SamplerConfig

    config = parse_overrides(GRPOConfig(), ["--sampler.vllm_args", '{"max_num_seqs": 512, "async_scheduling": true}'])
    assert config.sampler.engine_args() == {"max_num_seqs": 512, "async_scheduling": True}
    assert SamplerConfig().engine_args() == {}
    with pytest.raises(ConfigError, match=r"^--sampler.vllm_args '\[1\]': vllm_args must be a JSON object"):
        parse_overrides(GRPOConfig(), ["--sampler.vllm_args", "[1]"])
    with pytest.raises(ConfigError, match=r"vllm_args must be a JSON object of vLLM engine arguments \(Expecting"):
        parse_overrides(GRPOConfig(), ["--sampler.vllm_args", "{max_num_seqs: 1}"])


def test_per_gpu_puts_that_many_samplers_on_each_sampler_gpu():
    plan = plan_devices("auto", "cuda", ["0", "1", "2", "3"], 0, per_gpu=2)
    assert (plan.samplers, plan.per_gpu, plan.colocated, plan.sync_backend) == (6, 2, False, "nccl")
    assert "GPU 0 the trainer, GPUs 1-3 2 samplers each" in plan.line
    assert "NCCL between GPUs, CUDA IPC within one" in plan.line
    # Sampler i shares the GPU of sampler i - i % 2; the owners take a GPU each.
    assert [plan.gpu_owner(i) for i in range(6)] == [None, 0, None, 2, None, 4]
    # Their engines split the GPU's memory (0.85 alone), unless the user set a share.
    assert plan.vllm_options(0.0, 6) == {"gpu_memory_utilization": 0.425}
    assert plan.vllm_options(0.3, 6) == {"gpu_memory_utilization": 0.3}
    # An odd count: the last GPU holds one; too many for the GPUs: refused as before.
    odd = plan_devices("auto", "cuda", ["0", "1", "2"], 3, per_gpu=2)
    assert not odd.colocated and "GPUs 1-2 2 samplers each" in odd.line
    assert plan_devices("auto", "cuda", ["0", "1"], 3, per_gpu=2).colocated  # 2 sampler GPUs wanted, 1 left
    # One GPU alone: colocated, per_gpu has nothing to split.
    one = plan_devices("auto", "cuda", ["0"], 0, per_gpu=2)
    assert one.colocated and one.samplers == 1 and one.gpu_owner(0) is None


def test_per_gpu_auto_is_two_and_a_negative_count_is_refused():
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.config.sampler import SamplerConfig

    assert SamplerConfig().per_gpu == 0  # auto (driver/devices.py: 2 with --sampler.count auto)
    assert plan_devices("auto", "cuda", ["0", "1", "2"], 0, per_gpu=1).samplers == 2  # one a GPU, asked for
    # A count asked for spreads over the GPUs left before it doubles up.
    assert plan_devices("auto", "cuda", ["0", "1", "2", "3"], 3).per_gpu == 1
    assert plan_devices("auto", "cuda", ["0", "1", "2", "3"], 5).per_gpu == 2
    with pytest.raises(ConfigError, match=r"per_gpu must be >= 0 \(0: auto"):
        parse_overrides(GRPOConfig(), ["--sampler.per_gpu", "-1"])


def test_clients_per_engine_makes_whole_engines_each_of_one_host_and_its_clients():
    """--sampler.clients_per_engine 2 with two samplers a GPU: one engine a GPU, started by the
    first sampler of the two (its host) and fed by the second; the GPU's memory is the one engine's
    (0.85, not split); the client starts with its host (it waits for the engine, starts none). A
    count or a per_gpu that makes no whole engines is refused in one line, and so are a share
    below 1, one on the HF backend, which has no engine to share, and LoRA adapter syncs, which
    each sampler takes for itself."""
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides

    plan = plan_devices("auto", "cuda", ["0", "1", "2"], 0, per_gpu=2, clients_per_engine=2)
    assert (plan.samplers, plan.per_gpu, plan.clients_per_engine) == (4, 2, 2)
    assert "2 samplers a vLLM engine (--sampler.clients_per_engine)" in plan.line
    assert [plan.engine_host(i) for i in range(4)] == [None, 0, None, 2]
    assert [plan.gpu_owner(i) for i in range(4)] == [None, 0, None, 2]  # each client on its host's GPU
    assert [plan.start_wave(i) for i in range(4)] == [0, 0, 0, 0]
    assert plan.vllm_options(0.0, 4) == {}
    four = plan_devices("auto", "cuda", ["0", "1"], 4, per_gpu=4, clients_per_engine=2)  # two engines a GPU
    assert four.vllm_options(0.0, 4) == {"gpu_memory_utilization": 0.425}
    assert [four.start_wave(i) for i in range(4)] == [0, 0, 1, 1]  # the second engine beside the first
    colocated = plan_devices("auto", "cuda", ["0"], 2, clients_per_engine=2)
    assert colocated.colocated and colocated.vllm_options(0.0, 2) == {"gpu_memory_utilization": 0.3}
    cpu = plan_devices("cpu", None, [], 4, clients_per_engine=2)
    assert [cpu.engine_host(i) for i in range(4)] == [None, 0, None, 2] and cpu.vllm_options(0.0, 4) == {}
    assert plan_devices("cpu", None, [], 3).engine_host(1) is None  # 1: an engine each
    with pytest.raises(ConfigError, match=r"^--sampler.clients_per_engine 2: the 3 sampler\(s\) do not make"):
        plan_devices("cpu", None, [], 3, clients_per_engine=2)
    with pytest.raises(ConfigError, match=r"the 3 sampler\(s\) of a GPU do not make whole engines"):
        plan_devices("auto", "cuda", ["0", "1", "2"], 6, per_gpu=3, clients_per_engine=2)
    with pytest.raises(ConfigError, match=r"clients_per_engine must be >= 1 \(1: an engine each"):
        parse_overrides(GRPOConfig(), ["--sampler.clients_per_engine", "0"])
    with pytest.raises(ConfigError, match=r"shares a vLLM engine: use --sampler.backend vllm"):
        parse_overrides(GRPOConfig(), ["--sampler.clients_per_engine", "2", "--sampler.backend", "hf"])
    with pytest.raises(ConfigError, match=r"adapters reach each sampler, not a shared engine"):
        shared = ["--sampler.clients_per_engine", "2", "--trainer.lora.rank", "8", "--trainer.lora.sync", "adapter"]
        parse_overrides(GRPOConfig(), shared)


def test_samplers_that_share_a_gpu_start_in_different_waves():
    """--sampler.per_gpu 2 over 3 GPUs: samplers 0, 2, 4 (one a GPU) start together, then 1, 3, 5,
    each beside a running engine (vLLM measures the free memory as it starts)."""
    from asyncrl.rl.driver.fleet.sampler_start import start_samplers

    async def main() -> None:

        running: set[int] = set()
        seen: list[tuple[int, frozenset[int]]] = []

        async def spawn(i: int):
            seen.append((i, frozenset(running)))
            await asyncio.sleep(0.01)
            running.add(i)
            state = types.SimpleNamespace(final=False)
            info = types.SimpleNamespace(state=state, restarts=0, max_restarts=1, error=None)
            return types.SimpleNamespace(name=f"sampler{i}", info=lambda: info)

        plan = plan_devices("auto", "cuda", ["0", "1", "2", "3"], 6, per_gpu=2)
        handles = await start_samplers(spawn, 6, wave_of=plan.start_wave, log=print)
        assert [h.name for h in handles] == [f"sampler{i}" for i in range(6)]
        assert dict(seen) == {0: set(), 2: set(), 4: set(), 1: {0, 2, 4}, 3: {0, 2, 4}, 5: {0, 2, 4}}

    run_virtual(main())


def test_per_gpu_auto_is_one_where_the_placement_names_the_samplers_nodes():
    from asyncrl.rl.driver.spawn import _one_a_gpu_where_placed

    assert _one_a_gpu_where_placed("node0") == 0  # the plan's auto: 2 with --sampler.count auto
    assert _one_a_gpu_where_placed("spread") == 1
    assert _one_a_gpu_where_placed("trainer=0 sampler=1,2") == 1
    assert _one_a_gpu_where_placed("trainer=1") == 0


def test_a_run_s_starts_side_by_side_end_at_the_first_error_and_only_on_the_cpu():
    """The trainer, the scorers and the samplers start together on the CPU (driver/build.py), one
    after another on GPUs (where they are placed first-fit and a colocated engine measures the
    memory the trainer left). Started together, results come back in order; the first error
    cancels the other starts (a cancelled start kills its process) and is what the run stops on."""
    from asyncrl.rl.driver.build import _start_beside_the_trainer
    from asyncrl.rl.driver.fleet.sampler_start import all_or_first_error

    assert _start_beside_the_trainer(plan_devices("cpu", "cuda", ["0", "1"], 0))
    assert not _start_beside_the_trainer(plan_devices("auto", "cuda", ["0", "1"], 0))
    assert not _start_beside_the_trainer(plan_devices("auto", "cuda", ["0"], 0))  # colocated

    async def main() -> None:
        assert await all_or_first_error([]) == []
        cancelled: list[str] = []

        async def start(name: str, after_s: float, fails: bool = False) -> str:
            try:
                await asyncio.sleep(after_s)
            except asyncio.CancelledError:
                cancelled.append(name)
                raise
            if fails:
                raise RuntimeError(f"{name} refused to start")
            return name

        names = ["trainer", "scorer", "sampler0"]
        started = [asyncio.ensure_future(start(n, 10.0 * i)) for i, n in enumerate(names)][::-1]
        assert await all_or_first_error(started) == names[::-1]  # in the order given, not the order they ended
        starts = [start("trainer", 30.0), start("scorer", 0.0, fails=True), start("sampler0", 30.0)]
        with pytest.raises(RuntimeError, match="scorer refused to start"):
            await all_or_first_error([asyncio.ensure_future(s) for s in starts])
        assert sorted(cancelled) == ["sampler0", "trainer"]

    run_virtual(main())
