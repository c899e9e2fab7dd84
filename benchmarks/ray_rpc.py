"""The Ray reference point for benchmarks/floor_rpc.py: the same two numbers
measured on a trivial Ray actor.

    @ray.remote
    class Echo:
        def f(self, x): return x

Measured (on a local ``ray.init(num_cpus=2)`` cluster, dashboard off):
  * sequential latency: 500 warm-up calls, then N calls of
    ``ray.get(a.f.remote(i))`` one at a time (default 5000); p50/p99 in us;
  * throughput: calls/s with 64 calls in flight (``ray.wait`` for one, then
    refill), default 20000 calls.

Ray is deliberately not a dependency of asyncrl, so run this with a separate
interpreter that has it, e.g.:

    python3 -m venv /tmp/rayvenv && /tmp/rayvenv/bin/pip install ray
    /tmp/rayvenv/bin/python benchmarks/ray_rpc.py [--json]

Only the standard library and ray are imported.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time

# Keep a benchmark run from phoning home or spending CPU on metrics export.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

WARMUP = 500
WINDOW = 64
CALL_TIMEOUT_S = 30.0
# ray.init() and actor start-up have no timeout of their own; if anything
# wedges, dump the stacks and exit instead of hanging.
WHOLE_RUN_TIMEOUT_S = 600


@ray.remote
class Echo:
    def f(self, x):
        return x


def measure_ray(n_latency: int = 5000, n_throughput: int = 20000) -> dict:
    """Assumes ray is initialised; returns {"p50_us", "p99_us", "calls_per_s"}."""
    a = Echo.remote()
    # The first call also waits for the actor process to start.
    if ray.get(a.f.remote(-1), timeout=120) != -1:
        raise RuntimeError("echo actor returned the wrong value")

    def sequential(n: int) -> list[float]:
        samples = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            y = ray.get(a.f.remote(i), timeout=CALL_TIMEOUT_S)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if y != i:
                raise RuntimeError(f"bad reply {y!r} to {i}")
        return samples

    sequential(WARMUP)
    samples = sequential(n_latency)

    t0 = time.perf_counter()
    next_i = min(WINDOW, n_throughput)
    expected = {a.f.remote(i): i for i in range(next_i)}
    pending = list(expected)
    done = 0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=CALL_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"no reply within {CALL_TIMEOUT_S}s")
        for ref, y in zip(ready, ray.get(ready, timeout=CALL_TIMEOUT_S)):
            if y != expected.pop(ref):
                raise RuntimeError(f"bad reply {y!r}")
            done += 1
            if next_i < n_throughput:
                ref = a.f.remote(next_i)
                expected[ref] = next_i
                pending.append(ref)
                next_i += 1
    calls_per_s = done / (time.perf_counter() - t0)
    ray.kill(a)

    q = statistics.quantiles(samples, n=100)
    return {"p50_us": q[49], "p99_us": q[98], "calls_per_s": calls_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description="Ray actor round-trip baseline")
    ap.add_argument("--n-latency", type=int, default=5000)
    ap.add_argument("--n-throughput", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    faulthandler.dump_traceback_later(WHOLE_RUN_TIMEOUT_S, exit=True)
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level="WARNING")
    init_s = time.perf_counter() - t0
    try:
        result = measure_ray(args.n_latency, args.n_throughput)
    finally:
        ray.shutdown()
    faulthandler.cancel_dump_traceback_later()

    result["ray_version"] = ray.__version__
    if args.json:
        print(json.dumps(result))
        return
    print(f"ray={ray.__version__} python={sys.version.split()[0]} init={init_s:.1f}s")
    print(f"{'':<10}{'p50 us':>10}{'p99 us':>10}{'calls/s':>12}")
    print(f"{'ray actor':<10}{result['p50_us']:>10.1f}{result['p99_us']:>10.1f}{result['calls_per_s']:>12.0f}")


if __name__ == "__main__":
    main()
