"""The "floor": a bare asyncio ZeroMQ round trip between two processes.

No runtime, no actors: the main process holds a DEALER, a server process
(this file run with ``--serve ADDR``) holds a ROUTER and answers each
``Request(id, x)`` with ``Response(id, y=x+1)``.  Both sides encode/decode
with typed msgspec msgpack codecs and run on uvloop when it is importable.
Whatever the asyncrl runtime adds on top of this is its overhead.

Measured per transport:
  * sequential latency: 500 warm-up calls, then N calls one at a time
    (default 5000); p50/p99 of the full round trip incl. encode/decode, in us;
  * throughput: calls/s with a window of 64 requests in flight, matched by id
    (default 20000 calls).

Run:
    python benchmarks/floor_rpc.py                    # ipc and tcp, table
    python benchmarks/floor_rpc.py --transport tcp --json

From Python: ``measure_floor("ipc")``, ``measure_floor("tcp")`` or
``measure_floor("tcp://127.0.0.1:5555")`` -> {"p50_us", "p99_us", "calls_per_s"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

try:
    import uvloop
except ImportError:
    uvloop = None

WARMUP = 500
WINDOW = 64
READY_TIMEOUT_S = 15.0
# Generous per-phase budgets: they only exist so a dead or stuck server turns
# into an error instead of a hang.
PHASE_TIMEOUT_S = 120.0


class Request(msgspec.Struct, array_like=True, gc=False):
    id: int
    x: int


class Response(msgspec.Struct, array_like=True, gc=False):
    id: int
    y: int


def _run(coro):
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


async def _serve(addr: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    decode = msgspec.msgpack.Decoder(Request).decode
    encode = msgspec.msgpack.Encoder().encode
    parent = os.getppid()

    async def exit_if_orphaned():
        # The client kills us in a finally, but if it is itself SIGKILLed we
        # must not linger forever.
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        os._exit(0)

    orphan_watch = asyncio.ensure_future(exit_if_orphaned())  # noqa: F841 (keep a ref)
    while True:
        ident, payload = await sock.recv_multipart()
        req = decode(payload)
        await sock.send_multipart([ident, encode(Response(req.id, req.x + 1))])


async def _guarded(coro, proc: subprocess.Popen, timeout: float):
    """Await ``coro``, failing fast if the server exits or time runs out.

    One watchdog per phase rather than a timeout on every recv, so the
    measured path carries no per-call timer overhead.
    """
    task = asyncio.ensure_future(coro)
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result within {timeout:.0f}s")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _client(addr: str, proc, n_latency: int, n_throughput: int) -> dict:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(Response).decode

    async def call(i: int) -> None:
        await sock.send(encode(Request(i, i)))
        resp = decode(await sock.recv())
        if resp.id != i or resp.y != i + 1:
            raise RuntimeError(f"bad reply {resp!r} to request {i}")

    async def sequential(n: int) -> list[float]:
        samples = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            await call(i)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        return samples

    async def windowed(n: int) -> float:
        outstanding = set()
        next_id = min(WINDOW, n)
        t0 = time.perf_counter()
        for i in range(next_id):
            outstanding.add(i)
            await sock.send(encode(Request(i, i)))
        for _ in range(n):
            resp = decode(await sock.recv())
            outstanding.remove(resp.id)  # KeyError on an unexpected id
            if resp.y != resp.id + 1:
                raise RuntimeError(f"bad reply {resp!r}")
            if next_id < n:
                outstanding.add(next_id)
                await sock.send(encode(Request(next_id, next_id)))
                next_id += 1
        return n / (time.perf_counter() - t0)

    try:
        # Readiness: the DEALER queues the ping until the server has bound.
        await _guarded(call(-1), proc, READY_TIMEOUT_S)
        await _guarded(sequential(WARMUP), proc, PHASE_TIMEOUT_S)
        samples = await _guarded(sequential(n_latency), proc, PHASE_TIMEOUT_S)
        calls_per_s = await _guarded(windowed(n_throughput), proc, PHASE_TIMEOUT_S)
    finally:
        sock.close(linger=0)
        ctx.term()
    q = statistics.quantiles(samples, n=100)
    return {"p50_us": q[49], "p99_us": q[98], "calls_per_s": calls_per_s}


def measure_floor(transport: str, n_latency: int = 5000, n_throughput: int = 20000) -> dict:
    """Run the floor benchmark over ``transport``.

    ``transport`` is "ipc" (socket in a private temp dir), "tcp" (a free
    loopback port) or a full ``ipc://`` / ``tcp://`` address.
    """
    tmpdir = None
    if transport == "ipc":
        tmpdir = tempfile.mkdtemp(prefix="asyncrl-floor-")
        addr = f"ipc://{tmpdir}/floor.sock"
    elif transport == "tcp":
        with socket.socket() as s:  # racy but fine on a private box
            s.bind(("127.0.0.1", 0))
            addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    elif transport.startswith(("ipc://", "tcp://")):
        addr = transport
    else:
        raise ValueError(f"unknown transport {transport!r}")

    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", addr],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        return _run(_client(addr, proc, n_latency, n_throughput))
    finally:
        proc.kill()
        proc.wait(timeout=10)
        # A SIGKILLed server cannot unlink its ipc socket file.
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
        elif addr.startswith("ipc://") and os.path.exists(addr[6:]):
            os.unlink(addr[6:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", metavar="ADDR", help=argparse.SUPPRESS)
    ap.add_argument("--transport", choices=["ipc", "tcp"], action="append", help="repeatable; default: both")
    ap.add_argument("--n-latency", type=int, default=5000)
    ap.add_argument("--n-throughput", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.serve:
        _run(_serve(args.serve))
        return

    results = {t: measure_floor(t, args.n_latency, args.n_throughput) for t in args.transport or ["ipc", "tcp"]}
    meta = {"loop": "uvloop" if uvloop else "asyncio", "pyzmq": zmq.__version__, "msgspec": msgspec.__version__}
    if args.json:
        print(json.dumps({**meta, **results}))
        return
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print(f"{'transport':<10}{'p50 us':>10}{'p99 us':>10}{'calls/s':>12}")
    for t, r in results.items():
        print(f"{t:<10}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['calls_per_s']:>12.0f}")


if __name__ == "__main__":
    main()
