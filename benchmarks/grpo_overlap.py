"""Async against sync GRPO on the same settings: samples/s, and async against its ideal.

    python benchmarks/grpo_overlap.py                                   # CPU (or GPUs if there are 2+)
    python benchmarks/grpo_overlap.py --steps 100 -- --run.groups_per_step 8

Runs ``asyncrl launch examples/grpo_countdown.py`` twice, ``--run.mode sync`` then ``async``,
with the same overrides (anything after ``--``), and reads each run's metrics.jsonl. In sync mode
a step is generate, then train, then sync, so the sync run measures each phase alone: ``gen``
(waiting for the step's groups), ``train`` and ``sync`` seconds per step. Async mode at best
overlaps generation with training, so its ideal speed-up over sync is
``(gen + train) / max(gen, train)``; the table shows how much of that async got. Steady state
only: the first ``--skip`` steps (start-up, first compilations) and the evaluations are left out.
A second table splits each mode's ``sync`` into its phases (the ``sync_*`` metrics, in ms per step;
docs/observability.md says what each one is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PHASES = (
    ("trainer", "sync_trainer_s"),
    ("pack", "sync_trainer_pack_s"),
    ("transfer", "sync_trainer_transfer_s"),
    ("votes", "sync_trainer_vote_s"),
    ("sampler", "sync_sampler_s"),
    ("pause", "sync_sampler_pause_s"),
    ("load", "sync_sampler_load_s"),
    ("resume", "sync_sampler_resume_s"),
    ("rpc", "sync_rpc_s"),
)


def run(mode: str, steps: int, extra: list[str], run_dir: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        "examples/grpo_countdown.py",
        "--run.mode",
        mode,
        "--run.steps",
        str(steps),
        "--run.eval_every",
        str(steps),
        "--run.run_dir",
        run_dir,
        *extra,
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def steady(records: list[dict], skip: int) -> dict[str, float]:
    """Per-step means and samples/s over steps skip+1..last-1 (the last one holds the final eval)."""
    first, last = records[skip - 1], records[-2]
    window = records[skip:-1]
    samples = sum(r["sequences"] for r in window)
    mean = lambda key: statistics.mean(r[key] for r in window)  # noqa: E731
    return {
        "samples_per_s": samples / (last["time_s"] - first["time_s"]),
        "gen_s": mean("wait_s"),
        "train_s": mean("train_s"),
        "sync_s": mean("sync_s"),
        "staleness": mean("staleness_mean"),
        "dropped": last["dropped_stale"] - first["dropped_stale"],
        "steps": len(window),
        **{key: statistics.mean(r.get(key, 0.0) for r in window) for _, key in PHASES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="start-up steps left out of the figures")
    parser.add_argument("--out", default="", help="directory for the two runs (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="overrides for both runs, after --")
    args = parser.parse_args()
    if args.steps < args.skip + 3:
        parser.error("--steps must exceed --skip by at least 3")
    out = args.out or tempfile.mkdtemp(prefix="grpo-overlap-")
    results = {
        mode: steady(run(mode, args.steps, args.extra, os.path.join(out, mode)), args.skip)
        for mode in ("sync", "async")
    }
    s, a = results["sync"], results["async"]
    ideal_speedup = (s["gen_s"] + s["train_s"]) / max(s["gen_s"], s["train_s"])
    ideal = s["samples_per_s"] * ideal_speedup
    print(f"\nsteady state over steps {args.skip + 1}..{args.steps - 1}; runs in {out}\n")
    print("| mode | samples/s | gen s/step | train s/step | sync s/step | staleness | dropped groups |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['samples_per_s']:.1f} | {r['gen_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.4f} "
            f"| {r['staleness']:.2f} | {r['dropped']} |"
        )
    print("\nwhere a sync went, ms per step (trainer: its send; sampler: the slowest's receive)\n")
    print("| mode | sync | " + " | ".join(name for name, _ in PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for mode, r in results.items():
        print(f"| {mode} | {1e3 * r['sync_s']:.1f} | " + " | ".join(f"{1e3 * r[key]:.1f}" for _, key in PHASES) + " |")
    print(
        f"\nideal speed-up (gen + train) / max(gen, train) = {ideal_speedup:.2f} -> ideal async "
        f"{ideal:.1f} samples/s; async got {a['samples_per_s']:.1f} = {100 * a['samples_per_s'] / ideal:.0f}% "
        f"of ideal ({a['samples_per_s'] / s['samples_per_s']:.2f}x sync)"
    )


if __name__ == "__main__":
    main()
