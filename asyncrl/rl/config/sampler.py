"""The sampler section (``--sampler.*``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from asyncrl.rl.config.lengths import LONG_COMPLETIONS, LengthProfile

CPU_PROMPTS_PER_BATCH = 8
"""What ``prompts_per_batch`` 0 means on the CPU (and the least it means on a GPU)."""
MAX_AUTO_STREAMS = 8
"""The most paced streams ``streams`` 0 gives a sampler on a GPU."""
STAGE_MODES = ("auto", "on", "off")
"""``stage_weights``' values."""


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """The sampler actors: how many there are, what each generates at once, how, and how new weights
    reach it."""

    count: int = 0
    """Number of sampler actors. 0: auto, ``per_gpu`` on every GPU the trainer (and the scorers)
    leave, or one sharing the trainer's GPU where none is left; one on the CPU (driver/devices.py)."""
    per_gpu: int = 0
    """Samplers on GPUs of their own: how many (each an engine and its client process) share one
    GPU. 0: auto, 2 with ``count`` auto, else as few as the GPUs left allow for ``count``
    (driver/devices.py); 1 where ``--run.placement`` names the samplers' nodes or spreads them.
    An engine's client is one CPU core decoding each step's outputs, which leaves its GPU mostly
    idle; two engines on a GPU overlap their steps and keep it busier, four contend (docs/gpu.md
    has the figures). Their weights come in tiers: NCCL between GPUs,
    CUDA IPC within one (comm/tiered.py)."""
    clients_per_engine: int = 1
    """vLLM: samplers that share one engine (its weights and KV cache), each a client process of
    it; 1: an engine each. Samplers ``i - i % N`` .. share the engine of the first, which starts it
    and alone takes the weights; on GPUs N must divide ``per_gpu``. Where an engine's one client
    process is what bounds it, more clients feed it without a second copy of the weights
    (docs/vllm.md, "Clients of one engine"). Not with ``asyncrl scale``."""
    group_size: int = 8
    """Completions per prompt."""
    prompts_per_batch: int = 0
    """Prompts a sampler generates for at once (each ``group_size`` completions). 0: auto, 8 on the
    CPU (small batches keep a loaded CPU's weight syncs prompt) and on a GPU the sampler's share of
    a step, ``ceil(run.groups_per_step / count)``: every engine works on each step at once, and an
    engine fed its whole share at once generates it in about the time of one batch (docs/gpu.md)."""
    streams: int = 0
    """Async mode: batches of ``prompts_per_batch`` a sampler keeps in flight at once, each begun as
    pacing credit frees (docs/gpu.md); with an engine that batches concurrent calls (vLLM) the
    groups that ended are replaced at once, by a smaller batch. 0: auto, 1 on the CPU (one model on
    a few cores: a second batch would only slow the first) and on a GPU the sampler's share of the
    room the pacer allows, ``ceil(groups_per_step * max_staleness / (count * prompts_per_batch))``
    in [1, 8]: 1 with ``--run.max_staleness`` 1 (its auto on one GPU at short completions), 2 with 2
    (its auto where the samplers have GPUs of their own, or at long completions). Sync mode runs one
    batch at a time."""
    max_new_tokens: int = 0
    """Completion length limit (0: what the model suggests)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    weight_update: str = "in_flight"
    """How new weights enter a sampler: 'in_flight' (between two decoding steps of the batch being
    generated, which finishes on them) or 'pause' (after that batch finishes)."""
    stage_weights: str = "auto"
    """vLLM on a GPU: receive each sync into a copy of the weights beside the engine while it keeps
    decoding, and copy it in at the engine's next step, so the trainer's side of a sync waits for
    no decoding step (docs/vllm.md, "A sync"). 'on', 'off', or 'auto': where the copy takes at most
    1/16 of the GPU's memory (0.5B and 1.5B models on an 80 GB GPU; not 7B)."""
    backend: str = "auto"
    """Inference engine: 'vllm', 'hf' (transformers), or 'auto' (vLLM on a GPU where its CUDA build
    is installed, else hf, on the CPU too; each sampler logs which it picked). See docs/vllm.md."""
    gpu_memory_utilization: float = 0.0
    """vLLM on a GPU: the share of the GPU's memory each engine reserves (0: vLLM's default alone on
    a GPU; 0.3 split among the samplers when they share the trainer's GPU). See docs/gpu.md."""
    vllm_args: str = ""
    """vLLM: more engine arguments, a JSON object of ``AsyncEngineArgs`` fields (``'{"max_num_seqs":
    512}'``); they override asyncrl's own, but for tensor and pipeline parallelism (one worker a
    sampler: each needs its own rank in the weight-sync group)."""
    lengths: str = ""
    """Synthetic long generations (benchmarks with random-weight models, which never stop): every
    completion runs exactly a length drawn from this profile, 'uniform:N' or 'lognormal:N'
    (median N/4, capped at N; asyncrl/rl/config/lengths.py), its stop tokens ignored. Empty:
    lengths are the model's own."""
    engine_stats: bool | None = None
    """vLLM: keep the engine's statistics and count its preemptions (requests taken off the GPU
    for want of KV cache, computed again later) and its peak KV cache use: each step's record has
    them since the step before (``engine_preemptions``, ``engine_kv_cache_peak``), the sampler's
    stats and last log line the run's, and the first step with preemptions says so in a line.
    None (auto): on where completions may run to 4,096 tokens or more (``max_new_tokens``, or
    the ``lengths`` cap), where the cache fills and the GPU, not the sampler's CPU, bounds an
    engine step; off otherwise, as the counting costs a little of the sampler's CPU each step."""
    engine_start_timeout_s: float = 900.0
    """vLLM: how long a sampler's start may spend loading the model and building its engine before
    it counts as hung. A first start on a fresh GPU machine compiles the model (torch.compile) and
    captures CUDA graphs, minutes for a small model, more for a large one; later starts reuse
    vLLM's compile cache. The rest of a start still has ``asyncrl launch --start_timeout_s``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.engine_start_timeout_s) and self.engine_start_timeout_s > 0):
            raise ValueError(f"engine_start_timeout_s must be a finite number > 0, not {self.engine_start_timeout_s!r}")
        if self.weight_update not in ("in_flight", "pause"):
            raise ValueError(f"weight_update must be 'in_flight' or 'pause', not {self.weight_update!r}")
        if self.stage_weights not in STAGE_MODES:
            raise ValueError(f"stage_weights must be one of {', '.join(STAGE_MODES)}, not {self.stage_weights!r}")
        if self.backend not in ("auto", "vllm", "hf"):
            raise ValueError(f"backend must be 'auto', 'vllm' or 'hf', not {self.backend!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (0: the model's own limit), not {self.max_new_tokens!r}")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise ValueError(
                f"gpu_memory_utilization must be in [0, 1) (0: the default), not {self.gpu_memory_utilization!r}"
            )
        self.engine_args()  # a bad JSON object is refused with the config
        profile = LengthProfile.parse(self.lengths)
        if profile is not None and self.max_new_tokens and profile.cap > self.max_new_tokens:
            raise ValueError(
                f"lengths {self.lengths!r} reaches past max_new_tokens {self.max_new_tokens}: raise "
                "--sampler.max_new_tokens or lower the profile's N"
            )
        if self.per_gpu < 0:
            raise ValueError(f"per_gpu must be >= 0 (0: auto), not {self.per_gpu!r}")
        if self.clients_per_engine < 1:
            raise ValueError(f"clients_per_engine must be >= 1 (1: an engine each), not {self.clients_per_engine!r}")
        if self.clients_per_engine > 1 and self.backend == "hf":
            raise ValueError("clients_per_engine > 1 shares a vLLM engine: use --sampler.backend vllm (or auto)")
        if self.streams < 0:
            raise ValueError(f"streams must be >= 0 (0: auto), not {self.streams!r}")
        if self.count < 0 or self.group_size < 2 or self.prompts_per_batch < 0:
            raise ValueError(
                "need count >= 0 (0: auto), group_size >= 2 (GRPO compares within a group), "
                "prompts_per_batch >= 0 (0: auto)"
            )

    @property
    def length_limit(self) -> int:
        """The longest completion: ``max_new_tokens``, else the ``lengths`` profile's N (0: the
        model's own limit, not known here)."""
        profile = LengthProfile.parse(self.lengths)
        return self.max_new_tokens or (profile.cap if profile is not None else 0)

    @property
    def keeps_engine_stats(self) -> bool:
        """``engine_stats``, resolved: auto is on at long completions (`LONG_COMPLETIONS`)."""
        if self.engine_stats is not None:
            return self.engine_stats
        return self.length_limit >= LONG_COMPLETIONS

    def engine_args(self) -> dict:
        """``vllm_args`` as a dict ({} when empty); ValueError for anything but a JSON object."""
        if not self.vllm_args:
            return {}
        try:
            args = json.loads(self.vllm_args)
        except ValueError as exc:
            raise ValueError(f"vllm_args must be a JSON object of vLLM engine arguments ({exc})") from None
        if not isinstance(args, dict):
            raise ValueError(f"vllm_args must be a JSON object of vLLM engine arguments, not {self.vllm_args!r}")
        return args

    def batch_prompts(self, device: str, groups_per_step: int) -> int:
        """``prompts_per_batch``, with 0 (auto) resolved for samplers computing on ``device``."""
        if self.prompts_per_batch:
            return self.prompts_per_batch
        if device != "cuda":
            return CPU_PROMPTS_PER_BATCH
        return -(-groups_per_step // max(1, self.count))

    def paced_streams(self, device: str, groups_per_step: int, max_staleness: int) -> int:
        """``streams``, with 0 (auto) resolved for samplers computing on ``device``: on a GPU
        enough batches to fill this sampler's share of the ``groups_per_step * max_staleness``
        groups the pacer lets begin ahead (driver/pacing.py)."""
        if self.streams:
            return self.streams
        if device != "cuda":
            return 1
        share = groups_per_step * max_staleness / max(1, self.count)
        return min(MAX_AUTO_STREAMS, max(1, math.ceil(share / self.batch_prompts(device, groups_per_step))))
