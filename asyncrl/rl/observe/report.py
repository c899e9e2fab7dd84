"""What a GRPO run tells its user: the summary at its end, and paths shown as typed."""

from __future__ import annotations

import os
from typing import Any


def summary_text(summary: dict[str, Any]) -> str:
    """The end of the run: a heading, what GRPO changed on the held-out problems, and where the
    results are."""
    before, after = summary["heldout_before"], summary["heldout_after"]
    lines = [f"GRPO finished: {summary['steps']} steps in {duration_text(summary['wall_s'])} ({summary['mode']} mode"
             + (", resumed" if summary["resumed_from"] else "") + ")"]
    rows: list[tuple[str, str]] = []
    for kind in ("greedy", "sampled"):
        if kind in before and kind in after:
            gain = 100 * (after[kind] - before[kind])
            rows.append((f"held-out {kind}", f"{before[kind]:.3f} -> {after[kind]:.3f}  ({gain:+.1f} points)"))
    rows[0:0] = [("held-out problems", str(summary["heldout_problems"]))] if rows else []
    faults = summary["faults"]
    rows += [("samples/s", f"{summary['samples_per_s']:.1f}"), ("dropped stale groups", str(summary["dropped_stale"])),
             ("groups left out (one reward)", str(summary.get("uniform_skipped", 0))),
             ("sampler losses / rejoins", f"{faults.get('sampler_losses', 0)} / {faults.get('sampler_rejoins', 0)}"),
             ("final policy", shown_path(summary["final"]))]
    best = summary["best"]
    if best is not None:
        rows.append(("best policy", f"{shown_path(best['path'])}  (step {best['step']}: held-out greedy "
                                    f"{best['heldout']['greedy']:.3f})"))
    else:
        rows.append(("best policy", f"the starting one, {shown_path(summary['initial_policy'])}  (no evaluation beat "
                                    f"its held-out greedy {before.get('greedy', float('nan')):.3f})"))
    rows += [("metrics", shown_path(summary["metrics"]))] + ([("log", shown_path(summary["log"]))] if summary["log"] else [])
    if summary.get("curves"):
        rows.append(("curves", shown_path(summary["curves"])))
    if summary.get("tensorboard"):
        rows.append(("tensorboard", f"tensorboard --logdir {shown_path(summary['tensorboard'])}"))
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
    errors = [f"{int(v)} {k.removeprefix('heldout/task_errors/')}" for k, v in extra.items()
              if k.startswith("heldout/task_errors/")]
    text = f"; task metrics (greedy): {', '.join(metrics)}" if metrics else ""
    if errors:
        text += f"; failed score/step calls, scored 0: {', '.join(errors)}"
    return text


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it (shorter), else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return os.path.abspath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel
