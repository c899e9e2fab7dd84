"""What the console shows while a run trains: a progress bar on a terminal, plain lines elsewhere.

On a terminal, a tqdm bar (tqdm: maintained, and already installed with transformers) with the
step, its ETA, the reward, the train and held-out solve rates and tokens/s; each evaluation and
every line the driver logs is printed above the bar, which is redrawn below it. When stdout is
not a terminal (CI, a file, ``| tee``), or with ``--run.progress_bar false``, plain lines as a log
wants them: about fifty over the run, and one at every evaluation.

Its samples/s and tok/s are the recent rates, over the last `RATE_WINDOW` steps (`RecentRate`), so
a run's start (engines compiling, the first evaluation) does not hide its pace for the rest of
the run; metrics.jsonl keeps the whole run's averages beside them.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from asyncrl.rl.observe.record import StepRecord
from asyncrl.rl.observe.report import duration_text

RATE_WINDOW = 10
"""Steps the console's samples/s and tok/s are taken over."""


class RecentRate:
    """Samples/s and tokens/s over the last ``window`` steps, from the records' run totals (each
    record's average rate times its training time is the run's count so far)."""

    def __init__(self, window: int = RATE_WINDOW):
        self._seen: deque[tuple[float, float, float]] = deque(maxlen=window + 1)

    def update(self, record: StepRecord) -> tuple[float, float]:
        """``(samples/s, tokens/s)`` over the window that ends with ``record``; the record's own
        (whole-run) rates until a second step is seen."""
        t = record.time_s
        self._seen.append((t, record.samples_per_s * t, record.tokens_per_s * t))
        (t0, s0, k0), (t1, s1, k1) = self._seen[0], self._seen[-1]
        if t1 - t0 <= 0:
            return record.samples_per_s, record.tokens_per_s
        return (s1 - s0) / (t1 - t0), (k1 - k0) / (t1 - t0)


def progress_line(
    record: StepRecord, steps: int, eta_s: float | None, elapsed_s: float, rates: tuple[float, float] | None = None
) -> str:
    """One step's record as the plain progress line; ``rates``: the samples/s and tok/s to show
    (`RecentRate`), else the record's whole-run averages."""
    samples_per_s, tokens_per_s = rates or (record.samples_per_s, record.tokens_per_s)
    heldout, sampled = record.heldout_solve_rate, record.heldout_sampled_solve_rate
    if heldout is None:
        evaluation = ""
    elif sampled is None or math.isnan(sampled):  # --run.eval_samples 0: greedy only
        evaluation = f"held-out {heldout:.2f} greedy  "
    else:
        evaluation = f"held-out {heldout:.2f} greedy {sampled:.2f} sampled  "
    return (
        f"step {record.step:>4}/{steps}  reward {record.reward_mean:.3f}  "
        f"solve {record.train_solve_rate:.2f}  stale {record.staleness_mean:.2f}  "
        f"samples/s {samples_per_s:.1f}  tok/s {tokens_per_s:.0f}  "
        + evaluation
        + f"{elapsed_s:.0f}s"
        + (f"  eta {duration_text(eta_s)}" if eta_s is not None else "")
    )


class Progress:
    """Plain lines (the base) or a bar (`ProgressBar`); `make_progress` picks."""

    def __init__(self, steps: int, first_step: int):
        self.steps, self.first_step = steps, first_step
        self.start = time.monotonic()
        self.rate = RecentRate()

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the pace of this run segment so far (evaluations included)."""
        done = step - self.first_step + 1
        if done < 1:
            return None
        return (time.monotonic() - self.start) / done * (self.steps - step)

    def update(self, record: StepRecord) -> None:
        step, rates = record.step, self.rate.update(record)
        if record.heldout_solve_rate is not None or step % max(1, self.steps // 50) == 0:  # a log, not a bar
            line = progress_line(record, self.steps, self.eta_s(step), time.monotonic() - self.start, rates)
            print(line, flush=True)

    def guard(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log``, made safe to call while the display is up."""
        return log

    def close(self) -> None:
        pass


class ProgressBar(Progress):
    """A tqdm bar on the terminal (see the module docstring)."""

    def __init__(self, steps: int, first_step: int, stream: Any):
        super().__init__(steps, first_step)
        from tqdm import tqdm

        self._tqdm, self.stream = tqdm, stream
        # disable=False: train() sets TQDM_DISABLE to silence the loading bars of transformers.
        self.bar = tqdm(
            total=steps,
            initial=first_step - 1,
            desc="GRPO",
            unit="step",
            file=stream,
            dynamic_ncols=True,
            mininterval=0.5,
            disable=False,
            leave=True,
        )
        self.heldout = ""

    def update(self, record: StepRecord) -> None:
        samples_per_s, tokens_per_s = rates = self.rate.update(record)
        if record.heldout_solve_rate is not None:
            self.heldout = f"held-out {record.heldout_solve_rate:.2f}"
            line = progress_line(record, self.steps, None, time.monotonic() - self.start, rates)
            self._tqdm.write(line, file=self.stream)
        self.bar.set_postfix_str(
            f"reward {record.reward_mean:.3f}  solve {record.train_solve_rate:.2f}  "
            f"{self.heldout + '  ' if self.heldout else ''}samples/s {samples_per_s:.1f}  tok/s {tokens_per_s:.0f}",
            refresh=False,
        )
        self.bar.update(record.step - self.bar.n)

    def guard(self, log: Callable[[str], None]) -> Callable[[str], None]:
        def guarded(line: str) -> None:
            if self.bar.disable:  # closed
                return log(line)
            with self._tqdm.external_write_mode(file=self.stream):  # clear the bar, print, redraw it
                log(line)

        return guarded

    def close(self) -> None:
        self.bar.close()


def make_progress(steps: int, first_step: int, enabled: bool, stream: Any = None) -> Progress:
    """A bar when ``enabled`` and ``stream`` (stdout) is a terminal; plain lines otherwise."""
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if enabled and isatty is not None and isatty():
        return ProgressBar(steps, first_step, stream)
    return Progress(steps, first_step)
