"""metrics.jsonl in the run directory (the record of a run), and who else sees each record."""

from __future__ import annotations

import json
import os

from asyncrl.rl.observe.progress import Progress
from asyncrl.rl.observe.record import StepRecord
from asyncrl.rl.observe.writers import MetricWriters
from asyncrl.runtime.files import write_atomic


class Metrics:
    """metrics.jsonl in the run directory, one record per step; each record also goes to the
    viewers (`MetricWriters`: TensorBoard, W&B) and to the console (`Progress`)."""

    def __init__(self, run_dir: str, progress: Progress, writers: MetricWriters | None = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.progress, self.writers = progress, writers if writers is not None else MetricWriters([])

    def write(self, record: StepRecord) -> None:
        self.file.write(record.to_json() + "\n")
        self.writers.write(record)
        self.progress.update(record)

    def close(self) -> None:
        try:
            self.progress.close()
            self.writers.close()
        finally:
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
