"""A run's history as its directory holds it: the records of metrics.jsonl, and the held-out
solve rates before training (in progress.json while it runs, summary.json once it is done)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, TypeGuard

from asyncrl.errors import AsyncrlError


class RunHistoryError(AsyncrlError, ValueError):
    """A directory holds no run history to show; the message names it and what is missing."""


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl in order. A line that does not parse (the last one,
    while the run is writing it) is skipped. Raises `RunHistoryError` if there is no file."""
    return read_jsonl(run_dir, "metrics.jsonl", lambda record: isinstance(record.get("step"), int))


def read_jsonl(run_dir: str, name: str, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The JSON objects of RUN_DIR/``name``, one a line, in order, those ``keep`` takes; a line
    that does not parse (one cut short while written) is skipped. `RunHistoryError` without it."""
    try:
        with open(os.path.join(run_dir, name), encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise RunHistoryError(f"{run_dir}: no {name} (not a run directory, or no step finished yet)") from None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and keep(record):
            records.append(record)
    return records


def stopped_text(run_dir: str) -> str:
    """A line on a run that stopped (Ctrl-C, a signal, an error; its last faults.jsonl event is
    ``stopped``) and how to resume it; "" when its record says no such thing."""
    try:
        events = read_jsonl(run_dir, "faults.jsonl", lambda e: isinstance(e.get("event"), str))
    except RunHistoryError:
        return ""
    if not events or events[-1]["event"] != "stopped":
        return ""
    last = events[-1]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["at"])) if _number(last.get("at")) else "?"
    step = f" at step {last['step']}" if isinstance(last.get("step"), int) and last["step"] > 0 else ""
    hint = last.get("resume") or "resume it with asyncrl launch SCRIPT --resume RUN_DIR (docs/fault_tolerance.md)"
    return f"the run in {run_dir} was stopped{step} by {last.get('cause', '?')} at {when}; {hint}"


def heldout_before(run_dir: str) -> dict[str, float]:
    """The held-out solve rates before GRPO ({} when the run does not say yet)."""
    for name in ("summary.json", "progress.json"):
        try:
            with open(os.path.join(run_dir, name)) as f:
                rates = json.load(f).get("heldout_before")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(rates, dict) and rates:
            return {k: float(v) for k, v in rates.items() if isinstance(v, (int, float))}
    return {}


def series(records: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, value) of the records that have a finite number under ``key`` (and under ``x``)."""
    xs, ys = [], []
    for r in records:
        value, at = r.get(key), r.get(x)
        if _number(value) and _number(at):
            xs.append(float(at))
            ys.append(float(value))
    return xs, ys


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and up to ``window - 1`` before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
