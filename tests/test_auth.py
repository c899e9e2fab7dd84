"""Authentication: peers without the cluster secret get nothing through, are counted and logged,
and the cluster keeps serving. Real sockets, a real node agent, real actor processes."""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec
import pytest
import zmq

from asyncrl import Supervisor
from asyncrl.runtime import wire
from asyncrl.runtime.cluster import auth
from conftest import kill_all
from multinode_support import NODE_TIMEOUT_S, Counter, free_port, intruder, make_secret_file, start_agent

HOWS = ("none", "wrong-secret", "foreign-key")


def _valid_looking_messages() -> list[bytes]:
    """Messages that would do something if they got through: a call, a worker hello, a node join."""
    args = msgspec.Raw(msgspec.msgpack.encode([1000]))
    return [
        msgspec.msgpack.encode(m)
        for m in (
            wire.Call(1, "bump", args),
            wire.Hello("counter", 1, 1),
            wire.NodeHello(wire.NODE_PROTOCOL, 1, 2, "intruder", "evil", "127.0.0.1", 1, "", []),
        )
    ]


def _try_all(endpoints: list[str], public_key: bytes, wait_s: float = 1.0) -> int:
    """Every kind of intruder sends every message to every endpoint; returns replies received."""
    ctx = zmq.Context()
    socks = []
    try:
        for endpoint in endpoints:
            for how in HOWS:
                sock = intruder(ctx, endpoint, how, public_key)
                for body in _valid_looking_messages():
                    try:
                        sock.send(body, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # not connected: queued nowhere, which is the point
                socks.append(sock)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        return len(poller.poll(wait_s * 1000))
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


async def test_intruders_get_nothing_through_a_cluster_and_it_keeps_serving(tmp_path, monkeypatch, caplog, capfd):
    secret = make_secret_file(str(tmp_path))
    monkeypatch.setenv(auth.ENV_SECRET_FILE, secret)
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl.auth"):
            async with Supervisor(nnodes=2, master_port=port, node_timeout_s=NODE_TIMEOUT_S, join_timeout_s=60) as sup:
                counter = await sup.spawn(Counter, name="counter", node=1)
                keys = sup._resources.keys
                targets = [sup._cluster.address, counter._record.client.address]
                assert await asyncio.to_thread(_try_all, targets, keys.public_key) == 0
                assert sup.auth_rejections >= len(HOWS)  # at the cluster socket, counted here
                assert await counter.count() == 0  # no call got through
                assert await counter.bump() == 1  # and the cluster serves as before
                assert [n.state for n in sup.nodes()] == ["joined", "joined"]
    finally:
        kill_all([agent.pid])
        agent.wait()
    assert any("refused" in r.getMessage() for r in caplog.records)
    assert any("not the cluster's" in r.getMessage() for r in caplog.records)  # the allow-list said no
    # the actor on node 1 logged its own refusals; its agent forwarded them to node 0
    assert "[counter]: " in capfd.readouterr().err


async def test_single_host_tcp_generates_a_secret_and_refuses_outsiders(monkeypatch):
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    async with Supervisor(transport="tcp") as sup:
        counter = await sup.spawn(Counter)
        targets = [sup.address, counter._record.client.address]
        assert await asyncio.to_thread(_try_all, targets, sup._resources.keys.public_key) == 0
        assert sup.auth_rejections >= len(HOWS)
        assert await counter.count() == 0
        assert await counter.bump(2) == 2
    assert auth.ENV_SECRET not in os.environ  # generated for the children, not published


def test_secret_sources_and_checks(tmp_path):
    path = str(tmp_path / "s")
    auth.write_secret(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        auth.write_secret(path)
    text = auth.load_secret({auth.ENV_SECRET_FILE: path})
    assert len(text) == 64 and auth.load_secret({auth.ENV_SECRET: text, auth.ENV_SECRET_FILE: "/nonexistent"}) == text
    assert auth.load_secret({}) is None
    with pytest.raises(ValueError, match="at least 32"):
        auth.load_secret({auth.ENV_SECRET: "short"})
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_secret({auth.ENV_SECRET_FILE: str(tmp_path / "missing")})
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        auth.load_secret({auth.ENV_SECRET_FILE: path})
    a, b = auth.ClusterKeys.from_secret(text), auth.ClusterKeys.from_secret(text)
    assert a == b and a.public_key != auth.ClusterKeys.from_secret(auth.new_secret()).public_key
    assert text not in repr(a) and a.secret_key.decode() not in repr(a)


def test_tcp_without_keys_is_refused():
    from asyncrl.runtime.transport import bind_router, connect_dealer

    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="without authentication"):
            bind_router(ctx, "tcp://127.0.0.1:*")
        with pytest.raises(ValueError, match="without authentication"):
            connect_dealer(ctx, "tcp://127.0.0.1:1")
    finally:
        ctx.term()
