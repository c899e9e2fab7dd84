"""metrics.jsonl in the run directory, and what the progress line shows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from asyncrl.runtime.files import write_atomic


class Metrics:
    """metrics.jsonl in the run directory, and what the progress line shows."""

    def __init__(self, run_dir: str, steps: int):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.steps = steps
        self.tty = sys.stdout.isatty()
        self.start = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        heldout = record.get("heldout_solve_rate")
        line = (f"step {record['step']:>4}/{self.steps}  reward {record['reward_mean']:.3f}  "
                f"solve {record['train_solve_rate']:.2f}  stale {record['staleness_mean']:.2f}  "
                f"samples/s {record['samples_per_s']:.1f}  tok/s {record['tokens_per_s']:.0f}  "
                + (f"held-out {heldout:.2f} greedy {record.get('heldout_sampled_solve_rate', float('nan')):.2f} "
                   "sampled  " if heldout is not None else "")
                + f"{time.monotonic() - self.start:.0f}s")
        if self.tty:
            print("\r" + line, end="\n" if heldout is not None else "", flush=True)  # evals stay visible
        elif heldout is not None or record["step"] % max(1, self.steps // 50) == 0:  # a log, not a bar
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()
        self.file.close()


def truncate_metrics(path: str, step: int) -> int:
    """Keep the records of steps <= ``step`` in metrics.jsonl (atomically); returns how many."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by the crash: nothing after it was written whole
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_atomic(path, "".join(kept))
    return len(kept)
