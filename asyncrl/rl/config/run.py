"""The run section (``--run.*``): the schedule of the loop, and four sub-sections grouped by what
they are about: the data split, checkpoints, deadlines and sampler recovery.

The sub-sections are *flat* (``flat_section``): on the command line, in ``--help`` and in
config.json their keys sit directly under ``run`` (``--run.sync_timeout_s``, as always), while
code reads ``config.run.deadlines.sync_timeout_s`` and hands a component only the section it
needs (the pool its deadlines, a sampler its data split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncrl.rl.config.observe import ObserveConfig
from asyncrl.rl.config.tree import flat_section


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The train and held-out splits of the task's problems."""

    n_train: int = 50000
    """Problems in the train split (a run of the default length sees most of them once, so the
    train solve rate is measured on problems new to the policy)."""
    n_heldout: int = 500
    """Problems in the held-out split (never trained on; at most the warm start's heldout_reserve,
    unless they come from --task.heldout_data)."""
    data_seed: int = 0
    """Seed of the train and held-out splits. With the embedded model it must be the warm start's
    ``data_seed``: that is the split whose held-out problems the warm start never saw."""

    def __post_init__(self) -> None:
        for name in ("n_train", "n_heldout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Resumable checkpoints in the run directory."""

    checkpoint_every: int = 50
    """Write a resumable checkpoint (policy, optimiser, RNGs, step, weight version, data position)
    to run_dir/checkpoints every this many steps (0: none). Resume with ``--resume RUN_DIR``."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept, the newest; older ones are deleted after each write."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, not {self.checkpoint_every!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, not {self.keep_checkpoints!r}")


@dataclass(frozen=True, kw_only=True)
class DeadlineConfig:
    """How long the driver waits for each kind of work, and who is blamed when it overruns."""

    generate_timeout_s: float = 600.0
    """Deadline of a sampler's next rollout group (or held-out part) while the driver waits for
    it, counted from its last group or its last token decoded, whichever came later: a long
    completion is waited out while its engine decodes. A sampler that overruns it is lost (killed,
    restarted, rejoined) and the run goes on."""
    queue_timeout_s: float = 1800.0
    """Deadline of a step's batch from all samplers together (longer than generate_timeout_s, so a
    stuck sampler is replaced first); overrun: the run stops, naming each sampler's state."""
    train_timeout_s: float = 900.0
    """Deadline of one train step on the trainer; overrun: the run stops."""
    sync_timeout_s: float = 300.0
    """Deadline of a weight sync (and of agreeing on the layout) on every member; a sampler that
    does not finish it in time is lost, a trainer that does not stops the run."""
    eval_timeout_s: float = 3600.0
    """Deadline of one held-out evaluation, on the trainer or on the samplers (a sampler's shard
    and what the others or the trainer take over from a lost one included); overrun: the run stops."""
    checkpoint_timeout_s: float = 600.0
    """Deadline of writing a checkpoint (or the final policy); overrun: the run stops."""
    rendezvous_timeout_s: float = 120.0
    """Deadline of forming, or rebuilding, the weight-sync group."""

    def __post_init__(self) -> None:
        for name in (
            "generate_timeout_s",
            "queue_timeout_s",
            "train_timeout_s",
            "sync_timeout_s",
            "eval_timeout_s",
            "checkpoint_timeout_s",
            "rendezvous_timeout_s",
        ):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, not {getattr(self, name)!r}")
        if self.generate_timeout_s >= self.queue_timeout_s:
            raise ValueError(
                f"generate_timeout_s ({self.generate_timeout_s:g}) must be shorter than queue_timeout_s "
                f"({self.queue_timeout_s:g}): a stuck sampler is replaced before the run gives up"
            )


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """What happens to a lost sampler."""

    sampler_max_restarts: int = 3
    """Times the supervisor restarts a lost sampler; each replacement rejoins the weight-sync group
    and takes the current weights before it generates. A sampler lost while it first starts is
    started again from the same budget; one that never comes up is left out of the run."""
    restart_timeout_s: float = 300.0
    """How long a lost sampler's restart is awaited before it counts as gone for good."""

    def __post_init__(self) -> None:
        if self.sampler_max_restarts < 0:
            raise ValueError(f"sampler_max_restarts must be >= 0, not {self.sampler_max_restarts!r}")
        if not (math.isfinite(self.restart_timeout_s) and self.restart_timeout_s > 0):
            raise ValueError(f"restart_timeout_s must be a finite number > 0, not {self.restart_timeout_s!r}")


EVAL_PLACES = ("auto", "trainer", "samplers")
"""The values of ``--run.eval_on``."""
SYNC_DELTA = ("auto", "on", "off")
"""The values of ``--run.sync_delta``."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The loop: how long it runs, how batches are made and weights synced, when it evaluates,
    where it writes; its data split, checkpoints, deadlines and sampler recovery are flat
    sub-sections (their keys are ``--run.*`` too)."""

    steps: int = 500
    """Optimiser steps to take."""
    groups_per_step: int = 16
    """Prompts (groups of ``sampler.group_size`` completions) in one training batch."""
    mode: str = "async"
    """'async': samplers generate continuously; 'sync': generate, then train, then sync (baseline)."""
    max_staleness: int | None = None
    """Async mode: train on groups at most this many weight versions old; older ones are dropped.
    None (auto): 2 where the samplers have GPUs of their own, so their next step's rollouts begin
    before the trainer's step ends (at 1.5B on two GPUs, 2 beat 1 clearly: docs/gpu.md), and on a
    GPU shared with the trainer when completions may run to 4,096 tokens or more (``LONG_COMPLETIONS``),
    so the engine decodes two steps' groups at once (docs/grpo.md, "Long generations"); else 1;
    at least ``sync_every - 1`` either way. The run's log says what it resolved to."""
    queue_capacity: int = 0
    """Rollout queue bound in groups (0: two batches). Samplers wait when it is full."""
    skip_uniform_groups: bool = True
    """Leave out a group whose completions all scored the same (its advantages are all zero, so it
    moves the policy by nothing but the KL term) and let the samplers make another in its place
    (DAPO's dynamic sampling); at most groups_per_step are left out per batch, so a task that gives
    no signal still trains. Counted as uniform_skipped."""
    sync_every: int = 1
    """Send the weights to the samplers after every this many steps."""
    sync_delta: str = "auto"
    """'on': the trainer keeps the weights every sampler last took (one copy in the wire's dtype)
    and sends each bucket as its changed elements where that is smaller, bit-exact
    (docs/weight_sync.md, "Delta syncs"); a sampler that missed a version gets a full sync.
    'off': every sync sends everything. 'auto': 'on' where a sampler sits on another host than
    the trainer (a network link, where bytes cost), else 'off'."""
    eval_every: int = 100
    """Held-out solve rates every this many steps (and before the first and after the last)."""
    eval_samples: int = 4
    """Sampled completions per held-out problem for the sampled solve rate (0: greedy only)."""
    eval_on: str = "auto"
    """Where the held-out evaluations run: 'trainer' (``model.generate`` in the trainer's process),
    'samplers' (each sampler in the weight-sync group solves a shard of the problems on its own
    engine, beside its rollouts; a lost sampler's rest goes to the others, or to the trainer), or
    'auto': the samplers when they run vLLM on a GPU, else the trainer."""
    seed: int = 0
    """Seed of the samplers and the trainer (runs that differ only in it share the problems)."""
    run_dir: str = ""
    """Where config.json, metrics.jsonl and checkpoints go (default: runs/grpo-<time>)."""
    device: str = "auto"
    """'auto' (GPUs when there are any: one each for trainer and samplers when there are enough,
    else the samplers share the trainer's; the CPU when there are none), 'cpu' or 'cuda' (docs/gpu.md)."""
    placement: str = "node0"
    """Which node each actor runs on when the run spans nodes (``asyncrl launch --nnodes N``;
    docs/multinode.md): 'node0' (the driver's node; an actor with GPUs on the first node with one
    free), 'spread' (trainer ranks on node 0, samplers round robin over the other nodes), or node
    ranks per role, e.g. 'trainer=1 sampler=0,1' (a role's actors take its listed nodes in turn;
    a role left out goes where 'node0' puts it)."""
    check_weights: bool = False
    """After every sync, compare a digest of the weights on the trainer and on every sampler; a
    mismatch stops the run (tests and debugging: one pass over the weights per member and sync).
    vLLM samplers on a GPU are digested in their engine; on the CPU, where vLLM repacks the
    weights, a run with them is refused at the start."""
    data: DataConfig = flat_section(DataConfig)
    """The train and held-out splits."""
    checkpoints: CheckpointConfig = flat_section(CheckpointConfig)
    """Resumable checkpoints."""
    deadlines: DeadlineConfig = flat_section(DeadlineConfig)
    """Deadlines of every kind of work the driver waits for."""
    recovery: RecoveryConfig = flat_section(RecoveryConfig)
    """Restarts of lost samplers."""
    observe: ObserveConfig = flat_section(ObserveConfig)
    """TensorBoard, W&B, curves.png, the progress bar, the Prometheus endpoint."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', not {self.mode!r}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, not {self.eval_samples!r}")
        if self.eval_on not in EVAL_PLACES:
            raise ValueError(f"eval_on must be one of {', '.join(EVAL_PLACES)}, not {self.eval_on!r}")
        if self.sync_delta not in SYNC_DELTA:
            raise ValueError(f"sync_delta must be one of {', '.join(SYNC_DELTA)}, not {self.sync_delta!r}")
        for name in ("steps", "groups_per_step", "sync_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)!r}")
        for name in ("max_staleness", "queue_capacity"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        if self.mode == "async" and self.max_staleness is not None and self.sync_every > self.max_staleness + 1:
            # The freshest group a step could get is sync_every - 1 versions old: every one would be dropped.
            raise ValueError(
                f"sync_every {self.sync_every} needs max_staleness >= {self.sync_every - 1} in async mode "
                f"(not {self.max_staleness}): between syncs the samplers' weights fall up to "
                f"{self.sync_every - 1} versions behind, and every group they made would be dropped as stale"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        Placement.parse(self.placement)

    def staleness_bound(self, samplers_apart: bool = False, long_on_gpu: bool = False) -> int:
        """``max_staleness``, its None (auto) resolved: 2 where the samplers have GPUs of their own
        (``samplers_apart``) or share one with the trainer at long completions (``long_on_gpu``),
        else 1, and at least ``sync_every - 1``."""
        if self.max_staleness is not None:
            return self.max_staleness
        return max(AUTO_STALENESS_ROOMY if samplers_apart or long_on_gpu else 1, self.sync_every - 1)


AUTO_STALENESS_ROOMY = 2
"""``--run.max_staleness`` auto where generation bounds the step at 1. Samplers with GPUs of their
own: a step's rollouts cannot begin before the last step's weights. A GPU shared with the trainer
at long completions: the pacer's room (a sampler's streams follow it) holds one step's groups in
the engine, too few sequences to decode a step's long tail in the time of a train step."""

PLACEMENT_ROLES = ("trainer", "sampler")


@dataclass(frozen=True)
class Placement:
    """``--run.placement``, read: the node ranks each role's actors take in turn (None: where the
    supervisor puts an actor by default, node 0 for one without devices)."""

    trainer: tuple[int, ...] = ()
    sampler: tuple[int, ...] = ()
    spread: bool = False
    """Samplers round robin over nodes 1..N-1 (node 0 when it is alone); trainer ranks on node 0."""

    @classmethod
    def parse(cls, text: str) -> Placement:
        """'node0', 'spread' or 'trainer=0,0 sampler=1'; a ValueError says what is accepted."""
        words = text.split()
        if words == ["node0"]:
            return cls()
        if words == ["spread"]:
            return cls(trainer=(0,), spread=True)
        lists: dict[str, tuple[int, ...]] = {}
        for word in words:
            role, _, nodes = word.partition("=")
            ranks = [n.strip() for n in nodes.split(",")]
            if role not in PLACEMENT_ROLES or role in lists or not all(n.isdigit() for n in ranks):
                raise ValueError(
                    f"placement must be 'node0', 'spread' or node ranks per role such as "
                    f"'trainer=0 sampler=1,0' (roles: {', '.join(PLACEMENT_ROLES)}), not {text!r}"
                )
            lists[role] = tuple(int(n) for n in ranks)
        if not lists:
            raise ValueError(f"placement must be 'node0', 'spread' or node ranks per role, not {text!r}")
        return cls(trainer=lists.get("trainer", ()), sampler=lists.get("sampler", ()))

    def nodes(self, role: str, count: int, nnodes: int) -> list[int | None]:
        """The node of each of ``count`` actors of ``role`` in a cluster of ``nnodes``; a ValueError
        names a node rank the cluster does not have."""
        if role == "sampler" and self.spread:
            others = list(range(1, nnodes)) or [0]
            return [others[i % len(others)] for i in range(count)]
        listed: tuple[int, ...] = getattr(self, role)
        for rank in listed:
            if rank >= nnodes:
                raise ValueError(
                    f"--run.placement puts a {role} on node {rank}, but the run has {nnodes} node(s) "
                    f"(0..{nnodes - 1}); launch with --nnodes {rank + 1} or more, or change the placement"
                )
        return [listed[i % len(listed)] if listed else None for i in range(count)]
