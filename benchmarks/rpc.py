"""asyncrl RPC benchmark: latency, throughput and tensor bandwidth, against the bare-ZeroMQ floor
(``floor_rpc.py``) and, optionally, Ray (``ray_rpc.py``), all in one run.

Measured, per transport (a ``Supervisor(transport="ipc")`` and a ``Supervisor(transport="tcp")``,
one actor each, the driver on uvloop when importable):

  * latency: ``await h.add(i)`` (``async def add(self, x: int) -> int``), one call at a time,
    500 warm-up calls then N (default 5000); p50/p99 of the round trip, in us;
  * throughput: calls/s of ``add`` with 64 calls in flight (64 tasks, each awaiting its calls
    one after the other), default 20000 calls;
  * tensor payload: ``await h.nbytes(t)`` for a float32 tensor of 1..256 MiB (the endpoint
    returns an int), and ``await h.echo(t)`` (the tensor comes back); GB/s = tensor bytes /
    median round-trip time of 5 calls after 1 warm-up (1 GB = 1e9 bytes). For echo the payload crosses
    twice, so the bytes moved are twice what the figure counts.

The floor (``floor_rpc.measure_floor``: the same call on bare pyzmq + msgspec) is measured in the
same run. Small calls run in rounds (default 5), floor then asyncrl back to back per transport,
each asyncrl round in a fresh Supervisor; the table shows medians over rounds, and the ratios are
medians of the per-round (paired) ratios, with their min-max. Goals checked: p50 <= 1.4x floor,
calls/s >= 0.75x floor, 64 MiB over ipc >= 2 GB/s, and >= 5x Ray (``--ray-python``: runs
``ray_rpc.py --json`` in that interpreter once, same call counts).

    python benchmarks/rpc.py                                      # full run, table
    python benchmarks/rpc.py --quick                              # smoke run
    python benchmarks/rpc.py --ray-python /tmp/rayvenv/bin/python --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import msgspec
import torch
import zmq

from asyncrl import Actor, Supervisor, endpoint
from asyncrl import run as run_loop  # uvloop when importable

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 500
WINDOW = 64
MIB = 1 << 20
SIZES_MIB = (1, 4, 16, 64, 256)
CALL_TIMEOUT_S = 30.0
TENSOR_TIMEOUT_S = 120.0
RAY_TIMEOUT_S = 900.0
GOALS = {"p50_ratio": 1.4, "calls_ratio": 0.75, "ipc_64mib_gbps": 2.0, "ray_speedup": 5.0}


class Bench(Actor):
    @endpoint
    async def add(self, x: int) -> int:
        return x + 1

    @endpoint
    async def nbytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @endpoint
    async def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _quantiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


async def _latency(h, n: int) -> dict:
    for i in range(WARMUP):
        await h.add(i)
    samples = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        y = await h.add(i)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        if y != i + 1:
            raise RuntimeError(f"add({i}) returned {y!r}")
    p50, p99 = _quantiles(samples)
    return {"p50_us": p50, "p99_us": p99}


async def _throughput(h, n: int) -> float:
    async def worker(k: int, n: int) -> None:
        for i in range(k, n, WINDOW):
            if await h.add(i) != i + 1:
                raise RuntimeError(f"bad reply to add({i})")

    await asyncio.gather(*(worker(k, WARMUP) for k in range(WINDOW)))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k, n) for k in range(WINDOW)))
    return n / (time.perf_counter() - t0)


async def _tensor(h, sizes_mib, reps: int, echo: bool) -> dict:
    out = {}
    for mib in sizes_mib:
        t = torch.ones(mib * MIB // 4, dtype=torch.float32)
        nbytes = mib * MIB
        await (h.echo(t) if echo else h.nbytes(t))  # warm-up: first touch of buffers on both sides
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = await (h.echo(t) if echo else h.nbytes(t))
            times.append(time.perf_counter() - t0)
            if (y.numel() * 4 if echo else y) != nbytes:
                raise RuntimeError(f"{mib} MiB {'echo' if echo else 'nbytes'}: bad reply")
            del y
        out[mib] = nbytes / statistics.median(times) / 1e9
    return out


async def measure_small(transport: str, n_latency: int, n_throughput: int) -> dict:
    async with Supervisor(transport=transport, call_timeout_s=CALL_TIMEOUT_S) as sup:
        h = await sup.spawn(Bench, name=f"bench-{transport}")
        r = await _latency(h, n_latency)
        r["calls_per_s"] = await _throughput(h, n_throughput)
    return r


async def measure_tensors(transport: str, sizes_mib, reps: int, echo: bool) -> dict:
    async with Supervisor(transport=transport, call_timeout_s=TENSOR_TIMEOUT_S) as sup:
        h = await sup.spawn(Bench, name=f"bench-{transport}")
        r = {"tensor_gbps": await _tensor(h, sizes_mib, reps, echo=False)}
        if echo:
            r["echo_gbps"] = await _tensor(h, sizes_mib, reps, echo=True)
    return r


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _median_of(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def measure_ray(ray_python: str, n_latency: int, n_throughput: int) -> dict:
    cmd = [
        ray_python,
        os.path.join(HERE, "ray_rpc.py"),
        "--json",
        "--n-latency",
        str(n_latency),
        "--n-throughput",
        str(n_throughput),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RAY_TIMEOUT_S, stdin=subprocess.DEVNULL)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _paired(results: dict, tr: str, key: str) -> list[float]:
    """Per-round ratio asyncrl / floor: each pair ran back to back, so they share the noise."""
    return [a[key] / f[key] for a, f in zip(results["rounds"]["asyncrl"][tr], results["rounds"]["floor"][tr])]


def _goals(results: dict) -> list[tuple[str, float, str, str, float]]:
    """(what, value, spread over rounds, comparison, goal) rows."""
    rows = []
    for tr in ("ipc", "tcp"):
        for what, key, cmp, goal in (
            ("p50 / floor p50", "p50_us", "<=", "p50_ratio"),
            ("calls/s / floor calls/s", "calls_per_s", ">=", "calls_ratio"),
        ):
            ratios = _paired(results, tr, key)
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
            rows.append((f"{tr} {what}", statistics.median(ratios), spread, cmp, GOALS[goal]))
    gbps = results["asyncrl"]["ipc"]["tensor_gbps"]
    if 64 in gbps:
        rows.append(("ipc 64 MiB GB/s", gbps[64], "", ">=", GOALS["ipc_64mib_gbps"]))
    ray = results.get("ray")
    if ray:
        for tr in ("ipc", "tcp"):
            ours = results["asyncrl"][tr]
            rows.append((f"ray p50 / {tr} p50", ray["p50_us"] / ours["p50_us"], "", ">=", GOALS["ray_speedup"]))
            rows.append(
                (
                    f"{tr} calls/s / ray calls/s",
                    ours["calls_per_s"] / ray["calls_per_s"],
                    "",
                    ">=",
                    GOALS["ray_speedup"],
                )
            )
    return rows


def print_table(results: dict) -> None:
    print(" ".join(f"{k}={v}" for k, v in results["meta"].items()))
    n = len(results["rounds"]["floor"]["ipc"])
    print(f"\n{'small call (add)':<18}{'p50 us':>10}{'p99 us':>10}{'calls/s':>12}   (median of {n} rounds)")
    rows = [(f"{who} {tr}", results[who][tr]) for tr in ("ipc", "tcp") for who in ("floor", "asyncrl")]
    if results.get("ray"):
        rows.append((f"ray {results['ray']['ray_version']}", results["ray"]))
    for label, r in rows:
        print(f"{label:<18}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{r['calls_per_s']:>12.0f}")

    cols = [
        (f"{tr} {kind}", results["asyncrl"][tr][key])
        for tr in ("ipc", "tcp")
        for kind, key in (("->int", "tensor_gbps"), ("echo", "echo_gbps"))
        if key in results["asyncrl"][tr]
    ]
    print(f"\n{'tensor MiB':<18}" + "".join(f"{c:>12}" for c, _ in cols) + "   (GB/s of one-way payload)")
    for mib in results["asyncrl"]["ipc"]["tensor_gbps"]:
        print(f"{mib:<18}" + "".join(f"{v[mib]:>12.2f}" for _, v in cols))

    print(f"\n{'goal':<30}{'value':>7}{'rounds':>12}   target")
    for what, value, spread, cmp, goal in results["goals"]:
        ok = value <= goal if cmp == "<=" else value >= goal
        print(f"{what:<30}{value:>7.2f}{spread:>12}   {cmp} {goal:<5} {'ok' if ok else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description="asyncrl RPC benchmark")
    ap.add_argument("--quick", action="store_true", help="fewer iterations: a smoke run")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--ray-python", metavar="PATH", help="interpreter with ray installed; runs ray_rpc.py with it")
    ap.add_argument("--rounds", type=int, help="floor/asyncrl small-call rounds, interleaved (default 5, quick 1)")
    ap.add_argument("--no-echo", action="store_true", help="skip the echo (tensor returned) measurements")
    args = ap.parse_args()
    n_lat, n_thr, reps, rounds = (500, 2000, 2, 1) if args.quick else (5000, 20000, 5, 5)
    rounds = args.rounds or rounds

    sys.path.insert(0, HERE)
    from floor_rpc import measure_floor

    results: dict = {
        "meta": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "loop": "uvloop" if _has_uvloop() else "asyncio",
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "msgspec": msgspec.__version__,
            "torch": torch.__version__,
        },
        "rounds": {"floor": {"ipc": [], "tcp": []}, "asyncrl": {"ipc": [], "tcp": []}},
    }
    for _ in range(rounds):  # floor and asyncrl back to back, so both see the same machine state
        for tr in ("ipc", "tcp"):
            results["rounds"]["floor"][tr].append(measure_floor(tr, n_lat, n_thr))
            results["rounds"]["asyncrl"][tr].append(run_loop(measure_small(tr, n_lat, n_thr)))
    for who in ("floor", "asyncrl"):
        results[who] = {tr: _median_of(results["rounds"][who][tr]) for tr in ("ipc", "tcp")}
    for tr in ("ipc", "tcp"):
        results["asyncrl"][tr].update(run_loop(measure_tensors(tr, SIZES_MIB, reps, echo=not args.no_echo)))
    if args.ray_python:
        results["ray"] = measure_ray(args.ray_python, n_lat, n_thr)
    results["goals"] = _goals(results)

    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
