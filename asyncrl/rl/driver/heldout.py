"""The held-out evaluation between steps, and the best policy it finds.

The trainer solves the held-out problems (trainer/heldout.py); `evaluate` calls it under
``--run.eval_timeout_s`` and splits its answer into the solve rates and the task's own metrics.
The policy of the best held-out greedy solve rate so far is kept in RUN_DIR/best/ with best.json
inside (`save_best`); a resumed run reads it back (`read_best`), since it may be newer than the
checkpoint resumed from.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from asyncrl.errors import RemoteError
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.faults import TaskFailedError, trainer_phase
from asyncrl.rl.driver.saving import save_policy
from asyncrl.rl.observe.report import heldout_failures_lines, shown_path
from asyncrl.rl.tasks.scoring import TaskFailureError

BEST_DIR, BEST_JSON = "best", "best.json"


async def evaluate(
    trainer: Any, run: RunConfig, log: Callable[[str], None]
) -> tuple[dict[str, float], dict[str, float]]:
    """The held-out solve rates (``greedy``, ``sampled``), and the evaluation's task metrics and
    failed calls (``heldout/task/<name>``, ``heldout/task_errors/<kind>``: the step record's); an
    agent's failed episodes are logged, a line per kind with what it raised, so a count of
    failures says why. The task's code failing past its budget stops the run, as in a sampler."""
    t = run.deadlines.eval_timeout_s
    try:
        out = await trainer_phase(
            "the held-out evaluation",
            "eval_timeout_s",
            t,
            trainer.with_timeout(t).evaluate(run.eval_samples),
        )
    except RemoteError as exc:
        if isinstance(exc, TaskFailureError):  # the task's code past its budget (as fleet/pool.py: a sampler's)
            raise TaskFailedError(f"the held-out evaluation: {exc.remote_message}") from exc
        raise
    for line in heldout_failures_lines(out.pop("failures", {})):
        log(line)
    extra = {f"heldout/{k}": v for k, v in out.items() if "/" in k}
    return {k: v for k, v in out.items() if "/" not in k}, extra


async def save_best(
    trainer: Any,
    run: RunConfig,
    run_dir: str,
    step: int,
    heldout: dict[str, float],
    heldout_before: dict[str, float],
    n_heldout: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """RUN_DIR/best/: the policy of the best held-out greedy solve rate so far, with best.json
    (its step and rates) inside, written with it in one rename; returns best.json's contents."""
    best = {
        "step": step,
        "heldout": dict(heldout),
        "heldout_before": dict(heldout_before),
        "heldout_problems": n_heldout,
        "saved_at": time.time(),
    }
    await save_policy(
        trainer,
        run,
        os.path.join(run_dir, BEST_DIR),
        f"saving the best policy (step {step})",
        {BEST_JSON: json.dumps(best, indent=2)},
    )
    log(
        f"best held-out greedy so far at step {step} ({heldout['greedy']:.3f}): "
        f"saved to {shown_path(os.path.join(run_dir, BEST_DIR))}"
    )
    return best


def read_best(run_dir: str) -> dict[str, Any] | None:
    """best/best.json of an earlier segment (None if there is none, or none readable)."""
    try:
        with open(os.path.join(run_dir, BEST_DIR, BEST_JSON)) as f:
            best = json.load(f)
        float(best["heldout"]["greedy"]), int(best["step"])
        return best
    except (OSError, ValueError, KeyError, TypeError):
        return None
