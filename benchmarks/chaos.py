"""Chaos benchmark: a GRPO run with injected faults of mixed kinds, next to the same run without.

    python benchmarks/chaos.py                                  # 6 faults over 80 steps, embedded model
    python benchmarks/chaos.py --faults 9 --steps 120 -- --sampler.count 3 --run.sync_timeout_s 10

Both runs share one config (overrides after ``--`` go to both) and seeds. Faults, spread evenly
over the steps and cycling through the kinds, are real signals to real processes:

* ``sampler_kill``: SIGKILL a random running sampler (lost, rebuilt without it, restarted, rejoins);
* ``sampler_freeze``: SIGSTOP a random running sampler (the next weight sync fails on the others
  within ``--run.sync_timeout_s``; the driver kills it; it is restarted and rejoins);
* ``trainer_kill``: SIGKILL the trainer once a checkpoint newer than the last resume exists (the
  run stops; the benchmark resumes it from that checkpoint, as ``--resume`` does).

It prints, per fault, when it was noticed and how long until the run was whole again (from the
run's faults.jsonl), then injected / survived counts, and the final held-out solve rates and wall
times of both runs as a markdown table. A fault "survived" when the run reached its last step
and the faulty part was back: the sampler rejoined (or the run ended first with the group
rebuilt), or the trainer's run resumed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("sampler_kill", "sampler_freeze", "trainer_kill")
SHORT = [
    "--run.groups_per_step",
    "8",
    "--sampler.count",
    "2",
    "--run.eval_every",
    "100000",
    "--run.n_heldout",
    "200",
    "--run.eval_samples",
    "2",
    "--run.checkpoint_every",
    "10",
    "--run.sync_timeout_s",
    "5",
    "--run.restart_timeout_s",
    "120",
]
WATCH_S = 600.0
"""How long the injector waits for a target (a running sampler, a new checkpoint) before it gives up."""


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0, help="which sampler each fault hits")
    parser.add_argument("--out", default="", help="directory for both runs (default: a temporary one)")
    parser.add_argument("--report", metavar="OUT", default="", help="print the tables of an earlier run in OUT again")
    parser.add_argument("extra", nargs="*", help="config overrides for both runs, after --")
    return parser.parse_args()


async def progress_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "progress.json")) as f:
            return int(json.load(f)["step"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


async def wait_step(run_dir: str, step: int) -> None:
    while await progress_step(run_dir) < step:  # a benchmark watching a run from outside: polling is fine
        await asyncio.sleep(0.05)


def newest_checkpoint(run_dir: str) -> int:
    from asyncrl.rl.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    return found[-1].step if found else 0


async def inject(sup, run_dir: str, plan: list[dict], rng: random.Random, resumed_at: int) -> None:
    """Inject the faults of ``plan`` not done yet, each once the run reached its step."""
    for fault in plan:
        if fault.get("at"):
            continue
        await wait_step(run_dir, fault["step"])
        deadline = time.monotonic() + WATCH_S
        if fault["kind"] == "trainer_kill":
            while newest_checkpoint(run_dir) <= resumed_at:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no checkpoint after step {resumed_at} within {WATCH_S:g} s")
                await asyncio.sleep(0.05)
            target = "trainer"
        else:
            running = []
            while not running:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no sampler running within {WATCH_S:g} s: {sup.status()}")
                running = [s.name for s in sup.status() if s.name.startswith("sampler") and s.state == "running"]
                await asyncio.sleep(0.05)
            target = rng.choice(running)
        (status,) = [s for s in sup.status() if s.name == target]
        fault.update(
            target=target, at=time.time(), at_step=await progress_step(run_dir), checkpoint=newest_checkpoint(run_dir)
        )
        os.kill(status.pid, signal.SIGSTOP if fault["kind"] == "sampler_freeze" else signal.SIGKILL)


async def run(config, run_dir: str, plan: list[dict] | None, rng: random.Random) -> tuple[dict, float]:
    """One run to its end (resumed after every trainer loss); returns its summary and wall time."""
    from asyncrl import Supervisor
    from asyncrl.rl.driver.faults import TrainerLostError
    from asyncrl.rl.driver.run import train

    start, resume, resumed_at = time.monotonic(), False, 0
    while True:
        try:
            async with Supervisor() as sup:
                injector = asyncio.ensure_future(inject(sup, run_dir, plan, rng, resumed_at)) if plan else None
                try:
                    summary = await train(config, sup, resume=resume, log=lambda line: print("   ", line, flush=True))
                finally:
                    if injector is not None:
                        injector.cancel()
                        await asyncio.gather(injector, return_exceptions=True)
            return summary, time.monotonic() - start
        except TrainerLostError as exc:
            print(f"    trainer lost: {str(exc).splitlines()[0][:200]}; resuming", flush=True)
            resume, resumed_at = True, newest_checkpoint(run_dir)


def measure(plan: list[dict], run_dir: str, steps: int) -> list[dict]:
    """Match each injected fault with what the run recorded in faults.jsonl."""
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        events = [json.loads(line) for line in f]
    rows = []
    for fault in (f for f in plan if f.get("at")):
        row = dict(
            kind=fault["kind"],
            step=fault["at_step"],
            target=fault["target"],
            detect_s=None,
            recover_s=None,
            back_s=None,
            survived=False,
        )
        later = [e for e in events if e["at"] >= fault["at"]]
        if fault["kind"] == "trainer_kill":
            stopped = next((e for e in later if e["event"] == "stopped"), None)
            resumed = next((e for e in later if e["event"] == "resumed"), None)
            if stopped:
                row["detect_s"] = stopped["at"] - fault["at"]
            if resumed:
                row["back_s"] = resumed["at"] - fault["at"]
                row["recover_s"] = row["back_s"]
                row["redone"] = fault["at_step"] - resumed["step"]
                row["survived"] = True
        else:
            lost = next((e for e in later if e["event"] == "lost" and e.get("sampler") == fault["target"]), None)
            if lost:
                row["detect_s"] = lost["at"] - fault["at"]
                # what followed this loss: up to the end of the run segment or the sampler's next loss
                after = []
                for e in (e for e in later if e["at"] > lost["at"]):
                    if e["event"] in ("stopped", "resumed") or (
                        e["event"] == "lost" and e.get("sampler") == fault["target"]
                    ):
                        break
                    after.append(e)
                mine = [e for e in after if e.get("sampler") == fault["target"]]
                recovered = next((e for e in mine if e["event"] == "recovered"), None)
                rejoined = next((e for e in mine if e["event"] == "rejoined"), None)
                row["recover_s"] = recovered["recovered_s"] + row["detect_s"] if recovered else None
                row["back_s"] = rejoined["at"] - fault["at"] if rejoined else None
                row["survived"] = recovered is not None
        rows.append(row)
    return rows


def fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(rows: list[dict], clean: dict, clean_s: float, chaos: dict, chaos_s: float, steps: int) -> None:
    print("\n| # | fault | at step | target | noticed after s | whole again after s | back after s | survived |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        extra = f" ({r['redone']} steps redone)" if "redone" in r else ""
        print(
            f"| {i} | {r['kind']} | {r['step']} | {r['target']} | {fmt(r['detect_s'])} | {fmt(r['recover_s'])} | "
            f"{fmt(r['back_s'])}{extra} | {'yes' if r['survived'] else 'NO'} |"
        )
    survived = sum(r["survived"] for r in rows)
    recover = [r["recover_s"] for r in rows if r["recover_s"] is not None]
    print(
        f"\nfaults injected {len(rows)}, survived {survived}; "
        f"whole again after {fmt(statistics.median(recover) if recover else None)} s "
        f"median, {fmt(max(recover) if recover else None)} s max; the faulty run reached step "
        f"{chaos['steps'] if chaos else '-'} of {steps}"
    )
    print("\n| run | held-out greedy | held-out sampled | wall s | sampler losses / rejoins |")
    print("|---|---|---|---|---|")
    for name, s, wall in (("fault-free", clean, clean_s), ("with faults", chaos, chaos_s)):
        after = s["heldout_after"]
        print(
            f"| {name} | {after['greedy']:.3f} | {fmt(after.get('sampled'), '.3f')} | {wall:.0f} | "
            f"{s['faults']['sampler_losses']} / {s['faults']['sampler_rejoins']} |"
        )
    print(
        f"(held-out before GRPO: {clean['heldout_before']['greedy']:.3f} greedy, "
        f"{fmt(clean['heldout_before'].get('sampled'), '.3f')} sampled)"
    )


async def main() -> None:
    args = parse()
    if args.report:
        return show(args.report)
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = args.out or tempfile.mkdtemp(prefix="chaos-")
    os.makedirs(out, exist_ok=True)
    base = [*SHORT, "--run.steps", str(args.steps), *args.extra]
    plan = [
        {"kind": KINDS[i % len(KINDS)], "step": round((i + 1) * args.steps / (args.faults + 1))}
        for i in range(args.faults)
    ]
    print(
        f"runs in {out}; overrides: {' '.join(base)}\nfault plan: "
        + ", ".join(f"{f['kind']}@{f['step']}" for f in plan),
        flush=True,
    )
    print("fault-free run:", flush=True)
    clean, clean_s = await run(
        parse_overrides(GRPOConfig(), [*base, "--run.run_dir", f"{out}/clean"]),
        f"{out}/clean",
        None,
        random.Random(args.seed),
    )
    print("run with faults:", flush=True)
    chaos, chaos_s = await run(
        parse_overrides(GRPOConfig(), [*base, "--run.run_dir", f"{out}/chaos"]),
        f"{out}/chaos",
        plan,
        random.Random(args.seed),
    )
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"plan": plan, "steps": args.steps, "clean_s": clean_s, "chaos_s": chaos_s}, f, indent=1)
    show(out)


def show(out: str) -> None:
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)
    summaries = []
    for name in ("clean", "chaos"):
        with open(os.path.join(out, name, "summary.json")) as f:
            summaries.append(json.load(f))
    rows = measure(saved["plan"], f"{out}/chaos", saved["steps"])
    report(rows, summaries[0], saved["clean_s"], summaries[1], saved["chaos_s"], saved["steps"])


if __name__ == "__main__":
    from asyncrl.runtime.loop import run as run_loop

    run_loop(main())
