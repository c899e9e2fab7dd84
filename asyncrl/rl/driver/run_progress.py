"""A run's progress as RUN_DIR/progress.json and ``asyncrl status`` show it: `DriverProgress`, the
driver's (`GRPODriver.progress`), made of its own fields and of its parts' (the pool's, the
scaler's, the pacer's, the evaluation's under way), and `StartingProgress` while there is no driver
yet (`RunScope.progress`).

``to_dict`` is the JSON object that users and scripts read (docs/grpo.md lists its keys): the
parts' keys sit flat beside the run's own, the evaluation's under ``evaluating``, in the order they
have always had (``asyncrl status`` prints them in it); the Prometheus ``progress_*`` numbers are
drawn from it too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncrl.rl.driver.fleet.pool import PoolProgress
from asyncrl.rl.driver.fleet.scaling import ScalingProgress
from asyncrl.rl.driver.pacing import PacingStats
from asyncrl.rl.observe.eval_progress import EvalSoFar


class StartingProgress(msgspec.Struct, kw_only=True, frozen=True):
    """The progress while the run's actors start, before its driver is built."""

    steps: int
    """The steps the run was asked for."""

    def to_dict(self) -> dict[str, Any]:
        return {"phase": "starting", "steps": self.steps}


class DriverProgress(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The driver's progress (see the module docstring). A field at its default is left out of the
    JSON: no stall, no scaler, no pacer (sync mode), no evaluation under way."""

    phase: str
    """``starting``, ``evaluating`` (before GRPO), ``training``, ``finished`` or ``stopped``."""
    step: int
    """The last step whose record is written."""
    steps: int
    """The steps the run was asked for (``--run.steps``)."""
    version: int
    """The trainer's weights."""
    samples: int
    """Completions trained on, over the run."""
    queue_depth: int
    """Groups in the rollout queue."""
    dropped_stale: int
    """Groups dropped as too stale, over the run."""
    uniform_skipped: int
    """Groups of one reward left out, over the run."""
    heldout_before: dict[str, float]
    """Held-out solve rates before GRPO (empty until they are known)."""
    elapsed_s: float
    """Training wall time over every segment of the run (to the millisecond)."""
    last_step_s: float
    """The last step's wall time, its held-out evaluation included (to the millisecond)."""
    last_step_at: float
    """When the last step ended (unix time; 0: none yet)."""
    checkpoint: str
    """The newest checkpoint ("": none)."""
    stalled: str = ""
    """What a step that runs far longer than the recent ones waits for (`StallWatch`; "": none)."""
    pool: PoolProgress
    """The samplers: the group's generation, the run's fault counts (a resumed run's carried in),
    each sampler's place."""
    scaling: ScalingProgress | None = None
    """The fleet's target and the samplers starting (a run with a `Scaler`)."""
    pacing: PacingStats | None = None
    """The pacer now (async mode)."""
    evaluating: EvalSoFar | None = None
    """How far the held-out evaluation under way has got."""
    lengths: dict[str, dict[str, int]] = {}
    """Completions by length bucket (observe/lengths.py) in this run segment: ``generated`` (offered
    to the queue), ``trained`` and ``dropped`` (as stale)."""
    updated_at: float
    """When this was read (unix time)."""

    FLAT = frozenset({"pool", "scaling", "pacing"})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (see the module docstring): the parts in `FLAT` flattened where they stand."""
        out: dict[str, Any] = {}
        for key, value in msgspec.to_builtins(self).items():
            if key in self.FLAT:
                out.update(getattr(self, key).to_dict())
            else:
                out[key] = value
        return out
