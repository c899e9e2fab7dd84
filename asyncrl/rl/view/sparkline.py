"""Sparklines and the latest metrics of a run, as ``asyncrl status`` prints them."""

from __future__ import annotations

from typing import Any

from asyncrl.rl.view.history import heldout_before, read_records, series

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40, low: float | None = None, high: float | None = None) -> str:
    """``values`` as at most ``width`` bars (neighbours averaged), scaled from ``low`` to ``high``
    (default: their own min and max)."""
    if not values:
        return ""
    if len(values) > width:  # bucket i holds values [i*n/width, (i+1)*n/width)
        n = len(values)
        values = [sum(b) / len(b) for b in (values[i * n // width : (i + 1) * n // width] for i in range(width)) if b]
    lo = min(values) if low is None else low
    hi = max(values) if high is None else high
    if hi <= lo:
        return BARS[0] * len(values)
    return "".join(BARS[min(len(BARS) - 1, max(0, int((v - lo) / (hi - lo) * len(BARS))))] for v in values)


def status_lines(run_dir: str, width: int = 40) -> list[str]:
    """The latest metrics of the run in ``run_dir`` and sparklines of its reward and held-out
    solve rates. Raises `RunHistoryError` when it has no metrics.jsonl."""
    records = read_records(run_dir)
    if not records:
        return ["metrics     none yet (no step finished)"]
    last = records[-1]
    lines = [f"metrics     step {last['step']}" + _latest(last)]
    _, reward = series(records, "reward_mean")
    lines.append(
        f"  reward            {sparkline(reward, width)}  {reward[0]:.3f} -> {reward[-1]:.3f}" if reward else ""
    )
    before = heldout_before(run_dir)
    for key, kind in (("heldout_solve_rate", "greedy"), ("heldout_sampled_solve_rate", "sampled")):
        _, rates = series(records, key)
        if kind in before:
            rates = [before[kind], *rates]
        if rates:
            lines.append(
                f"  held-out {kind:<8} {sparkline(rates, width, 0.0, 1.0)}  {rates[0]:.3f} -> {rates[-1]:.3f}"
                f"  ({len(rates)} evaluations)"
            )
    return [line for line in lines if line]


def _latest(r: dict[str, Any]) -> str:
    shown = [
        ("reward", "reward_mean", ".3f"),
        ("solve", "train_solve_rate", ".2f"),
        ("stale", "staleness_mean", ".2f"),
        ("dropped", "dropped_stale", "d"),
        ("tok/s", "tokens_per_s", ".0f"),
        ("loss", "loss", ".4f"),
    ]
    return "".join(
        f"  {label} {format(r[key], fmt)}" for label, key, fmt in shown if isinstance(r.get(key), (int, float))
    )
