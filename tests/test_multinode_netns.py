"""The cluster across network namespaces joined by veth pairs, so every node has an address of its
own, as distinct hosts would. The namespaces are made here and removed afterwards; where that is
not permitted (not root, no `ip`, no CAP_NET_ADMIN) the test is skipped and says why."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from actors import Echo
from asyncrl import ActorDiedError, Supervisor
from asyncrl.runtime.cluster import auth
from conftest import kill_all, process_alive, wait_until
from multinode_support import (
    NODE_TIMEOUT_S,
    agent_log,
    free_port,
    ip,
    make_secret_file,
    netns_argv,
    rate_bytes,
    start_agent,
    veth_namespaces,
)


@pytest.fixture
def namespaces():
    """Two namespaces, each linked to this one by a veth pair on its own /24. Yields
    ``[(namespace, host-side address, namespace-side address), ...]``."""
    with veth_namespaces(2) as made:
        yield made


async def test_three_hosts_over_veth(namespaces, tmp_path, monkeypatch):
    (ns1, master, addr1), (ns2, _, addr2) = namespaces
    secret = make_secret_file(str(tmp_path))
    monkeypatch.setenv(auth.ENV_SECRET_FILE, secret)
    port = free_port(master)
    agents = [start_agent(r, 3, port, secret, str(tmp_path), master=master, netns=ns) for r, ns in ((1, ns1), (2, ns2))]
    try:
        async with Supervisor(
            nnodes=3,
            master_addr=master,
            master_port=port,
            node_timeout_s=NODE_TIMEOUT_S,
            join_timeout_s=60,
            call_timeout_s=30,
        ) as sup:
            assert [n.address for n in sup.nodes()] == [master, addr1, addr2]
            # the cluster socket listens on the master address only, not on every interface
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            a0, a1, a2 = await asyncio.gather(*(sup.spawn(Echo, name=f"a{r}", node=r) for r in range(3)))
            assert a1._record.client.address.startswith(f"tcp://{addr1}:")
            assert a2._record.client.address.startswith(f"tcp://{addr2}:")
            # each actor learns the address its peers reach its node at (for a TCPStore, say)
            assert [await a.env("ASYNCRL_NODE_ADDR") for a in (a0, a1, a2)] == [master, addr1, addr2]
            assert [await a.add(r) for r, a in enumerate((a0, a1, a2))] == [1, 2, 3]

            pending = asyncio.ensure_future(a1.sleep(60))
            await asyncio.sleep(0.2)
            os.kill(await a1.with_timeout(10).getpid(), signal.SIGKILL)  # pids are shared: one kernel
            with pytest.raises(ActorDiedError, match="killed by SIGKILL on node 1"):
                await pending

            pid2 = await a2.getpid()
            pending = asyncio.ensure_future(a2.sleep(60))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            agents[1].send_signal(signal.SIGKILL)
            with pytest.raises(ActorDiedError, match="node 2 .* lost"):
                await pending
            assert time.monotonic() - start < NODE_TIMEOUT_S + 4.0
            assert await asyncio.to_thread(wait_until, lambda: not process_alive(pid2), 5.0)
            assert await a0.add(1) == 2
        assert agents[0].wait(15) == 0, agent_log(str(tmp_path), 1)
    finally:
        kill_all([a.pid for a in agents])
        for a in agents:
            a.wait()


async def test_a_partitioned_node_is_lost_and_its_agent_stops_by_itself(namespaces, tmp_path, monkeypatch):
    """No FIN, no RST: the link just goes dark. Node 0 must call the node lost on silence, and the
    agent must notice the silence too (ZeroMQ heartbeats) and stop its actors."""
    (ns1, master, _), _ = namespaces
    secret = make_secret_file(str(tmp_path))
    monkeypatch.setenv(auth.ENV_SECRET_FILE, secret)
    port = free_port(master)
    agent = start_agent(1, 2, port, secret, str(tmp_path), master=master, netns=ns1)
    try:
        async with Supervisor(
            nnodes=2,
            master_addr=master,
            master_port=port,
            node_timeout_s=NODE_TIMEOUT_S,
            join_timeout_s=60,
            call_timeout_s=30,
        ) as sup:
            echo = await sup.spawn(Echo, node=1)
            pid = await echo.getpid()
            pending = asyncio.ensure_future(echo.sleep(60))
            await asyncio.sleep(0.2)
            host_if = f"ar{os.getpid() % 100000}h1"
            assert ip("link", "set", host_if, "down").returncode == 0
            start = time.monotonic()
            with pytest.raises(ActorDiedError, match="node 1 .* lost: no heartbeat"):
                await pending
            assert time.monotonic() - start < NODE_TIMEOUT_S + 4.0
            # the agent, cut off, gives up on its own and takes its actor with it
            assert await asyncio.to_thread(agent.wait, 2 * NODE_TIMEOUT_S + 15) == 1, agent_log(str(tmp_path), 1)
            assert "unreachable" in agent_log(str(tmp_path), 1)
            assert not process_alive(pid)
    finally:
        kill_all([agent.pid])
        agent.wait()


RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = server.accept()
received = 0
while chunk := conn.recv(1 << 16):
    received += len(chunk)
print(received, flush=True)
"""


def test_a_rate_limited_link_carries_no_more_than_its_rate():
    """`veth_namespaces(rate=...)` (what benchmarks/slow_link.py and grpo_slow_link.py stand on):
    4 MB over a 40 Mbit/s link take at least 0.8 s (5 MB/s), whatever the machine's speed."""
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        rate_bytes("40mb")
    with veth_namespaces(1, rate="40mbit") as ((ns, _, inside),):
        port = free_port("127.0.0.1")
        receiver = subprocess.Popen(
            netns_argv(ns, [sys.executable, "-c", RECEIVE, inside, str(port)]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert receiver.stdout.readline() == "listening\n"
            total = 4_000_000
            start = time.monotonic()
            with socket.create_connection((inside, port), timeout=30) as conn:
                conn.sendall(b"x" * total)
                conn.shutdown(socket.SHUT_WR)
                assert int(receiver.stdout.readline()) == total
            seconds = time.monotonic() - start
        finally:
            receiver.kill()
            receiver.wait(10)
    assert seconds >= 0.8 * total / rate_bytes("40mbit"), seconds
