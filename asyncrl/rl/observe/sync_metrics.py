"""A weight sync's phases in a step's record: where ``sync_s`` went, without a profiler.

The trainer's `send_weights` answers its `SyncStats` and each sampler's `receive_weights` its
`SamplerSyncStats`, each measured where the phase runs (``comm/phase_clock.py``: CUDA events on a
GPU, host time on CPU). `sync_record` turns the last successful sync's answers and the wall time
the driver saw into the step's ``sync_*`` metrics (docs/observability.md has the table):

* the trainer's side: ``sync_trainer_s`` (its whole send), ``sync_trainer_pack_s`` (packing and
  casting into the staging buffers), ``sync_trainer_transfer_s`` (on the wire) and
  ``sync_trainer_vote_s`` (the two votes: the first waits for every sampler to arrive, so a
  sampler's pause shows here too; the commit waits for what is still on the wire and for every
  sampler to apply its last bucket);
* the samplers' sides, each the largest over the samplers: ``sync_sampler_s`` (the whole
  receive), ``sync_sampler_pause_s`` (waiting for a moment free of generation),
  ``sync_sampler_transfer_s``, ``sync_sampler_load_s`` (unpacking into the model, the engine's
  ``load_weights`` and vLLM's prefix-cache reset included) and ``sync_sampler_resume_s``;
* ``sync_rpc_s``: the driver's wall time less the slowest member's own total (the calls' round
  trips and scheduling; a rebuild of the group, when the sync needed one, lands here too);
* ``sync_bytes``: what one sync moves to each sampler (in the wire's dtype);
* a delta sync's only (``--run.sync_delta``; left out of a step without one): ``sync_sent_bytes``,
  what it put on the wire, and ``sync_changed``, the fraction of the wire's values that changed;
* not of the sync, but carried by the samplers' answers to it, the one call each answers every
  step (``--sampler.engine_stats`` on vLLM; left out otherwise): ``engine_preemptions``, requests
  their engines preempted to free KV cache since their previous answer, and
  ``engine_kv_cache_peak``, the fullest KV cache meanwhile (0..1).

This module reads the answers' fields only; it imports neither torch nor the actors' packages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from asyncrl.comm.weights import SyncStats
    from asyncrl.rl.sampler.backend import SamplerSyncStats


class SyncPhases(msgspec.Struct, kw_only=True):
    """A step's weight sync by phase, in seconds (see the module docstring); every field is in
    every step's record, 0 where the step synced nothing."""

    sync_s: float
    """The driver's wall time of the sync (0: no sync this step)."""
    sync_trainer_s: float = 0.0
    """The trainer's whole send."""
    sync_trainer_pack_s: float = 0.0
    """Packing and casting into the trainer's staging buffers."""
    sync_trainer_transfer_s: float = 0.0
    """The trainer's time on the wire."""
    sync_trainer_vote_s: float = 0.0
    """The trainer's two votes (the first waits for every sampler to arrive)."""
    sync_sampler_s: float = 0.0
    """The slowest sampler's whole receive."""
    sync_sampler_pause_s: float = 0.0
    """The longest wait of a sampler for a moment free of generation."""
    sync_sampler_transfer_s: float = 0.0
    """The longest time of a sampler on the wire."""
    sync_sampler_load_s: float = 0.0
    """The longest unpacking into a sampler's model (load_weights, a prefix-cache reset)."""
    sync_sampler_resume_s: float = 0.0
    """The longest resume of a sampler's generation."""
    sync_rpc_s: float = 0.0
    """The driver's wall time less the slowest member's own total: round trips, a rebuild."""
    sync_bytes: float = 0.0
    """What one sync moves to each sampler, in the wire's dtype."""
    sync_sent_bytes: float | None = None
    """What a delta sync put on the wire (None, left out of the line: the sync was a full one)."""
    sync_changed: float | None = None
    """The fraction of the wire's values that changed since the last sync, in a delta sync."""
    engine_preemptions: int | None = None
    """Not a phase: what the samplers' answers to the sync carried of their engines since their
    previous one (vLLM with ``--sampler.engine_stats``; None, left out of the line, otherwise):
    requests preempted to free KV cache, all samplers together..."""
    engine_kv_cache_peak: float | None = None
    """...and the fullest KV cache of them at any moment, 0..1."""


DELTA_METRICS = ("sync_sent_bytes", "sync_changed")
"""The keys only a delta sync writes."""
ENGINE_METRICS = ("engine_preemptions", "engine_kv_cache_peak")
"""The keys only samplers that count their engine's statistics write."""
SYNC_METRICS = tuple(k for k in SyncPhases.__struct_fields__[1:] if k not in DELTA_METRICS + ENGINE_METRICS)
"""Every key `sync_record` always writes besides ``sync_s`` (a step without a sync has them all 0)."""


def sync_record(wall_s: float, trainer: SyncStats | None, samplers: Sequence[SamplerSyncStats]) -> SyncPhases:
    """The step's ``sync_*`` metrics from the driver's ``wall_s`` and the last successful sync's
    answers (``trainer`` None: no sync happened, everything but ``sync_s`` is 0)."""
    if trainer is None:
        return SyncPhases(sync_s=wall_s)

    def most(values: list[float]) -> float:
        return max(values, default=0.0)

    received = [s.receive for s in samplers if s.receive is not None]
    counted = [s for s in samplers if s.preemptions is not None]
    slowest = max(trainer.seconds, most([s.seconds for s in samplers]))
    return SyncPhases(
        sync_s=wall_s,
        sync_trainer_s=trainer.seconds,
        sync_trainer_pack_s=trainer.copy_s,
        sync_trainer_transfer_s=trainer.transfer_s,
        sync_trainer_vote_s=trainer.vote_s + trainer.commit_s,
        sync_sampler_s=most([s.seconds for s in samplers]),
        sync_sampler_pause_s=most([s.pause_s for s in samplers]),
        sync_sampler_transfer_s=most([r.transfer_s for r in received]),
        sync_sampler_load_s=most([s.load_s for s in samplers]),
        sync_sampler_resume_s=most([s.resume_s for s in samplers]),
        sync_rpc_s=max(wall_s - slowest, 0.0),
        sync_bytes=float(trainer.bytes),
        sync_sent_bytes=float(trainer.sent_bytes) if trainer.delta else None,
        sync_changed=trainer.changed if trainer.delta else None,
        engine_preemptions=sum(s.preemptions or 0 for s in counted) if counted else None,
        engine_kv_cache_peak=max(s.kv_cache_peak or 0.0 for s in counted) if counted else None,
    )


def preemption_line(step: int, phases: SyncPhases, streams: int) -> str:
    """What a step whose samplers' engines preempted requests says ("" where none did, or none
    counted): the KV cache holds fewer sequences than are in flight, each one preempted is computed
    again, and what keeps fewer in flight (``streams``: the paced batches each sampler keeps)."""
    if not phases.engine_preemptions:
        return ""
    if streams > 1:
        fix = f"--sampler.streams 1 keeps one step's groups in each engine instead of {streams}"
    else:
        fix = "a smaller --sampler.prompts_per_batch, or more of the GPU for it (--sampler.gpu_memory_utilization)"
    return (
        f"step {step}: the samplers' engines preempted {phases.engine_preemptions} request(s) since the sync "
        f"before (KV cache at most {phases.engine_kv_cache_peak or 0.0:.0%} full): more sequences in flight "
        f"than it holds, and each one preempted is computed again; {fix}"
    )
