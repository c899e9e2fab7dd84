"""Multi-node on one machine: node agents as separate processes on loopback (different ports),
actors placed on every node, calls across them, and the failures that matter: an actor killed on
another node, a node agent killed, the supervisor killed. Every process here is real."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from actors import Echo, PhasedStart
from asyncrl import ActorDiedError, ActorStartError, ClusterStartError, NoFreeDevicesError, Supervisor
from asyncrl.runtime.cluster import auth
from asyncrl.runtime.net import reachable_address
from conftest import command_line, kill_all, process_alive, wait_until
from multinode_support import NODE_TIMEOUT_S, agent_log, env, free_port, launch_argv, make_secret_file, start_agent


@pytest.fixture
def secret(tmp_path, monkeypatch):
    path = make_secret_file(str(tmp_path))
    monkeypatch.setenv(auth.ENV_SECRET_FILE, path)
    return path


def _cluster_supervisor(nnodes: int, port: int, **overrides) -> Supervisor:
    options = dict(
        nnodes=nnodes, master_port=port, node_timeout_s=NODE_TIMEOUT_S, join_timeout_s=60.0, call_timeout_s=30.0
    )
    return Supervisor(**{**options, **overrides})


async def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> int | None:
    return await asyncio.to_thread(lambda: _wait(proc, timeout_s))


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


async def test_two_nodes_placement_calls_logs_and_clean_stop(secret, tmp_path, capfd):
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path), ASYNCRL_SUP_DEVICE_KIND="cuda", CUDA_VISIBLE_DEVICES="4,5")
    try:
        async with _cluster_supervisor(2, port) as sup:
            assert [(n.rank, n.devices_total, n.state) for n in sup.nodes()] == [(0, 0, "joined"), (1, 2, "joined")]
            assert [n.cores for n in sup.nodes()] == [len(os.sched_getaffinity(0))] * 2  # the agent's, as it said
            local = await sup.spawn(Echo, name="local")
            remote = await sup.spawn(Echo, name="remote", node=1, env={"MY_SETTING": "x"})
            gpu = await sup.spawn(Echo, name="gpu", gpus=1)  # node 0 has no device: placed on node 1
            assert [s.node for s in sup.status()] == [0, 1, 1]
            assert await gpu.env("CUDA_VISIBLE_DEVICES") == "4"
            assert await remote.env("CUDA_VISIBLE_DEVICES") == ""
            assert await remote.env("MY_SETTING") == "x"
            assert (await remote.env("ASYNCRL_NODE_ADDR"), await remote.env("ASYNCRL_NODE_RANK")) == ("127.0.0.1", "1")
            assert await local.env("ASYNCRL_NODE_RANK") == "0"
            assert await remote.add(2) == 3 and await local.add(await remote.add(1)) == 3
            assert remote._record.client.address.startswith("tcp://127.0.0.1:")
            results = await asyncio.gather(*(h.add(i) for i in range(20) for h in (local, remote, gpu)))
            assert results == [i + 1 for i in range(20) for _ in range(3)]
            with pytest.raises(NoFreeDevicesError, match="node 1: 1 of 2"):
                await sup.spawn(Echo, gpus=2)
            await remote.say("hello from node 1")

            # a restart happens on the actor's node, with its devices
            again = await sup.spawn(Echo, name="again", node=1, gpus=1, max_restarts=1)
            old_pid = await again.getpid()
            os.kill(old_pid, signal.SIGKILL)
            assert await asyncio.to_thread(wait_until, lambda: again.info().incarnation == 2, 10.0)
            assert await again.add(1) == 2 and await again.getpid() != old_pid
            assert await again.env("CUDA_VISIBLE_DEVICES") == "5" and again.info().node == 1
            remote_pids = [await remote.getpid(), await gpu.getpid(), await again.getpid()]
        assert await _wait_exit(agent, 15.0) == 0, agent_log(str(tmp_path), 1)
        assert not any(process_alive(p) for p in remote_pids)
    finally:
        kill_all([agent.pid])
        agent.wait()
    out = capfd.readouterr().out
    assert "[remote]: hello from node 1" in out  # forwarded by the agent, printed by node 0


async def test_kill_of_an_actor_on_another_node_goes_through_its_agent_and_restarts_it_there(secret, tmp_path):
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path))
    try:
        async with _cluster_supervisor(2, port) as sup:
            remote = await sup.spawn(Echo, name="remote", node=1, max_restarts=1)
            pid, grandchild = await remote.getpid(), await remote.spawn_grandchild()
            pending = asyncio.ensure_future(remote.sleep(60))
            await asyncio.sleep(0)  # one turn of the loop: the task sends the call, then waits for its reply
            start = time.monotonic()
            assert remote.kill("judged lost by its owner", incarnation=1) is True
            with pytest.raises(ActorDiedError, match="killed on request: judged lost by its owner"):
                await pending
            assert time.monotonic() - start < 3.0
            back = await remote.wait_for_incarnation(1, timeout_s=30.0)
            assert (back.state, back.incarnation, back.node) == ("running", 2, 1)
            assert remote.kill("a late verdict", incarnation=1) is False
            assert await remote.getpid() != pid
            assert await asyncio.to_thread(
                wait_until, lambda: not process_alive(pid) and not process_alive(grandchild), 5.0
            )
        assert await _wait_exit(agent, 15.0) == 0, agent_log(str(tmp_path), 1)
    finally:
        kill_all([agent.pid])
        agent.wait()


async def test_a_start_phase_on_another_node_moves_the_deadline_through_its_agent(secret, tmp_path):
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path))
    try:
        async with _cluster_supervisor(2, port, start_timeout_s=1.5) as sup:
            slow = await sup.spawn(PhasedStart, 3.0, 10.0, name="slow", node=1)
            assert (slow.info().node, await slow.getpid() > 0) == (1, True)
            with pytest.raises(ActorStartError, match=r"^actor 'unsaid': not ready within start_timeout_s=1\.5"):
                await sup.spawn(PhasedStart, 3.0, name="unsaid", node=1)
        assert await _wait_exit(agent, 15.0) == 0, agent_log(str(tmp_path), 1)
    finally:
        kill_all([agent.pid])
        agent.wait()


async def test_three_nodes_actor_death_agent_death_and_survivors(secret, tmp_path):
    port = free_port()
    agents = [start_agent(r, 3, port, secret, str(tmp_path)) for r in (1, 2)]
    try:
        async with _cluster_supervisor(3, port) as sup:
            a0, a1, a2 = await asyncio.gather(*(sup.spawn(Echo, name=f"a{r}", node=r) for r in range(3)))
            assert [await a.add(r) for r, a in enumerate((a0, a1, a2))] == [1, 2, 3]

            # an actor killed on node 1: its pending call fails at once, reported by the agent
            pending = asyncio.ensure_future(a1.sleep(60))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            os.kill(await a1.with_timeout(10).getpid(), signal.SIGKILL)
            with pytest.raises(ActorDiedError, match="killed by SIGKILL on node 1"):
                await pending
            assert time.monotonic() - start < 3.0

            # node 2's agent killed: its actors are dead within the node timeout, and gone
            pid2, grandchild = await a2.getpid(), await a2.spawn_grandchild()
            pending = asyncio.ensure_future(a2.sleep(60))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            agents[1].send_signal(signal.SIGKILL)
            with pytest.raises(ActorDiedError, match="node 2 .* lost"):
                await pending
            assert time.monotonic() - start < NODE_TIMEOUT_S + 4.0
            assert await asyncio.to_thread(
                wait_until, lambda: not process_alive(pid2) and not process_alive(grandchild), 5.0
            )
            assert sup.nodes()[2].state.startswith("lost")
            with pytest.raises(ActorDiedError):
                await a2.add(1)
            with pytest.raises(ActorStartError, match="node 2 is lost"):
                await sup.spawn(Echo, node=2)

            # the rest of the cluster keeps serving
            assert await a0.add(1) == 2
            b1 = await sup.spawn(Echo, name="b1", node=1)
            assert await b1.add(5) == 6
            remote_pid = await b1.getpid()
        assert await _wait_exit(agents[0], 15.0) == 0, agent_log(str(tmp_path), 1)
        assert not process_alive(remote_pid)
    finally:
        kill_all([a.pid for a in agents])
        for a in agents:
            a.wait()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _zygote_of(agent_pid: int, actor_pid: int) -> int:
    """The zygote that forked ``actor_pid``: the agent's child, titled as a zygote (asserted)."""
    zygote = _parent(actor_pid)
    assert command_line(zygote).startswith("asyncrl: zygote"), (zygote, command_line(zygote))
    assert _parent(zygote) == agent_pid, (zygote, agent_pid)
    return zygote


async def test_agents_fork_their_actors_from_a_zygote_when_the_supervisor_has_one(secret, tmp_path, capfd):
    """The supervisor's ``zygote_preload`` reaches its agents (`NodeWelcome`): each starts a zygote
    of its own once joined and forks its actors from it, a restart too; their output still comes
    through the agent. A clean stop ends the zygote with the agent; an agent SIGKILLed takes its
    zygote and every process its actors started with it."""
    port = free_port()
    agents = [start_agent(r, 3, port, secret, str(tmp_path)) for r in (1, 2)]
    try:
        async with _cluster_supervisor(3, port, zygote_preload="asyncrl.runtime.worker") as sup:
            a1, a2 = await asyncio.gather(
                sup.spawn(Echo, name="a1", node=1, max_restarts=1), sup.spawn(Echo, name="a2", node=2)
            )
            pid1, pid2 = await a1.getpid(), await a2.getpid()
            zygote1, zygote2 = _zygote_of(agents[0].pid, pid1), _zygote_of(agents[1].pid, pid2)
            assert await a1.add(1) == 2 and await a2.add(2) == 3
            await a1.say("hello from a forked actor")

            os.kill(pid1, signal.SIGKILL)  # restarted on node 1, by its zygote again
            back = await a1.wait_for_incarnation(1, timeout_s=30.0)
            assert (back.state, back.incarnation, back.node) == ("running", 2, 1)
            pid1 = await a1.getpid()
            assert _zygote_of(agents[0].pid, pid1) == zygote1

            grandchild = await a2.spawn_grandchild()
            agents[1].send_signal(signal.SIGKILL)
            gone = [pid2, grandchild, zygote2]
            assert await asyncio.to_thread(wait_until, lambda: not any(process_alive(p) for p in gone), 10.0), [
                p for p in gone if process_alive(p)
            ]
            assert await a1.add(5) == 6
        assert await _wait_exit(agents[0], 15.0) == 0, agent_log(str(tmp_path), 1)
        assert not process_alive(pid1) and not process_alive(zygote1)
        for rank in (1, 2):
            assert "Popen" not in agent_log(str(tmp_path), rank), agent_log(str(tmp_path), rank)
    finally:
        kill_all([a.pid for a in agents])
        for a in agents:
            a.wait()
    assert "[a1]: hello from a forked actor" in capfd.readouterr().out  # forwarded by the agent


async def test_sigterm_to_an_agent_stops_its_actors_and_reports_them_at_once(secret, tmp_path):
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path))
    try:
        async with _cluster_supervisor(2, port) as sup:
            echo = await sup.spawn(Echo, node=1)
            pid = await echo.getpid()
            pending = asyncio.ensure_future(echo.sleep(60))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            with pytest.raises(ActorDiedError, match="node 1"):
                await pending
            assert time.monotonic() - start < NODE_TIMEOUT_S  # said so, not found out by silence
            assert await _wait_exit(agent, 15.0) == 128 + signal.SIGTERM
            assert not process_alive(pid)
            assert "its agent left (received SIGTERM)" in sup.nodes()[1].state
    finally:
        kill_all([agent.pid])
        agent.wait()


async def test_a_node_leaving_an_elastic_cluster_drains_before_its_actors_are_stopped(secret, tmp_path):
    # --nnodes 1:2 on both sides: told to stop, the agent says it is leaving, its actors keep
    # serving until their owner stops them (a GRPO run drains its samplers there), the node
    # takes no new actor meanwhile, and the agent leaves as soon as none is left.
    port = free_port()
    agent = start_agent(1, "1:2", port, secret, str(tmp_path), ASYNCRL_SUP_DRAIN_TIMEOUT_S="60")
    try:
        async with _cluster_supervisor(2, port, min_nnodes=1) as sup:
            assert await asyncio.to_thread(wait_until, lambda: len(sup.nodes()) == 2, 30.0), agent_log(str(tmp_path), 1)
            echo = await sup.spawn(Echo, name="leaving", node=1)
            pid = await echo.getpid()
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(wait_until, lambda: sup.nodes()[1].state.startswith("draining"), 10.0)
            assert sup.nodes()[1].state == "draining: received SIGTERM"
            assert await echo.add(1) == 2 and process_alive(pid)  # still serving: its owner decides
            with pytest.raises(ActorStartError, match="node 1 is leaving"):
                await sup.spawn(Echo, node=1)
            assert await _wait_exit(agent, 1.0) is None  # waits for its actor, not for a deadline
            start = time.monotonic()
            await sup.stop(echo)  # the owner's stop: graceful, as a drained sampler's
            assert await _wait_exit(agent, 15.0) == 128 + signal.SIGTERM
            assert time.monotonic() - start < 15.0 and not process_alive(pid)
            assert "its agent left (received SIGTERM)" in sup.nodes()[1].state
            assert str(echo.info().state) == "stopped"  # stopped, never counted dead
        assert "leaving once the 1 actor(s) here are stopped" in agent_log(str(tmp_path), 1)
    finally:
        kill_all([agent.pid])
        agent.wait()


def test_supervisor_sigkill_takes_every_node_down(secret, tmp_path):
    port = free_port()
    agents = [start_agent(r, 3, port, secret, str(tmp_path)) for r in (1, 2)]
    driver = subprocess.Popen(
        launch_argv(0, 3, port, secret), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    info = {"pids": []}
    try:
        line = driver.stdout.readline()
        assert line.startswith("{"), driver.stderr.read() if driver.poll() is not None else line
        info = json.loads(line)
        assert info["nodes"] == [0, 1, 2] and all(process_alive(p) for p in info["pids"])
        driver.send_signal(signal.SIGKILL)
        driver.wait(5)
        deadline_s = NODE_TIMEOUT_S + 10.0  # the agents' grace, then SIGTERM -> SIGKILL of their actors
        for rank, agent in enumerate(agents, 1):
            assert _wait(agent, deadline_s) == 1, agent_log(str(tmp_path), rank)
            assert "unreachable" in agent_log(str(tmp_path), rank)
        assert wait_until(lambda: not any(process_alive(p) for p in info["pids"]), 5.0), "orphans survived"
    finally:
        kill_all([driver.pid, *[a.pid for a in agents], *info["pids"]])
        driver.communicate(timeout=5)
        for a in agents:
            a.wait()


async def test_start_up_names_the_missing_node_and_releases_the_others(secret, tmp_path):
    port = free_port()
    agent = start_agent(1, 3, port, secret, str(tmp_path))
    try:
        start = time.monotonic()
        with pytest.raises(
            ClusterStartError, match=r"node\(s\) 2 of 3 did not join .* within 3 s \(joined: 0, 1\)"
        ) as info:
            async with _cluster_supervisor(3, port, join_timeout_s=3.0):
                pass
        assert info.value.missing == [2]
        assert time.monotonic() - start < 15.0
        assert await _wait_exit(agent, 15.0) == 0, agent_log(str(tmp_path), 1)  # told to stop, not left waiting
    finally:
        kill_all([agent.pid])
        agent.wait()


async def test_an_elastic_cluster_starts_with_min_nodes_and_takes_a_node_that_joins_later(secret, tmp_path):
    port = free_port()
    agents = [start_agent(1, 3, port, secret, str(tmp_path))]
    try:
        async with _cluster_supervisor(3, port, min_nnodes=2) as sup:  # --nnodes 2:3
            assert [(n.rank, n.state) for n in sup.nodes()] == [(0, "joined"), (1, "joined")]
            with pytest.raises(ActorStartError, match="node 2 has not joined the cluster"):
                await sup.spawn(Echo, node=2)
            agents.append(start_agent(2, 3, port, secret, str(tmp_path)))
            assert await asyncio.to_thread(wait_until, lambda: len(sup.nodes()) == 3, 30.0), agent_log(str(tmp_path), 2)
            late = await sup.spawn(Echo, name="late", node=2)
            assert await late.env("ASYNCRL_NODE_RANK") == "2" and await late.add(1) == 2
        for agent in agents:
            assert await _wait_exit(agent, 15.0) == 0, agent_log(str(tmp_path), agents.index(agent) + 1)
    finally:
        kill_all([a.pid for a in agents])
        for a in agents:
            a.wait()


async def test_an_elastic_cluster_of_at_least_one_node_starts_with_node_0_alone(secret):
    # --nnodes 1:2: nothing to wait for (it waited for a join that never came, then failed)
    started = time.monotonic()
    async with _cluster_supervisor(2, free_port(), min_nnodes=1, join_timeout_s=5.0) as sup:
        assert [(n.rank, n.state) for n in sup.nodes()] == [(0, "joined")]
    assert time.monotonic() - started < 5.0


async def test_an_elastic_cluster_names_how_many_nodes_it_still_needs(secret, tmp_path):
    port = free_port()
    with pytest.raises(
        ClusterStartError,
        match=r"1 of the 2 nodes needed \(--nnodes 2:3\) joined .* within 2 s "
        r"\(joined: 0\); .* with R in 1, 2 on 1 more node\(s\)$",
    ):
        async with _cluster_supervisor(3, port, min_nnodes=2, join_timeout_s=2.0):
            pass


def test_an_agent_without_a_supervisor_gives_up_in_time(secret, tmp_path):
    agent = start_agent(1, 2, free_port(), secret, str(tmp_path), join_timeout_s=1.5)
    try:
        assert _wait(agent, 20.0) == 1
        assert "no supervisor admitted us" in agent_log(str(tmp_path), 1)
    finally:
        kill_all([agent.pid])
        agent.wait()


async def test_a_second_agent_for_a_taken_rank_is_refused(secret, tmp_path):
    port = free_port()
    first = start_agent(1, 2, port, secret, str(tmp_path))
    second = None
    try:
        async with _cluster_supervisor(2, port) as sup:
            second = start_agent(1, 2, port, secret, str(tmp_path), join_timeout_s=20.0)  # logs to the same file
            assert await _wait_exit(second, 20.0) == 1
            assert "already taken" in agent_log(str(tmp_path), 1)
            echo = await sup.spawn(Echo, node=1)
            assert await echo.add(1) == 2
    finally:
        kill_all([first.pid] + ([second.pid] if second else []))
        for a in (first, second):
            if a is not None:
                a.wait()


@pytest.mark.parametrize(
    "args, text",
    [
        (["--nnodes", "2"], "needs a cluster secret"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in 0..1"),
        (["--nnodes", "2", "--master-addr", "0.0.0.0"], "not an address the nodes can reach"),
        (["--master-port", "70000"], "--master-port must be in 1..65535"),
        (["--nproc-per-node", "many"], "--nproc-per-node"),
        (["--nnodes", "3:2"], "an elastic range MIN:MAX needs 1 <= MIN <= MAX"),
        (["--nnodes", "1:x"], "--nnodes: --nnodes='1:x' is neither an integer nor a range MIN:MAX"),
    ],
)
def test_launch_node_usage_errors(args, text):
    argv = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        *args,
        os.path.join(os.path.dirname(__file__), "scripts", "modes.py"),
    ]
    out = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and text in out.stderr, out.stderr


def test_a_hello_with_or_without_its_cores_is_read_by_either_side():
    """``NodeHello.cores`` is a trailing default: an older agent's hello (without it) reads as 0
    cores, and a newer agent's is read by an older supervisor, which leaves the field."""
    import msgspec

    from asyncrl.runtime import wire

    class OlderHello(msgspec.Struct, tag_field="t", tag=30, array_like=True, frozen=True):
        protocol: int
        rank: int
        nnodes: int
        agent_id: str
        hostname: str
        address: str
        pid: int
        device_kind: str
        devices: list[str]

    fields = (wire.NODE_PROTOCOL, 1, 2, "a1", "host", "10.0.0.2", 7, "", [])
    from_older = msgspec.msgpack.decode(msgspec.msgpack.encode(OlderHello(*fields)), type=wire.FromNode)
    assert from_older == wire.NodeHello(*fields) and from_older.cores == 0
    newer = msgspec.msgpack.encode(wire.NodeHello(*fields, 16))
    assert msgspec.msgpack.decode(newer, type=wire.FromNode).cores == 16
    assert msgspec.msgpack.decode(newer, type=OlderHello) == OlderHello(*fields)


def test_a_welcome_with_or_without_the_zygote_preload_is_read_by_either_side():
    """``NodeWelcome.zygote_preload`` is a trailing default: an older supervisor's welcome reads as
    no zygote (the agent starts by Popen), and an older agent reads a newer welcome."""
    import msgspec

    from asyncrl.runtime import wire

    class OlderWelcome(msgspec.Struct, tag_field="t", tag=40, array_like=True, frozen=True):
        heartbeat_interval_s: float
        node_timeout_s: float

    from_older = msgspec.msgpack.decode(msgspec.msgpack.encode(OlderWelcome(1.0, 5.0)), type=wire.ToAgent)
    assert from_older == wire.NodeWelcome(1.0, 5.0) and from_older.zygote_preload == ""
    newer = msgspec.msgpack.encode(wire.NodeWelcome(1.0, 5.0, "torch"))
    assert msgspec.msgpack.decode(newer, type=wire.ToAgent).zygote_preload == "torch"
    assert msgspec.msgpack.decode(newer, type=OlderWelcome) == OlderWelcome(1.0, 5.0)


def test_node_settings_precedence_torchrun_and_slurm():
    from asyncrl.nodes import first_slurm_host, resolve

    assert first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_slurm_host("a-1,b") == "a-1"
    assert first_slurm_host("n[3]x") == "n3x"
    slurm = {"SLURM_JOB_ID": "9", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]"}
    s = resolve(slurm)
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port) == (4, 2, "gpu07", 29500)
    s = resolve({**slurm, "MASTER_ADDR": "10.0.0.1", "PET_NODE_RANK": "3", "MASTER_PORT": "1234"}, nnodes="4")
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port) == (4, 3, "10.0.0.1", 1234)
    assert resolve({}, node_rank="0", nproc_per_node="gpu").nproc_per_node == 0
    assert resolve({"PET_NPROC_PER_NODE": "2"}).nproc_per_node == 2
    s = resolve({"PET_NNODES": "2:4"})  # torchrun's elastic range
    assert (s.min_nnodes, s.nnodes) == (2, 4)
    assert (resolve({}, nnodes="3").min_nnodes, resolve({}, nnodes="3:3").min_nnodes) == (0, 0)


def test_reachable_address():
    assert reachable_address("127.0.0.1") == "127.0.0.1"
    assert reachable_address("localhost") in ("127.0.0.1", "::1")
    with pytest.raises(OSError, match="cannot resolve peer host"):
        reachable_address("no-such-host.invalid")
