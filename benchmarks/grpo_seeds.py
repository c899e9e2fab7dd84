"""Held-out solve rate before and after GRPO, over several seeds of the default run.

    python benchmarks/grpo_seeds.py                      # seeds 0 1 2, one after another
    python benchmarks/grpo_seeds.py --seeds 0 1 2 --parallel -- --run.steps 300
    python benchmarks/grpo_seeds.py --out DIR --report   # the table of runs made before

Runs ``asyncrl launch examples/grpo_countdown.py --run.seed S`` per seed (overrides after ``--``
go to every run; the seed changes sampling and training, not the problems) and prints, per seed
and as a mean, the held-out solve rates before and after: greedy, and sampled at the training
temperature (the policy GRPO trains), with each run's wall time. ``--parallel`` starts the runs
together (only where there are two free cores per run: on fewer they slow each other down and
change how stale the rollouts get).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", action="store_true", help="run the seeds at the same time")
    parser.add_argument("--out", default="", help="directory for the runs (default: a temporary one)")
    parser.add_argument(
        "--report",
        action="store_true",
        help="only print the table of the runs already in --out (wall: the GRPO loop's, summary.json)",
    )
    parser.add_argument("extra", nargs="*", help="overrides for every run, after --")
    args = parser.parse_args()
    if args.report:
        walls = {}
        for seed in args.seeds:
            with open(os.path.join(args.out, f"seed{seed}", "summary.json")) as f:
                walls[seed] = json.load(f)["wall_s"]
        report(args.out, args.seeds, walls)
        return
    out = args.out or tempfile.mkdtemp(prefix="grpo-seeds-")
    os.makedirs(out, exist_ok=True)
    procs, started, walls = {}, {}, {}
    for seed in args.seeds:
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "launch",
            "examples/grpo_countdown.py",
            "--run.seed",
            str(seed),
            "--run.run_dir",
            os.path.join(out, f"seed{seed}"),
            *args.extra,
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        log = open(os.path.join(out, f"seed{seed}.log"), "w")
        started[seed] = time.monotonic()
        procs[seed] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if not args.parallel:
            procs[seed].wait()
            walls[seed] = time.monotonic() - started[seed]
    while len(walls) < len(procs):  # parallel runs: note each one's end as it comes
        for seed, proc in procs.items():
            if seed not in walls and proc.poll() is not None:
                walls[seed] = time.monotonic() - started[seed]
        time.sleep(0.5)
    for seed, proc in procs.items():
        if proc.returncode != 0:
            sys.exit(f"seed {seed} failed (exit {proc.returncode}); see {out}/seed{seed}.log")
    report(out, args.seeds, walls)


def report(out: str, seeds: list[int], walls: dict[int, float]) -> None:
    """The table of the runs in ``out``: per seed and as a mean."""
    rows = []
    for seed in seeds:
        with open(os.path.join(out, f"seed{seed}", "summary.json")) as f:
            summary = json.load(f)
        before, after = summary["heldout_before"], summary["heldout_after"]
        with open(os.path.join(out, f"seed{seed}", "config.json")) as f:
            trained = summary["steps"] * json.load(f)["run"]["groups_per_step"]
        rows.append(
            (
                seed,
                before["greedy"],
                after["greedy"],
                before.get("sampled", float("nan")),
                after.get("sampled", float("nan")),
                walls[seed],
                summary["dropped_stale"] / trained,
                summary.get("uniform_skipped", 0) / trained,
            )
        )
    print(f"\nruns in {out}\n")
    print(
        "| seed | greedy before | greedy after | gain | sampled before | sampled after | gain | wall | dropped "
        "| left out |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed, gb, ga, sb, sa, wall, dropped, left in rows:
        print(
            f"| {seed} | {gb:.3f} | {ga:.3f} | {100 * (ga - gb):+.1f} | {sb:.3f} | {sa:.3f} | "
            f"{100 * (sa - sb):+.1f} | {wall:.0f} s | {100 * dropped:.1f}% | {100 * left:.0f}% |"
        )
    mean = lambda i: statistics.mean(r[i] for r in rows)  # noqa: E731
    print(
        f"| mean | {mean(1):.3f} | {mean(2):.3f} | {100 * (mean(2) - mean(1)):+.1f} | {mean(3):.3f} | "
        f"{mean(4):.3f} | {100 * (mean(4) - mean(3)):+.1f} | {mean(5):.0f} s | {100 * mean(6):.1f}% | "
        f"{100 * mean(7):.0f}% |"
    )
    print(
        "(gains in points; sampled: completions drawn at the training temperature, as GRPO samples them; "
        "dropped: groups dropped as stale, left out: groups with one reward for every completion, both "
        "as a share of the groups trained)"
    )


if __name__ == "__main__":
    main()
