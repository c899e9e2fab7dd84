"""Fuzz every listening socket of a two-node cluster for a bounded time: raw random bytes, ZMTP
greetings followed by junk, and random valid-looking messages, from outsiders (no secret, wrong
secret) and, for the decoders behind the TCP sockets, from an insider holding the right keys.
Afterwards: nothing crashed, nothing hangs, no call was executed, and everything still serves."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import msgspec
import zmq

from asyncrl import Supervisor
from asyncrl.runtime import wire
from asyncrl.runtime.actor import endpoints_of
from asyncrl.runtime.cluster import auth
from conftest import kill_all, process_alive
from multinode_support import NODE_TIMEOUT_S, Counter, free_port, intruder, make_secret_file, start_agent

SECONDS_PER_TARGET = 1.0
SEED = int(os.environ.get("ASYNCRL_FUZZ_SEED", "0")) or random.randrange(1 << 30)


def _text(rng: random.Random) -> str:
    return "".join(rng.choice("abcxyz-_.0é\x00") for _ in range(rng.randrange(0, 12)))


_COUNTER_ENDPOINTS = endpoints_of(Counter)
_TO_ACTOR = msgspec.msgpack.Decoder(wire.ToActor)


def _runs_a_call(frames: list[bytes]) -> bool:
    """Whether an actor that admits the sender would run these frames as a call of Counter: what
    the actor's server checks, the same decoders. A flipped bit can make a valid call out of a
    refused one (``bump(["not an int"])`` became ``bump(-22)``); a peer the socket admits (any
    process of ours on an ipc socket, an insider on TCP) is then rightly obeyed, so such frames
    are not fuzz and are not sent: "no fuzzed call was executed" holds for every seed."""
    try:
        msg = _TO_ACTOR.decode(frames[0])
        if type(msg) is not wire.Call or msg.method not in _COUNTER_ENDPOINTS:
            return False
        _COUNTER_ENDPOINTS[msg.method].arg_decoder.decode(msg.args, frames)
    except Exception:  # refused by the actor, whatever the reason
        return False
    return True


def _message(rng: random.Random, bump_allowed: bool) -> bytes:
    """A well-formed envelope of a random type with random fields; a valid call to ``bump`` only
    where the sender must be refused anyway (``bump_allowed``)."""
    name, n = _text(rng), rng.randrange(-5, 1 << 40)
    raw = msgspec.Raw(msgspec.msgpack.encode(rng.choice([[1], ["x"], [], [None, 2], {"a": 1}])))
    call_method = "bump" if bump_allowed and rng.random() < 0.5 else rng.choice(["nope", "_private", "count_", name])
    candidates = [
        wire.Call(n, call_method, raw),
        wire.Call(n, "bump", msgspec.Raw(msgspec.msgpack.encode(["not an int"]))),
        wire.Cancel(n),
        wire.StreamCredit(n, n),
        wire.Hello(rng.choice(["counter-local", "counter-remote", name]), rng.randrange(3), n),
        wire.Ready(name, 1, f"tcp://127.0.0.1:{rng.randrange(1, 65535)}"),
        wire.StartFailed(name, 1, "X", "y"),
        wire.Heartbeat(name, 1),
        wire.Dead(name, 1, "r"),
        wire.NodeHello(
            wire.NODE_PROTOCOL, rng.randrange(-1, 4), rng.randrange(0, 4), name, name, "127.0.0.1", n, "cuda", [name]
        ),
        wire.NodeHeartbeat(1, name),
        wire.ActorStarted(name, 1, n),
        wire.ActorExited("counter-remote", 1, "fuzz"),
        wire.ActorLog(name, 1, 1, [name]),
        wire.NodeLeaving(1, name, "fuzz"),
        wire.NodeDraining(1, name, "fuzz", 1.0),
    ]
    body = msgspec.msgpack.encode(rng.choice(candidates))
    if rng.random() < 0.3:  # truncated or bit-flipped
        cut = bytearray(body[: rng.randrange(1, len(body) + 1)])
        if cut:
            cut[rng.randrange(len(cut))] ^= 1 << rng.randrange(8)
        body = bytes(cut)
    return body


def _greeting(rng: random.Random) -> bytes:
    mechanism = rng.choice([b"NULL", b"CURVE", b"PLAIN", os.urandom(4)]).ljust(20, b"\x00")
    head = (
        b"\xff" + bytes(8) + b"\x7f" + bytes([3, rng.randrange(2)]) + mechanism + bytes([rng.randrange(2)]) + bytes(31)
    )
    frames = b"".join(
        bytes([rng.choice([0, 1, 2, 4])]) + bytes([n := rng.randrange(256)]) + os.urandom(n)
        for _ in range(rng.randrange(4))
    )
    return head + frames


def _raw_stream(endpoint: str, rng: random.Random) -> None:
    if endpoint.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = endpoint[len("ipc://") :]
    else:
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        s, address = socket.socket(), (host, int(port))
    s.settimeout(0.3)
    try:
        s.connect(address)
        payload = _greeting(rng) if rng.random() < 0.5 else os.urandom(rng.randrange(0, 4096))
        s.sendall(payload)
        if rng.random() < 0.3:
            s.recv(256)
    except OSError:
        pass
    finally:
        s.close()


def _fuzz(endpoint: str, public_key: bytes | None, insider_keys: auth.ClusterKeys | None, seed: int) -> int:
    """Fuzz one endpoint for SECONDS_PER_TARGET; returns how many replies outsiders received."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    outsiders, insider, replies = [], None, 0
    try:
        hows = ["none", "wrong-secret"] if endpoint.startswith("tcp://") else ["none"]
        outsiders = [intruder(ctx, endpoint, how, public_key) for how in hows]
        if insider_keys is not None:
            insider = ctx.socket(zmq.DEALER)
            insider.linger = 0
            insider_keys.secure_client(insider)
            insider.connect(endpoint)
        deadline = time.monotonic() + SECONDS_PER_TARGET
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.3:
                _raw_stream(endpoint, rng)
                continue
            bump_allowed = endpoint.startswith("tcp://")  # outsiders over TCP are refused anyway
            frames = [
                _message(rng, bump_allowed) if rng.random() < 0.7 else os.urandom(rng.randrange(64))
                for _ in range(rng.randrange(1, 4))
            ]
            if not bump_allowed and _runs_a_call(frames):
                continue  # an ipc socket admits us: a valid call would run (see _runs_a_call)
            for sock in outsiders:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            if insider is not None:  # an authenticated peer sending junk: decoders must hold
                frames = [
                    _message(rng, False) if rng.random() < 0.7 else os.urandom(rng.randrange(64))
                    for _ in range(rng.randrange(1, 4))
                ]
                try:
                    if not _runs_a_call(frames):  # an insider's valid call would run, rightly
                        insider.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                while insider.poll(0):
                    insider.recv_multipart()
            if endpoint.startswith("tcp://"):
                replies += sum(1 for s in outsiders if s.poll(0))
        return replies
    finally:
        for s in outsiders:
            s.close(0)
        if insider is not None:
            insider.close(0)
        ctx.term()


async def test_fuzz_every_listening_socket(tmp_path, monkeypatch):
    secret = make_secret_file(str(tmp_path))
    monkeypatch.setenv(auth.ENV_SECRET_FILE, secret)
    port = free_port()
    agent = start_agent(1, 2, port, secret, str(tmp_path))
    print(f"fuzz seed {SEED} (set ASYNCRL_FUZZ_SEED to replay)")
    try:
        async with Supervisor(
            nnodes=2, master_port=port, node_timeout_s=NODE_TIMEOUT_S, join_timeout_s=60, call_timeout_s=20
        ) as sup:
            local = await sup.spawn(Counter, name="counter-local")
            remote = await sup.spawn(Counter, name="counter-remote", node=1)
            pids = [s.pid for s in sup.status()]  # the remote one is a pid of this host too (loopback nodes)
            keys = sup._resources.keys
            targets = [  # every socket that listens: ipc ones rely on the 0700 run directory
                (sup._cluster.address, keys),
                (remote._record.client.address, keys),
                (sup.address, None),
                (local._record.client.address, None),
            ]
            for i, (endpoint, insider) in enumerate(targets):
                replies = await asyncio.wait_for(
                    asyncio.to_thread(_fuzz, endpoint, keys.public_key, insider, SEED + i), SECONDS_PER_TARGET + 20
                )
                assert replies == 0, f"an outsider got {replies} replies from {endpoint} (seed {SEED})"
            assert await local.count() == 0 and await remote.count() == 0, f"a fuzzed call was executed (seed {SEED})"
            assert await local.bump() == 1 and await remote.bump() == 1
            assert [s.state for s in sup.status()] == ["running", "running"]
            assert [s.incarnation for s in sup.status()] == [1, 1]
            assert [n.state for n in sup.nodes()] == ["joined", "joined"]
            assert sup.auth_rejections > 0
            assert all(process_alive(p) for p in pids)
        assert agent.wait(15) == 0
    finally:
        kill_all([agent.pid])
        agent.wait()


def test_a_flipped_bit_that_makes_a_valid_call_is_recognised():
    """Seed 512056390 cut ``bump(["not an int"])`` after the string's header and flipped a bit of
    it (0xaa, a 10-byte string, became 0xea, the integer -22): a valid ``bump(-22)``, which an ipc
    socket rightly ran. `_runs_a_call` must see it, and only such calls, as a call to run."""
    body = msgspec.msgpack.encode(wire.Call(7, "bump", msgspec.Raw(msgspec.msgpack.encode(["not an int"]))))
    assert not _runs_a_call([body])
    mangled = [
        cut[:i] + bytes([cut[i] ^ (1 << bit)]) + cut[i + 1 :]
        for cut in (body[:k] for k in range(1, len(body) + 1))
        for i in range(len(cut))
        for bit in range(8)
    ]
    runnable = [m for m in mangled if _runs_a_call([m])]
    assert body[: body.index(b"\xaa")] + b"\xea" in runnable  # bump(-22)
    assert all(_TO_ACTOR.decode(m).method == "bump" for m in runnable)
    assert _runs_a_call([msgspec.msgpack.encode(wire.Call(8, "count", msgspec.Raw(msgspec.msgpack.encode([]))))])
