"""A GRPO run whose sampler is on another "host" behind a rate-limited link: full weight syncs
against delta syncs (``--run.sync_delta off`` / ``on``), samples/s and each sync's bytes.

    sudo python benchmarks/grpo_slow_link.py --link 1gbit                       # CPU: the embedded model
    python benchmarks/grpo_slow_link.py --link 1gbit --gpus 2 -- --model_path CKPT --sampler.backend vllm

Node 0 (this namespace: the driver and the trainer) and node 1 (a node agent in a network namespace
of its own, with the sampler) are joined by a veth pair whose two ends send at ``--link`` at most
(tc's token bucket filter; `tests/multinode_support.veth_namespaces`, with iproute2 or, where it is
missing as on the GPU machines' image, pyroute2). ``--gpus 2``: node 0 gets GPU 0 and node 1 GPU 1,
and NCCL runs as between hosts (no peer-to-peer, no shared memory: its socket transport over the
veth pair). Each mode is one ``asyncrl launch --nnodes 2`` of examples/grpo_countdown.py with
``--run.placement "trainer=0 sampler=1"`` and ``--run.check_weights true`` (the sampler's weights
equal the trainer's after every sync, by digest), plus the flags after ``--``.

Figures are steady state (the first ``--skip`` steps left out): samples/s = completions trained /
wall time, the mean step's phases from metrics.jsonl, and a sync's bytes on the wire (a delta
sync's ``sync_sent_bytes``, else ``sync_bytes``). A delta pays where few of the wire's values
change a step: with random weights and no reward the policy gradient is zero and nothing changes,
so measure a model that learns (a warm-started one, docs/weight_sync.md). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the namespaces and node agents of the multi-node tests

import pytest  # noqa: E402  (veth_namespaces says why it cannot make a namespace by pytest's skip)

from multinode_support import (  # noqa: E402
    env,
    free_port,
    launch_argv,
    make_secret_file,
    netns_pids,
    rate_bytes,
    start_agent,
    veth_namespaces,
)

EXAMPLE = os.path.join(ROOT, "examples", "grpo_countdown.py")
AS_HOSTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "ar"}
"""NCCL as between two hosts, over the veth pair (its interfaces are named ar...)."""


def run_mode(delta: str, namespace: str, master: str, out: str, args) -> dict:
    """One run with ``--run.sync_delta delta``; its steady-state figures, or its error."""
    log_dir = os.path.join(out, delta)
    os.makedirs(log_dir)
    run_dir = os.path.join(log_dir, "run")
    secret, port = make_secret_file(log_dir), free_port(master)
    gpu = lambda i: {"CUDA_VISIBLE_DEVICES": str(i), **AS_HOSTS} if args.gpus else {}  # noqa: E731
    flags = ["--run.placement", "trainer=0 sampler=1", "--run.sync_delta", delta, "--run.check_weights", "true"]
    flags += ["--run.steps", str(args.steps), "--run.eval_every", str(args.steps), "--run.n_heldout", "16"]
    flags += ["--run.eval_samples", "0", "--run.checkpoint_every", "0", "--run.curves", "false"]
    flags += ["--run.run_dir", run_dir, *([] if args.gpus else ["--run.device", "cpu"])]
    agent = start_agent(1, 2, port, secret, log_dir, master=master, netns=namespace, **gpu(1))
    start = time.monotonic()
    with open(os.path.join(log_dir, "driver.log"), "wb") as log:
        driver = subprocess.Popen(
            launch_argv(0, 2, port, secret, master, EXAMPLE, *flags, *args.extra),
            env=env(**gpu(0)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            code = driver.wait(args.timeout_s)
        except subprocess.TimeoutExpired:
            code = None  # the run's limit: said below, with the log's tail
        try:
            agent.wait(60)  # node 1's agent ends when the run does
        except subprocess.TimeoutExpired:
            pass  # killed below
        finally:
            for p in (driver, agent):
                if p.poll() is None:
                    p.kill()
                    p.wait(30)
    wall = time.monotonic() - start
    if code != 0:
        with open(os.path.join(log_dir, "driver.log"), errors="replace") as f:
            tail = "".join(f.readlines()[-12:])
        return {"error": f"exit {code} after {wall:.0f} s (logs in {log_dir}):\n{tail}"}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    window = records[args.skip : -1]  # the last step holds the final evaluation
    span = records[-2]["time_s"] - records[args.skip - 1]["time_s"]
    mean = lambda key: statistics.mean(r.get(key) or 0.0 for r in window)  # noqa: E731
    wire = [r.get("sync_sent_bytes", r["sync_bytes"]) for r in window]
    return {
        "samples_per_s": sum(r["sequences"] for r in window) / span,
        "step_s": span / len(window),
        "wait_s": mean("wait_s"),
        "train_s": mean("train_s"),
        "sync_s": mean("sync_s"),
        "sync_bytes": mean("sync_bytes"),
        "wire_bytes": statistics.mean(wire),
        "changed": mean("sync_changed") if any("sync_changed" in r for r in window) else None,
        "digests_equal": all(r["weights_digests"]["sampler0"] == r["weights_digests"]["trainer"] for r in records)
        if all("weights_digests" in r for r in records)
        else None,  # --run.check_weights false among the extra flags
        "steps": len(window),
        "wall_s": wall,
    }


def table(link: str, results: dict[str, dict]) -> str:
    rows = [
        "| sync | samples/s | vs full | step s | wait s | train s | sync s | MB a sync on the wire | of the whole | "
        "values changed | link used | weights equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    full = results.get("off", {}).get("samples_per_s")
    for delta, r in results.items():
        if "error" in r:
            rows.append(f"| {delta} | failed: {r['error'].splitlines()[0]} |")
            continue
        used = r["wire_bytes"] / max(r["sync_s"], 1e-9) / rate_bytes(link)
        changed = "" if r["changed"] is None else f"{r['changed']:.2%}"
        ratio = f"{r['samples_per_s'] / full:.2f}x" if full else ""
        rows.append(
            f"| {delta} | {r['samples_per_s']:.1f} | {ratio} | {r['step_s']:.2f} | {r['wait_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['sync_s']:.2f} | {r['wire_bytes'] / 1e6:.1f} | "
            f"{r['wire_bytes'] / max(r['sync_bytes'], 1):.2%} | {changed} | {used:.0%} | {r['digests_equal']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="1gbit", help="the veth pair's rate each way, as tc writes it")
    parser.add_argument("--gpus", type=int, choices=(0, 2), default=0, help="2: GPU 0 for node 0, GPU 1 for node 1")
    parser.add_argument("--modes", default="off,on", help="--run.sync_delta values, one run each")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=4, help="start-up steps left out of the figures")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="a run's limit")
    parser.add_argument("--out", default="", help="logs and run directories (default: a temporary one)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("extra", nargs="*", help="asyncrl flags, after --")
    args = parser.parse_args()
    rate_bytes(args.link)  # a bad rate fails here, in one line
    out = args.out or tempfile.mkdtemp(prefix="grpo-slow-link-")
    results: dict[str, dict] = {}
    try:
        with veth_namespaces(1, rate=args.link) as ((namespace, master, _),):
            for delta in args.modes.split(","):
                results[delta] = run_mode(delta, namespace, master, out, args)
                print(json.dumps({delta: results[delta]}), flush=True)
                left = netns_pids(namespace)
                if left:
                    raise SystemExit(f"processes left in the namespace after the {delta} run: {left}")
    except pytest.skip.Exception as exc:
        raise SystemExit(f"grpo_slow_link: {exc}") from None
    print(f"\nexamples/grpo_countdown.py {' '.join(args.extra)}; sampler on node 1 behind a {args.link} link each way")
    print(table(args.link, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link": args.link, "extra": args.extra, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
