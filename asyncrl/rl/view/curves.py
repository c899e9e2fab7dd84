"""curves.png: the learning curves of one run, or of several side by side (one colour each).

Six panels, drawn from metrics.jsonl: the reward; the train and held-out solve rates (greedy and
sampled, from the rates before GRPO on); staleness and the shares of groups dropped as stale and
left out for one reward; tokens/s, with the samplers in the weight-sync group when that changed
(a loss, a scale: docs/elastic.md); where each step's time went (waiting for rollouts, training,
the weight sync); and the held-out solve rates against wall-clock minutes (what a change of pacing
or schedule buys per minute).
matplotlib is imported only here and only when a picture is drawn, through its object API and
the Agg canvas (no pyplot state), so a driver can draw from a thread.
"""

from __future__ import annotations

import os
from typing import Any

from asyncrl.errors import AsyncrlError
from asyncrl.rl.view.history import RunHistoryError, heldout_before, read_records, rolling_mean, series

MAX_POINTS = 2000
"""Points per line at most (a long run is thinned evenly): bounds the time a drawing takes."""


class CurvesUnavailableError(AsyncrlError, RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def draw_curves(run_dirs: list[str], out_path: str) -> str:
    """Draw the runs in ``run_dirs`` into the PNG ``out_path`` (written whole, then renamed into
    place, so a reader never sees half a picture); returns ``out_path``. Raises
    `CurvesUnavailableError` without matplotlib, `RunHistoryError` for a directory with no
    metrics.jsonl or no step in it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CurvesUnavailableError("drawing curves needs matplotlib: pip install matplotlib") from None
    runs = []
    for run_dir in run_dirs:
        records = read_records(run_dir)
        if not records:
            raise RunHistoryError(f"{run_dir}: metrics.jsonl holds no step yet")
        runs.append((_label(run_dir, run_dirs), records, heldout_before(run_dir)))
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).flatten()
    fleet = axes[3].twinx()  # samplers in the group, on the throughput panel: tokens/s follow them
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for (label, records, before), colour in zip(runs, colours):
        _draw_run(axes, label, _thin(records), before, colour)
        _draw_fleet(fleet, label, records, colour)
    if fleet.lines:
        fleet.set_ylabel("samplers in group", fontsize=8)
        fleet.set_ylim(bottom=0)
        fleet.legend(fontsize=7, loc="lower right")
    else:
        fleet.set_axis_off()
    titles = [
        "reward (mean per step, and rolling)",
        "solve rate",
        "staleness, dropped and left-out groups",
        "throughput",
        "seconds per step (rolling)",
        "held-out solve rate per wall-clock minute",
    ]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in axes[:5]:
        ax.set_xlabel("step")
    axes[5].set_xlabel("minutes of training")
    fig.suptitle(", ".join(label for label, _, _ in runs), fontsize=11)
    tmp = f"{out_path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, out_path)
    return out_path


def _draw_run(axes: Any, label: str, records: list[dict[str, Any]], before: dict[str, float], c: str) -> None:
    tag = f"{label}: " if label else ""
    window = max(1, len(records) // 25)
    steps, reward = series(records, "reward_mean")
    axes[0].plot(steps, reward, color=c, alpha=0.25, linewidth=0.8)
    axes[0].plot(steps, rolling_mean(reward, window), color=c, label=f"{tag}reward")

    ax = axes[1]
    steps, train = series(records, "train_solve_rate")
    ax.plot(steps, rolling_mean(train, window), color=c, alpha=0.6, label=f"{tag}train (rolling)")
    for key, kind, style in (("heldout_solve_rate", "greedy", "o-"), ("heldout_sampled_solve_rate", "sampled", "s--")):
        at, rates = series(records, key)
        if kind in before:
            at, rates = [0.0, *at], [before[kind], *rates]
        if rates:
            ax.plot(at, rates, style, color=c, markersize=4, label=f"{tag}held-out {kind}")
    ax.set_ylim(bottom=0)

    ax = axes[2]
    steps, stale = series(records, "staleness_mean")
    ax.plot(steps, rolling_mean(stale, window), color=c, label=f"{tag}staleness (rolling)")
    trained, left_out, shares, left_shares = 0, 0, [], []
    for r in records:  # dropped so far / trained so far: the share of sampling thrown away
        trained += len(r.get("group_ids", ())) or 1
        left_out += r.get("uniform_skipped", 0)
        shares.append(r.get("dropped_stale", 0) / trained)
        left_shares.append(left_out / trained)
    ax.plot([r["step"] for r in records], shares, "--", color=c, label=f"{tag}dropped / trained groups")
    if left_out:  # uniform groups left out for want of a signal (not wasted, but sampled for nothing)
        ax.plot([r["step"] for r in records], left_shares, ":", color=c, label=f"{tag}left out (one reward) / trained")

    steps, tokens = series(records, "tokens_per_s")
    axes[3].plot(steps, tokens, color=c, label=f"{tag}completion tokens/s")

    for key, name, style in (
        ("wait_s", "waiting for rollouts", "-"),
        ("train_s", "training", "--"),
        ("sync_s", "weight sync", ":"),
    ):
        steps, seconds = series(records, key)
        axes[4].plot(steps, rolling_mean(seconds, window), style, color=c, label=f"{tag}{name}")

    for key, kind, style in (("heldout_solve_rate", "greedy", "o-"), ("heldout_sampled_solve_rate", "sampled", "s--")):
        minutes, rates = series(records, key, x="time_s")
        minutes = [m / 60 for m in minutes]
        if kind in before:
            minutes, rates = [0.0, *minutes], [before[kind], *rates]
        if rates:
            axes[5].plot(minutes, rates, style, color=c, markersize=4, label=f"{tag}held-out {kind}")
    axes[5].set_ylim(bottom=0)


def _draw_fleet(ax: Any, label: str, records: list[dict[str, Any]], c: str) -> None:
    """The samplers in the group per step, as steps, for a run in which that number changed (its
    changes only, and the last step: exact however long the run, and few points)."""
    steps, sizes = series(records, "samplers_in_group")
    keep = [i for i in range(len(sizes)) if i == 0 or i == len(sizes) - 1 or sizes[i] != sizes[i - 1]]
    steps, sizes = [steps[i] for i in keep], [sizes[i] for i in keep]
    if len(set(sizes)) > 1:
        ax.step(
            steps,
            sizes,
            where="post",
            color=c,
            alpha=0.6,
            linestyle="-.",
            label=f"{label}: samplers in group" if label else "samplers in group",
        )


def _thin(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most `MAX_POINTS` records, evenly spaced, every evaluation and the last one kept."""
    if len(records) <= MAX_POINTS:
        return records
    stride = len(records) / MAX_POINTS
    keep = {int(i * stride) for i in range(MAX_POINTS)} | {len(records) - 1}
    return [r for i, r in enumerate(records) if i in keep or "heldout_solve_rate" in r]


def _label(run_dir: str, run_dirs: list[str]) -> str:
    """A run's name in the legend: its directory's name (nothing when it is the only run)."""
    return "" if len(run_dirs) == 1 else os.path.basename(os.path.normpath(run_dir))
