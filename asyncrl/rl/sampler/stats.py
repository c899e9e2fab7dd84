"""`SamplerStats`: a sampler actor's answer to ``stats`` (its counters since start and what it runs
on). Torch-free: the driver reads it (where the evaluations run, the check of a backend, a stall's
line, the sign of life before a rebuild of the sync group) without loading the sampler."""

from __future__ import annotations

import msgspec


class SamplerStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Counters since start and the sampler's state now; as a dict (`msgspec.to_builtins`), the
    keys ``stats`` answered before it was typed, in the same order."""

    groups: int
    """Groups yielded."""
    tokens: int
    """Completion tokens of the rollout batches."""
    completions: int
    batches: int
    """Rollout batches generated."""
    generate_s: float
    """Wall time in rollout generation."""
    discarded_batches: int
    """Batches in flight during a failed sync, discarded."""
    weight_sync_s: float
    """Seconds of the syncs that succeeded: the wait and the transfer."""
    pause_s: float
    """Of those syncs: waiting for the batch in flight, or for the end of a decoding step."""
    syncs: int
    failed_syncs: int
    syncs_waited_for_generate: int
    loaded_adapters: int | None = None
    """LoRA adapters the vLLM engine holds (adapter-only LoRA syncs; None: no adapters served)."""
    kv_cache_tokens: int | None = None
    """vLLM: tokens its KV cache holds (None: not known)."""
    preemptions: int | None = None
    """vLLM with ``--sampler.engine_stats``: requests the engine took off to free KV cache (each is
    computed again later: a sign of more sequences in flight than the cache holds)."""
    kv_cache_peak: float | None = None
    """vLLM with ``--sampler.engine_stats``: the most of its KV cache in use at once, 0..1."""
    version: int
    """The weight version held now."""
    generating: int
    """Generate calls in flight now."""
    decoded: int = 0
    """Tokens decoded since start, those of calls in flight included (`SamplerBackend.tokens_decoded`):
    it moves while the engine decodes, so the driver waits out a long group, not a stuck sampler
    (``driver/fleet/decoding.py``). 0 where the backend cannot tell."""
    name: str
    backend: str
    """``"hf"`` or ``"vllm"``."""
    device: str
    """``"cpu"``, ``"cuda:0"``..."""
    weight_dtype: str
    """What its weights are held in: the dtype a sync is sent in (`WeightSink.weight_dtype`)."""
    tokens_per_s: float
    """``tokens`` over ``generate_s`` (0 before any generation)."""
    serves_evaluations: bool = False
    """An engine that batches requests itself, on a GPU: held-out evaluations run beside its
    rollouts (``--run.eval_on auto`` puts them there)."""
    batches_requests: bool = False
    """Its engine batches concurrent requests itself (`SamplerBackend.batches_requests`): its pump
    begins each group as soon as there is credit for it, not a whole batch at a time."""
    digestible: bool = True
    """Its weights can be read as they were sent (``--run.check_weights``; an engine that repacks
    them for its kernels cannot)."""
