"""What a GRPO run tells its user: the summary at its end, and paths shown as typed."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec


class RunSummary(msgspec.Struct, kw_only=True):
    """The end of a run: RUN_DIR/summary.json (`to_dict`, whose keys users and scripts read, as
    they read what ``train()`` returns), and `summary_text` on the console."""

    steps: int
    """The steps the run was asked for (``--run.steps``)."""
    mode: str
    """``async`` or ``sync``."""
    heldout_before: dict[str, float]
    """Held-out solve rates before GRPO (``greedy``, and ``sampled`` with eval samples)."""
    heldout_after: dict[str, float]
    """Held-out solve rates of the last evaluation."""
    heldout_problems: int
    """Problems in the held-out set."""
    wall_s: float
    """Training wall time over every segment of the run."""
    samples: int
    """Completions trained on."""
    samples_per_s: float
    """Completions trained per second of ``wall_s``."""
    tokens_per_s: float
    """Completion tokens trained per second of ``wall_s``."""
    dropped_stale: int
    """Groups dropped as too stale over the run."""
    uniform_skipped: int
    """Groups of one reward left out over the run."""
    checkpoint: str
    """The final policy's directory (the same as ``final``; the older name)."""
    final: str
    """The final policy's directory."""
    best: dict[str, Any] | None
    """best/best.json with the directory's ``path``; None when no evaluation beat the start."""
    initial_policy: str
    """The policy the run started from."""
    metrics: str
    """RUN_DIR/metrics.jsonl."""
    log: str
    """RUN_DIR/log.txt ("" when the run keeps no log)."""
    curves: str
    """RUN_DIR/curves.png ("" when none was drawn)."""
    tensorboard: str
    """The directory of TensorBoard's event files ("" when none were written)."""
    resumed_from: str | None
    """The checkpoint this segment resumed from (None: a fresh run)."""
    faults: dict[str, int]
    """Sampler fault counts over the run (``sampler_losses``, ``sampler_rejoins``, ...)."""
    fault_log: list[dict[str, Any]]
    """Each sampler fault of this segment, as faults.jsonl has it."""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def summary_text(summary: RunSummary) -> str:
    """The end of the run: a heading, what GRPO changed on the held-out problems, and where the
    results are."""
    s = summary
    before, after = s.heldout_before, s.heldout_after
    lines = [
        f"GRPO finished: {s.steps} steps in {duration_text(s.wall_s)} ({s.mode} mode"
        + (", resumed" if s.resumed_from else "")
        + ")"
    ]
    rows: list[tuple[str, str]] = []
    for kind in ("greedy", "sampled"):
        if kind in before and kind in after:
            gain = 100 * (after[kind] - before[kind])
            rows.append((f"held-out {kind}", f"{before[kind]:.3f} -> {after[kind]:.3f}  ({gain:+.1f} points)"))
    rows[0:0] = [("held-out problems", str(s.heldout_problems))] if rows else []
    losses, rejoins = s.faults.get("sampler_losses", 0), s.faults.get("sampler_rejoins", 0)
    rows += [
        ("samples/s", f"{s.samples_per_s:.1f}"),
        ("dropped stale groups", str(s.dropped_stale)),
        ("groups left out (one reward)", str(s.uniform_skipped)),
        ("sampler losses / rejoins", f"{losses} / {rejoins}"),
        ("final policy", shown_path(s.final)),
    ]
    if s.best is not None:
        rows.append(
            (
                "best policy",
                f"{shown_path(s.best['path'])}  (step {s.best['step']}: held-out greedy "
                f"{s.best['heldout']['greedy']:.3f})",
            )
        )
    else:
        rows.append(
            (
                "best policy",
                f"the starting one, {shown_path(s.initial_policy)}  (no evaluation beat "
                f"its held-out greedy {before.get('greedy', float('nan')):.3f})",
            )
        )
    rows += [("metrics", shown_path(s.metrics))] + ([("log", shown_path(s.log))] if s.log else [])
    if s.curves:
        rows.append(("curves", shown_path(s.curves)))
    if s.tensorboard:
        rows.append(("tensorboard", f"tensorboard --logdir {shown_path(s.tensorboard)}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(lines + [f"  {k:<{width}}  {v}" for k, v in rows])


def duration_text(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def rates_text(rates: dict[str, float]) -> str:
    return ", ".join(f"{rate:.3f} {kind}" for kind, rate in rates.items())


def heldout_extra_text(extra: dict[str, float]) -> str:
    """What a held-out evaluation found besides its rates (`GRPODriver.evaluate`'s ``heldout_extra``):
    the task's metrics on the greedy episodes, and the calls of its code that failed (they scored
    0, so a rate of 0.000 says why); "" when there is neither."""
    metrics = [f"{k.removeprefix('heldout/task/')} {v:.3g}" for k, v in extra.items() if k.startswith("heldout/task/")]
    errors = [
        f"{int(v)} {k.removeprefix('heldout/task_errors/')}"
        for k, v in extra.items()
        if k.startswith("heldout/task_errors/")
    ]
    text = f"; task metrics (greedy): {', '.join(metrics)}" if metrics else ""
    if errors:
        text += f"; failed score/step calls, scored 0: {', '.join(errors)}"
    return text


def heldout_failures_lines(failures: dict[str, int]) -> list[str]:
    """A held-out evaluation's failed agent episodes (`HeldoutEvaluation`'s ``failures``), a line
    per kind with its count: ``held-out sampled episodes failed, scored 0: 3 raised
    openai.BadRequestError: Error code: 400 - ...`` (the message is the first such episode's)."""
    lines = []
    for kind, count in failures.items():
        mode, _, what = kind.partition(": ")
        lines.append(f"held-out {mode} episodes failed, scored 0: {count} {what}")
    return lines


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it (shorter), else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return os.path.abspath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel
