"""`StepRecord`: one training step as the run records it, built once by the driver and handed to
every writer (metrics.jsonl, the console, TensorBoard and W&B, Prometheus), which read its
attributes.

A line of metrics.jsonl is the record flattened: the fields of its parts (`SyncPhases`,
`TrainMetrics`, `FleetEvents`) and the named metrics of the task and of the held-out evaluation
sit beside the step's own, so the file's keys are the names users and benchmarks read
(docs/observability.md has the table). A field that is None is left out of the line (what only
some runs have: pacing, a teacher, a GPU, an evaluation at this step).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from asyncrl.rl.observe.lengths import BatchLengths
from asyncrl.rl.observe.sync_metrics import SyncPhases
from asyncrl.rl.trainer.metrics import TrainMetrics


class FleetEvents(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What happened to the samplers since the last step (`SamplerPool.take_events`)."""

    generation: int
    """The weight-sync group's generation (one more at each re-formation)."""
    samplers_in_group: int
    """Samplers in the weight-sync group after the step."""
    sampler_losses: int
    """Samplers lost since the last step."""
    sampler_rejoins: int
    """Samplers that rejoined since the last step."""
    recover_s: float
    """Seconds spent recovering from sampler faults since the last step."""
    events: list[dict[str, Any]] | None = None
    """The losses, rejoins and scalings themselves, as faults.jsonl has them (None: none)."""
    judged: int | None = None
    """A judge's verdicts since the last step (``--reward_model.kind judge``; None: no judge)."""
    judge_unparsed: int | None = None
    """Of them, those that did not parse (each added 0 to its completion's reward)."""


class StepRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step of a run (see the module docstring). The parts listed in `FLAT` are written
    flattened into the line; the others under their own names."""

    step: int
    """The step, from 1; the weights after it are version ``step``."""
    version: int
    """The trainer's weights after the step."""
    reward_mean: float
    """Mean reward over everything sampled for the step (groups left out as uniform included)."""
    train_solve_rate: float
    """Share of those completions that solved their problem."""
    staleness_mean: float
    """Mean versions between the weights a trained group began under (its oldest token's) and the
    ones it was trained into."""
    staleness_hist: dict[str, int]
    """Trained groups per staleness (keys are the staleness, as text)."""
    dropped_stale: int
    """Groups dropped as too stale, over the whole run."""
    uniform_skipped: int
    """Groups of one reward left out this step (no signal)."""
    queue_depth: int
    """Groups in the rollout queue after the step's batch was taken."""
    paced_wait_s: float | None = None
    """Samplers' total wait for pacing credit so far (async mode only)."""
    paced_streams: int | None = None
    """Most paced batches in flight at once during the step, all samplers together (async mode
    only; ``--sampler.streams`` a sampler)."""
    paced_in_flight_peak: int | None = None
    """Most groups in flight at once during the step (granted credit, not yet queued; times
    ``group_size``: the sequences the engines held). Async mode only."""
    completion_tokens: int
    """Completion tokens in the step's batch (after the prompts)."""
    samples_per_s: float
    """Completions trained per second of training, over the whole run."""
    tokens_per_s: float
    """Completion tokens trained per second of training, over the whole run."""
    time_s: float
    """Training wall time so far, over every segment of the run."""
    wait_s: float
    """Seconds the step waited for its batch."""
    train_s: float
    """The driver's wall time of the train step call."""
    sync: SyncPhases
    """The step's weight sync, by phase (``sync_*``)."""
    generate_s: float
    """Mean generation seconds of the batch's groups."""
    train: TrainMetrics
    """The trainer's metrics of the step."""
    task: dict[str, float]
    """The task's metrics (``task/<name>``: means per completion) and failed user calls
    (``task_errors/<kind>``: counts)."""
    fleet: FleetEvents
    """What happened to the samplers since the last step."""
    group_ids: list[str]
    """The trained groups, in batch order."""
    weights_digests: dict[str, str] | None = None
    """Each member's digest of its weights after the sync (``--run.check_weights``)."""
    heldout_solve_rate: float | None = None
    """Held-out greedy solve rate (steps with an evaluation only)."""
    heldout_sampled_solve_rate: float | None = None
    """Held-out sampled solve rate (with ``--run.eval_samples`` > 0)."""
    heldout_task: dict[str, float] | None = None
    """The evaluation's task metrics and failed calls (``heldout/task/<name>``, ``heldout/task_errors/<kind>``)."""
    eval_s: float | None = None
    """Wall seconds of the held-out evaluation after the step (steps with an evaluation only), on
    the trainer or the samplers (``--run.eval_on``); the next step's ``time_s`` includes them."""
    lengths: BatchLengths | None = None
    """The batch by completion length and by token version lag (``length_*``, ``token_lag_*``,
    ``spanning_groups``; observe/lengths.py)."""
    dropped_lengths: dict[str, int] | None = None
    """Completions of the groups dropped as stale so far (this run segment), by length bucket."""

    FLAT = frozenset({"sync", "train", "task", "fleet", "heldout_task", "lengths"})

    def to_dict(self) -> dict[str, Any]:
        """The record as the JSON object of its metrics.jsonl line (see the module docstring)."""
        out: dict[str, Any] = {}
        for key, value in msgspec.to_builtins(self).items():
            if key in self.FLAT:
                out.update((k, v) for k, v in value.items() if v is not None)  # a delta sync's keys
            else:
                out[key] = value
        return out

    def to_json(self) -> str:
        """The record's metrics.jsonl line (without its newline). json, not msgspec.json: a NaN
        stays ``NaN``, as the readers of the file have always had it."""
        return json.dumps(self.to_dict())

    def scalars(self) -> dict[str, float]:
        """Every finite number of the record, for TensorBoard, W&B and Prometheus (`scalars_of`)."""
        return scalars_of(self.to_dict())


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """Every finite number of a metrics record, nested dicts as ``key/inner`` (the staleness
    histogram as ``staleness_hist/1``); lists (group ids) and text (digests) are not scalars."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            for inner, v in scalars_of(value).items():
                out[f"{key}/{inner}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out
