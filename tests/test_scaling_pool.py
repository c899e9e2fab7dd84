"""The `Scaler`'s side of elastic samplers (driver/fleet/scaling.py), in-process and deterministic with
test_recovery_pool.py's scripted stand-ins (the real run, 1 -> 3 -> 1, is test_elastic.py):

* A scale-down asked while a sync is in flight leaves that sync alone (every member takes its
  weights); it is applied at the next sync, which re-forms the group once, without the drained
  samplers, and their processes are stopped.
* A scale-up asked while a sampler restarts counts the restarting one; the new sampler and the
  one back from its restart join at one re-formation. A scale-down during a restart drains the
  restarting sampler first, and it stays out when its restart ends.
* A size beyond the devices, or no size at all, is refused in one line naming what to ask.
* With every sampler lost, a new one joins without waiting for a sync; one gone for good is
  replaced to keep the target; a CPU scale-up goes to the node with the fewest samplers.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.rl.driver.fleet.membership import MemberState
from asyncrl.rl.driver.fleet.scaling import Scaler, ScaleRefusedError, check_target
from asyncrl.rl.driver.fleet.sync_group import SyncPlace
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.runtime.cluster.nodes import NodeStatus
from test_recovery_pool import GOT, SENT, Scripted, answering, make_pool

pytestmark = pytest.mark.timeout(60)
PLACE = SyncPlace("127.0.0.1", "gloo")
JOINS = dict(
    stats=[(0.0, answering())], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)], restore_data_state=[(0.0, None)]
)


def trainer(send_s: float = 0.0) -> Scripted:
    return Scripted(
        "trainer",
        send_weights=[(send_s, SENT)],
        sync_listen=[(0.0, 1234)],
        sync_join=[(0.0, "gloo")],
        setup_sender=[(0.0, 1)],
    )


def sampler(name: str) -> Scripted:
    return Scripted(name, receive_weights=[(0.0, GOT)], **JOINS)


class Source:
    """Stands in for the run's `SamplerSpawner` (a `SamplerSource`) on the CPU: ``spawned[i]`` is
    what spawning sampler ``i`` gives, after a while; each stop is recorded in ``stopped``."""

    device, colocated, per_gpu, clients_per_engine = "cpu", False, 1, 1

    def __init__(self, stopped: list[str], spawned: dict[int, Scripted] | None = None, nodes=None, cores: int = 0):
        self.stopped, self.spawned, self._nodes, self._cores = stopped, spawned or {}, nodes or [], cores

    async def __call__(self, index: int) -> Scripted:
        await asyncio.sleep(0.2)  # a start takes a while
        return self.spawned[index]

    def seed_of(self, index: int) -> int:
        return index

    async def stop(self, handle) -> None:
        self.stopped.append(handle.name)
        handle.set_state("stopped")

    def free_gpus(self) -> int:
        return 0

    def nodes(self) -> list:
        return list(self._nodes)

    def cores(self) -> int:
        return self._cores


def scaler_of(pool, logs: list[str], stopped: list[str], spawned: dict[int, Scripted] | None = None) -> Scaler:
    return Scaler(pool, Source(stopped, spawned), log=logs.append)


async def test_a_drain_asked_during_a_sync_is_applied_at_the_next_one_with_one_reformation():
    samplers = [sampler(f"sampler{i}") for i in range(3)]
    logs, stopped = [], []
    pool = make_pool(trainer(send_s=0.5), samplers, logs)
    scaler = scaler_of(pool, logs, stopped)
    try:
        in_flight = asyncio.ensure_future(pool.sync(1))
        await asyncio.sleep(0.2)
        assert not in_flight.done()
        assert scaler.request({"samplers": 1}) == {
            "samplers": 3,
            "running": 3,
            "restarting": 0,
            "starting": 0,
            "previous_target": 3,
            "target": 1,
            "step": 0,
        }
        assert all(m.state is MemberState.JOINED for m in pool.members)  # nothing changes under the sync
        await in_flight
        assert [s.calls.count("receive_weights") for s in samplers] == [1, 1, 1], logs
        assert pool.generation == 0 and pool.counters["rebuilds"] == 0

        await scaler.at_sync()
        assert [m.state for m in pool.members] == [MemberState.JOINED, MemberState.DRAINED, MemberState.DRAINED]
        await pool.sync(2)
        await scaler.close()
    finally:
        await pool.close()
    assert pool.generation == 1 and pool.counters["rebuilds"] == 1, logs  # one re-formation
    assert samplers[0].calls.count("sync_join") == 1 and samplers[0].calls.count("receive_weights") == 2
    for drained in samplers[1:]:  # out of the new group: neither joined it nor took v2
        assert drained.calls.count("sync_join") == 0 and drained.calls.count("receive_weights") == 1
    assert sorted(stopped) == ["sampler1", "sampler2"] and not pool.faults
    assert pool.progress().samplers == {"sampler0": "in group", "sampler1": "drained", "sampler2": "drained"}
    assert pool.take_events()["samplers_in_group"] == 1


async def test_a_scale_during_a_restart_counts_it_and_joins_everyone_at_one_reformation():
    samplers = [sampler("sampler0"), sampler("sampler1")]
    new = sampler("sampler2")
    logs, stopped = [], []
    pool = make_pool(trainer(), samplers, logs)
    scaler = scaler_of(pool, logs, stopped, {2: new})
    try:
        samplers[1].set_state("restarting")
        pool.membership.lose(pool.members[1], "died (killed by SIGKILL)", kill=False)
        answer = scaler.request({"samplers": 3})
        assert (answer["samplers"], answer["running"], answer["restarting"]) == (2, 1, 1)  # the restarting one counts
        assert list(scaler.starting) == [2]  # started at once; joins at a sync
        await scaler.at_sync()
        assert list(scaler.starting) == [2]
        samplers[1].set_state("running", incarnation=2)  # back from its restart
        await asyncio.wait_for(asyncio.gather(pool.members[1].waiter, scaler.starting[2]), 5)
        await scaler.at_sync()  # admits sampler2; starts nothing more
        assert [m.name for m in pool.members] == ["sampler0", "sampler1", "sampler2"] and not scaler.starting
        await pool.sync(1)
        assert pool.generation == 1 and pool.counters["rebuilds"] == 1, logs
        assert all(m.state is MemberState.JOINED for m in pool.members), logs
        assert new.calls.count("receive_weights") == 1 and pool.members[2].min_version == 1

        # Down by one while sampler0 restarts: it is the one drained, and stays out once back.
        samplers[0].set_state("restarting")
        pool.membership.lose(pool.members[0], "died (killed by SIGKILL)", kill=False)
        scaler.request({"samplers": 2})
        await scaler.at_sync()
        samplers[0].set_state("running", incarnation=2)
        await asyncio.sleep(0.1)
        await pool.sync(2)
        await scaler.close()
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.DRAINED, MemberState.JOINED, MemberState.JOINED], logs
    assert pool.generation == 2 and pool.counters["rebuilds"] == 2 and stopped == ["sampler0"], logs
    assert samplers[0].calls.count("sync_join") == 1  # joined generation 1 only


async def test_samplers_that_share_engines_are_not_scaled():
    """A scale-up or -down would start or drain one client of an engine without the others (or
    its host without its clients): refused in one line, the fleet as it was."""
    logs, stopped = [], []
    pool = make_pool(trainer(), [sampler("sampler0"), sampler("sampler1")], logs)
    source = Source(stopped)
    source.clients_per_engine = 2
    scaler = Scaler(pool, source, log=logs.append)
    try:
        with pytest.raises(ScaleRefusedError, match=r"share vLLM engines \(--sampler.clients_per_engine 2\)"):
            scaler.request({"samplers": 4})
        assert scaler.target is None and not scaler.starting
    finally:
        await scaler.close()
        await pool.close()


async def test_with_every_sampler_lost_a_new_one_joins_without_waiting_for_a_sync():
    # The only sampler is lost and not back (its restart may never come): no step, and so no
    # sync, can come while the driver waits for a batch. A sampler started by a scale-up is added
    # as soon as it is up, and that wait re-forms the group with it and pumps its groups.
    gone, new = sampler("sampler0"), sampler("sampler1")
    new.script["rollouts"] = []
    logs, stopped = [], []
    pool = make_pool(trainer(), [gone], logs)
    scaler = scaler_of(pool, logs, stopped, {1: new})
    try:
        gone.set_state("restarting")
        pool.membership.lose(pool.members[0], "died (killed by SIGKILL)", kill=False)
        scaler.request({"samplers": 2})  # the lost one counts: it may come back
        assert list(scaler.starting) == [1]
        for i in range(2):
            new.items.put_nowait(RolloutGroup(i, [1], [[2], [3]], [[-0.1], [-0.2]], [0.0, 1.0], version=0))
        batch = await asyncio.wait_for(pool.next_batch(2, 0), 10)
        await scaler.close()
    finally:
        await pool.close()
    assert [g.uid for g in batch] == ["sampler1/1/1", "sampler1/1/2"], logs
    assert pool.members[0].state is MemberState.LOST and pool.members[1].state is MemberState.JOINED, logs
    assert pool.generation == 1 and new.calls.count("receive_weights") == 1, logs


def test_a_size_beyond_the_devices_is_refused_in_one_line():
    plan = dict(device="cuda", colocated=False, started=2, free_gpus=1)
    assert check_target(3, active=2, **plan) == 3
    with pytest.raises(ScaleRefusedError) as e:
        check_target(5, active=2, **plan)
    assert str(e.value) == ("--samplers 5: 3 more sampler(s) need a GPU each, but 1 GPU(s) are free; ask for at most 3")
    with pytest.raises(ScaleRefusedError, match=r"ask for at most 2, or start the run with --sampler.count 3$"):
        check_target(3, active=2, device="cuda", colocated=True, started=2, free_gpus=0)
    for bad in (0, -1, "3", True, 2.5):
        with pytest.raises(ScaleRefusedError) as e:
            check_target(bad, active=2, **plan)
        assert "\n" not in str(e.value)
    assert check_target(40, active=1, device="cpu", colocated=False, started=1, free_gpus=0) == 40


def test_a_cpu_sampler_started_by_a_scale_up_goes_to_the_node_with_the_fewest():
    from types import SimpleNamespace as S

    from asyncrl.rl.driver.fleet.scaling import least_loaded_node

    nodes = [
        NodeStatus(r, f"host{r}", f"10.0.0.{r}", 0, 0, state)
        for r, state in enumerate(["joined", "joined", "lost: silent"])
    ]
    actors = [
        S(name="trainer", state="running", node=1),
        S(name="sampler0", state="running", node=0),
        S(name="sampler1", state="stopped", node=1),
        S(name="sampler2", state="running", node=2),
    ]
    assert least_loaded_node(nodes, actors) == 1  # a node that joined late, with no sampler yet
    actors.append(S(name="sampler3", state="starting", node=1))
    assert least_loaded_node(nodes, actors) == 0  # a tie: the lowest rank; a lost node never


async def test_a_sampler_gone_for_good_is_replaced_to_keep_the_target():
    # Its restarts used up (or its node lost): with a target set, the next sync starts another.
    samplers = [sampler("sampler0"), sampler("sampler1")]
    logs, stopped = [], []
    pool = make_pool(trainer(), samplers, logs)
    scaler = scaler_of(pool, logs, stopped, {2: sampler("sampler2")})
    try:
        scaler.request({"samplers": 2})
        await scaler.at_sync()
        assert not scaler.starting  # the target is met
        samplers[1].restarts = samplers[1].max_restarts
        samplers[1].set_state("dead")
        pool.membership.lose(pool.members[1], "died (node 1 lost)", kill=False)
        await asyncio.wait_for(pool.members[1].waiter, 5)
        assert pool.members[1].state is MemberState.GONE
        await scaler.at_sync()
        assert list(scaler.starting) == [2]
        await asyncio.wait_for(scaler.starting[2], 5)
        await scaler.at_sync()
        await pool.sync(1)
        await scaler.close()
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.JOINED, MemberState.GONE, MemberState.JOINED], logs


async def test_a_checkpoint_records_the_scaled_size_and_a_resumed_scaler_keeps_it(tmp_path):
    import msgspec

    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.driver.build import Spawned, build_driver
    from asyncrl.rl.driver.grpo import RunFiles
    from asyncrl.rl.driver.run_state import RunState

    class Trainer(Scripted):  # keeps the run state each checkpoint is given
        def __init__(self):
            super().__init__("trainer")
            self.saved: list[RunState] = []

        def with_timeout(self, timeout_s: float):
            async def save_checkpoint(run_dir: str, step: int, keep: int, state: bytes) -> str:
                self.saved.append(msgspec.json.decode(state, type=RunState))
                return f"{run_dir}/checkpoints/step_{step}"

            return SimpleNamespace(save_checkpoint=save_checkpoint)

    config = parse_overrides(GRPOConfig(), ["--run.run_dir", str(tmp_path)])
    logs, stopped, saver = [], [], Trainer()
    source = Source(stopped, {1: sampler("sampler1"), 2: sampler("sampler2")})
    driver = build_driver(
        config, Spawned(saver, [sampler("sampler0")], [0], PLACE), RunFiles(str(tmp_path)), logs.append, source=source
    )
    try:
        await driver.checkpoint(1)
        driver.scaler.request({"samplers": 3})
        await driver.checkpoint(2)
        await driver.scaler.close()
    finally:
        await driver.pool.close()
    assert [s.samplers_target for s in saver.saved] == [0, 3]  # 0: never scaled, --sampler.count holds

    # The resumed segment started 3 (run.py) and keeps 3 as its target: one gone for good since
    # the resume is replaced, as it would have been before the checkpoint.
    samplers = [sampler(f"sampler{i}") for i in range(3)]
    pool = make_pool(trainer(), samplers, logs)
    replacements = {i: sampler(f"sampler{i}") for i in range(3, 6)}
    resumed = Scaler(pool, Source(stopped, replacements), log=logs.append, started=1, target=3)
    try:
        samplers[2].restarts = samplers[2].max_restarts
        samplers[2].set_state("dead")
        pool.membership.lose(pool.members[2], "died (killed by SIGKILL)", kill=False)
        await asyncio.wait_for(pool.members[2].waiter, 5)
        await resumed.at_sync()
        assert list(resumed.starting) == [3] and resumed.progress().samplers_target == 3, logs
        await resumed.close()
    finally:
        await pool.close()


async def test_the_samplers_of_a_node_leaving_are_drained_at_one_reformation():
    # Node 1's agent was told to stop (an elastic cluster: it shows "draining"): both its samplers
    # leave the group at the next sync, which re-forms it once with the one on node 0; their
    # processes are stopped (which lets the agent go). With a target set, others replace them.
    samplers = [sampler(f"sampler{i}") for i in range(3)]
    samplers[1].node = samplers[2].node = 1
    nodes = [NodeStatus(r, f"host{r}", f"10.0.0.{r}", 0, 0, "joined") for r in (0, 1)]
    logs, stopped = [], []
    pool = make_pool(trainer(), samplers, logs)
    scaler = Scaler(pool, Source(stopped, nodes=nodes), log=logs.append)
    try:
        await scaler.at_sync()
        await pool.sync(1)
        assert pool.generation == 0 and not stopped  # nothing is leaving: a plain sync
        for i in range(2):  # groups sampler1 delivered before: accepted, they stay
            assert await pool.queue.put(
                RolloutGroup(i, [1], [[2], [3]], [[-0.1], [-0.2]], [0.0, 1.0], version=1, uid=f"sampler1/1/{i + 1}"),
                timeout_s=1.0,
            )
        nodes[1] = NodeStatus(1, "host1", "10.0.0.1", 0, 0, "draining: received SIGTERM")
        await scaler.at_sync()
        await scaler.at_sync()  # drained once, not again
        await pool.sync(2)
        await scaler.close()
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.JOINED, MemberState.DRAINED, MemberState.DRAINED], logs
    assert pool.generation == 1 and pool.counters["rebuilds"] == 1, logs  # one re-formation for both
    assert sorted(stopped) == ["sampler1", "sampler2"] and not pool.faults, logs
    assert samplers[0].calls.count("sync_join") == 1 and samplers[1].calls.count("sync_join") == 0
    assert len(pool.queue) == 2  # what it delivered before it left is kept
    (event,) = [e for e in pool.take_events()["events"] if e["event"] == "node_leaving"]
    assert event["node"] == 1 and event["samplers"] == 2 and "received SIGTERM" in event["detail"], event


async def test_the_endpoint_command_gives_each_samplers_root_url_and_token(tmp_path):
    """Code outside a run's episodes reaches its samplers' OpenAI endpoints with ``asyncrl status
    RUN_DIR --endpoint`` (seen: the log printed the URL and said nowhere where the token was): the
    status socket's ``endpoint`` command, as run.py registers it, asks every sampler in or coming
    to the group and the CLI prints one line each, a sampler that cannot serve one included; before
    any sampler is up it says when to ask, exit status 1."""
    from asyncrl import Supervisor
    from asyncrl.rl.driver.fleet.endpoints import sampler_endpoints
    from test_status import status_cli

    up = {"base_url": "http://127.0.0.1:4001/v1", "token": "tok-0"}
    samplers = [
        Scripted("sampler0", openai_endpoint=[(0.0, up)], **JOINS),
        Scripted("sampler1", openai_endpoint=[(0.0, RuntimeError("the OpenAI endpoint needs aiohttp"))], **JOINS),
        Scripted("sampler2", **JOINS),
    ]
    pool = make_pool(trainer(), samplers, [])
    pool.membership.members[2].state = MemberState.GONE  # lost for good: not asked
    membership = None
    async with Supervisor() as sup:
        server = await sup.serve_status(tmp_path, progress=lambda: {"phase": "training"})
        server.add_command("endpoint", lambda args: sampler_endpoints(membership, args))
        code, out, err = await status_cli(str(tmp_path), "--endpoint")
        assert (code, out) == (1, "") and "no sampler is up yet" in err
        membership = pool.membership
        code, out, err = await status_cli(str(tmp_path), "--endpoint")
    lines = out.splitlines()
    assert code == 0 and err == "" and len(lines) == 3
    assert lines[0] == "sampler0: base_url http://127.0.0.1:4001/v1  token tok-0"
    assert lines[1] == "sampler1: no endpoint: the OpenAI endpoint needs aiohttp"
    assert lines[2].startswith("Use them as openai.OpenAI(base_url=..., api_key=token)")
    assert samplers[2].calls == []


def test_more_cpu_samplers_than_cores_is_refused_unless_forced():
    """Seen: ``asyncrl scale RUN --samplers 99`` on a CPU host started 98 sampler processes at once
    (load 34). More CPU samplers than the host has cores is refused in one line, unless forced
    (``--force``); shrinking, or a fleet already that large, never is."""
    cpu = dict(device="cpu", colocated=False, started=1, free_gpus=0)
    with pytest.raises(ScaleRefusedError) as e:
        check_target(99, active=1, cores=2, **cpu)
    assert str(e.value) == (
        "--samplers 99: more CPU samplers than the 2 core(s) of the run's node(s) (each decodes on a core "
        "of its own, beside the trainer); ask for at most 2, or add --force"
    )
    assert check_target(99, active=1, cores=2, force=True, **cpu) == 99
    assert check_target(2, active=1, cores=2, **cpu) == 2
    assert check_target(3, active=4, cores=2, **cpu) == 3  # a fleet started larger may shrink
    with pytest.raises(ScaleRefusedError, match="1 GPU"):  # a GPU the run cannot place on: forced or not
        check_target(5, active=2, device="cuda", colocated=False, started=2, free_gpus=1, force=True)


def test_the_cpu_cores_of_a_cluster_are_each_joined_nodes_own():
    """The cores a scale-up of CPU samplers may use are each joined node's as its agent reported
    them, not this host's times the nodes (a 2-core node beside a 64-core one took as many
    samplers as its neighbour); a node lost or leaving has none to give, and one whose (older)
    agent reported none counts as this host."""
    import os

    from asyncrl.rl.driver.spawn import _cpu_cores

    def cluster(*nodes):
        return SimpleNamespace(nodes=lambda: [NodeStatus(r, "h", "a", 0, 0, *n) for r, n in enumerate(nodes)])

    here = len(os.sched_getaffinity(0))
    assert _cpu_cores(cluster(("joined", 2))) == 2
    assert _cpu_cores(cluster(("joined", 2), ("joined", 64), ("lost: silent", 8), ("draining: x", 4))) == 66
    assert _cpu_cores(cluster(("joined", 2), ("joined", 0))) == 2 + here


async def test_the_answer_says_the_samplers_running_and_starting_and_the_target_before():
    """Seen: a scale to 99, then to 1, answered ``99 -> 1``: the target pending, not the samplers
    running. The answer and the log line say both; ``samplers_target`` is in the progress from the
    start (the run's count), not only once a scale was asked."""
    samplers = [sampler("sampler0")]
    logs, stopped = [], []
    pool = make_pool(trainer(), samplers, logs)
    scaler = scaler_of(pool, logs, stopped, {1: sampler("sampler1"), 2: sampler("sampler2")})
    try:
        assert scaler.progress().to_dict() == {"samplers_target": 1, "samplers_starting": []}
        up = scaler.request({"samplers": 3})
        assert (up["running"], up["starting"], up["previous_target"], up["target"]) == (1, 0, 1, 3)
        down = scaler.request({"samplers": 1})
        assert (down["running"], down["starting"], down["previous_target"], down["target"]) == (1, 2, 3, 1)
        assert down["samplers"] == 3  # running, restarting and starting: what the run had coming
        assert (
            logs[-1] == "scale: 1 running, 2 starting (target 3) -> 1 sampler(s) asked; applied at the next weight sync"
        )
        with pytest.raises(ScaleRefusedError, match="takes samplers=N and force only"):
            scaler.request({"samplers": 1, "speed": 2})
        await scaler.close()
    finally:
        await pool.close()
