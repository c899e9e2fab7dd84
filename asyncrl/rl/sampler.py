"""Samplers: the backend interface, its request/result types, and the sampler actor.

A `SamplerBackend` turns token-id prompts into completions with per-token log-probs and can be
paused while its weights are replaced in place. `HFBackend` (in ``hf_backend.py``, importable from
here) runs transformers on CPU or GPU; `VLLMBackend` (``vllm_backend.py``) drives vLLM's
``AsyncLLM``, whose own worker process receives the weights (`SamplerBackend.receives_in_engine`).
`choose_backend` resolves ``"auto"``. `SamplerActor` walks the Countdown train split, generates
``group_size`` completions per prompt continuously, scores them and streams one `RolloutGroup` per
prompt, each tagged with the weight version it was generated under (the oldest one, when weights
changed in flight); the trainer's weights arrive through `receive_weights`.
"""

from __future__ import annotations

import abc
import asyncio
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import msgspec
import torch

from asyncrl.comm.member import SyncMember
from asyncrl.errors import AsyncrlError
from asyncrl.rl.checkpoint import CountedWalk, SamplerDataState, tensor_digest
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.runtime.actor import endpoint
from asyncrl.runtime.timeouts import timeout


class SamplerError(AsyncrlError):
    """Base class of the sampler's own errors."""


class SamplerClosedError(SamplerError):
    """``generate`` on a backend that was closed."""


class SamplerTimeoutError(SamplerError, TimeoutError):
    """A pause, a resume or a weight sync did not happen within its deadline; the message says which."""


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample. ``temperature == 0`` is greedy; ``seed`` makes a call reproducible (each
    completion gets its own generator seeded from ``(seed, prompt index, sample index)``)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = []
    seed: int | None = None
    stop: list[str] = []
    """Stop strings (vLLM backend only: the HF backend refuses them). The completion ends once its
    text contains one; ``text`` then ends before it, ``token_ids`` keep every token sampled."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0: greedy), not {self.temperature!r}")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, not {self.stop_token_ids!r}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 or None, not {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


class Completion(msgspec.Struct, frozen=True):
    """One sampled continuation of a prompt (prompt tokens not included).

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution it was
    actually drawn from: ``log_softmax(logits / temperature)``, restricted to the top-p nucleus and
    renormalised when ``top_p < 1``. The trainer recomputes log-probs with the same temperature;
    with ``top_p < 1`` the two differ by the log of the nucleus mass (the behaviour policy really
    is the truncated one). For greedy (``temperature == 0``) they are ``log_softmax(logits)``.
    A stop token ends the completion, is included in ``token_ids`` and has its log-prob;
    ``finish_reason`` is ``"stop"`` then, ``"length"`` when ``max_new_tokens`` ran out. ``text`` is
    the decoding of ``token_ids`` without the stop token, special tokens skipped (as the held-out
    evaluation reads completions, so rewards and solve rates score the same text).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class SamplerBackend(abc.ABC):
    """What a sampler actor needs from an inference engine.

    Weights reach a backend in one of two ways. By default (``receives_in_engine`` False) the
    sampler actor's own process joins the weight-sync group and copies each sync into
    `weight_tensors` through `load_weights`. An engine that keeps the model in a process of its
    own (vLLM's worker) sets ``receives_in_engine`` and implements the ``*_weight_sync`` hooks
    below: that process joins the group and takes the buckets straight off the communicator, and
    the actor only forwards small control values (addresses, ranks, versions) to it.
    """

    receives_in_engine: bool = False

    @abc.abstractmethod
    async def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions for each prompt, in prompt order. While paused, waits for `resume`."""

    @abc.abstractmethod
    def weight_tensors(self) -> Mapping[str, torch.Tensor]:
        """The tensors a `WeightReceiver` copies into in place (named like the trainer's
        ``dict(model.named_parameters())``). Only to be written while paused."""

    @abc.abstractmethod
    async def load_weights(self, load: Callable[[Mapping[str, torch.Tensor]], object], *, in_flight: bool = False,
                           timeout_s: float = 600.0) -> None:
        """Run ``load(weight_tensors())`` (blocking; on a worker thread) when no generation reads
        the weights: after the generates in flight finished (``in_flight=False``; none starts
        meanwhile), or between two decoding steps of them (``in_flight=True``: they go on with
        the new weights). `SamplerTimeoutError` if that moment does not come within ``timeout_s``
        (weights untouched); what ``load`` raises propagates."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """From now on no generate starts; returns once the ones in flight have finished."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Let generates start again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; later generates raise `SamplerClosedError`."""

    # --- weight sync inside the engine (only where ``receives_in_engine``) -----------------------

    async def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, *, generation: int,
                               backend: str, timeout_s: float, name: str) -> str:
        """Have the engine join the group whose store rank 0 hosts at ``host:port`` (see
        `SyncMember.sync_join`), leaving any previous one. Returns the communicator's backend."""
        raise NotImplementedError(f"{type(self).__name__} receives weights in the sampler actor")

    async def setup_weight_receiver(self, timeout_s: float) -> int:
        """Agree on the weight layout with the sender (`WeightReceiver.create` in the engine).
        Returns the bucket count."""
        raise NotImplementedError(f"{type(self).__name__} receives weights in the sampler actor")

    async def receive_weights(self, version: int, *, in_flight: bool, timeout_s: float) -> float:
        """Take sync ``version`` in the engine, with `load_weights`'s contract for ``in_flight``
        and ``timeout_s`` (`SamplerTimeoutError`: weights untouched). Returns the seconds spent
        waiting for the moment to load (the pause)."""
        raise NotImplementedError(f"{type(self).__name__} receives weights in the sampler actor")

    async def leave_weight_sync(self) -> None:
        """Drop the engine's communicator and store handle. Idempotent; a no-op once closed."""
        raise NotImplementedError(f"{type(self).__name__} receives weights in the sampler actor")

    async def communicators_created(self) -> dict[str, int]:
        """Communicators the engine's process created, per backend."""
        raise NotImplementedError(f"{type(self).__name__} receives weights in the sampler actor")


BACKENDS = ("auto", "vllm", "hf")


def choose_backend(name: str, device: torch.device) -> str:
    """``"vllm"`` or ``"hf"``. ``"auto"`` is vLLM when it imports and supports ``device``'s kind
    (a CPU build for CPU, a CUDA build for a GPU), else Hugging Face; an explicit ``"vllm"`` that
    is not usable raises `SamplerError` saying why."""
    if name not in BACKENDS:
        raise ValueError(f"sampler backend must be one of {BACKENDS}, not {name!r}")
    if name == "hf":
        return "hf"
    from asyncrl.rl.vllm_backend import vllm_unusable

    why = vllm_unusable(device)
    if not why:
        return "vllm"
    if name == "vllm":
        raise SamplerError(f"sampler backend vllm was asked for, but {why}")
    return "hf"


class PausableBackend(SamplerBackend):
    """The pause/resume bookkeeping every backend shares. A subclass sets ``_paused = False``,
    ``_inflight = 0``, ``_resumed = _idle = None``, ``_closed = False`` and ``resume_timeout_s`` in
    its ``__init__``; its ``generate`` calls ``_events()``, waits with ``_wait_resumed()`` when
    ``_paused`` (with no ``await`` before that check when not paused), counts itself in
    ``_inflight`` (clearing ``_idle``) and calls ``_finished()`` when its work is really done."""

    async def pause(self, timeout_s: float = 600.0) -> None:
        """Stop new generates from starting and wait for those in flight. On timeout the pause is
        undone (it either holds with nothing in flight, or has no effect) and this raises."""
        self._events()
        self._paused = True
        self._resumed.clear()
        try:
            async with timeout(timeout_s):  # wait_for on 3.11 can swallow a cancel
                await self._idle.wait()
        except TimeoutError:
            await self.resume()
            raise SamplerTimeoutError(f"pause: the generates in flight did not finish within {timeout_s:g} s") from None
        except BaseException:
            await self.resume()
            raise

    async def resume(self) -> None:
        self._events()
        self._paused = False
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def _events(self) -> None:
        if self._resumed is None:  # made on first use, on the actor's loop
            self._resumed, self._idle = asyncio.Event(), asyncio.Event()
            self._resumed.set()
            self._idle.set()

    async def _wait_resumed(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.resume_timeout_s
        while self._paused:  # re-checked after each wake-up: a new pause may have begun since
            try:
                async with timeout(max(deadline - loop.time(), 0.0)):  # not wait_for: see pause
                    await self._resumed.wait()
            except TimeoutError:
                raise SamplerTimeoutError(f"generate: backend still paused after {self.resume_timeout_s:g} s") from None
            if self._closed:
                raise SamplerClosedError(f"{type(self).__name__} was closed while paused")

    def _finished(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()


def __getattr__(name: str) -> Any:
    # HFBackend lives in hf_backend.py, which imports this module: load it on first use.
    if name == "HFBackend":
        from asyncrl.rl.hf_backend import HFBackend

        return HFBackend
    if name == "VLLMBackend":
        from asyncrl.rl.vllm_backend import VLLMBackend

        return VLLMBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SamplerActor(SyncMember):
    """Generates Countdown rollouts continuously and takes weights from the trainer (rank 0).

    ``name`` tags the groups; empty means the actor's own name in the runtime. ``sampling`` None
    means ``fmt.max_new_tokens_hint`` tokens at temperature 1; empty ``stop_token_ids`` are filled
    with the model format's. ``n_heldout_problems`` must match the driver's held-out size: the
    train split excludes the held-out keys, so it depends on it. ``cpu_threads`` > 0 sets torch's
    intra-op threads (0: torch's default); on CPU, give each process no more threads than cores
    it has to itself: oversubscribed OpenMP threads spin and slow a small model tenfold or more.
    ``weight_update``: "pause" (a sync waits for the batch in flight, so every group is sampled
    under one version) or "in_flight" (a sync goes in between two decoding steps; the batch in
    flight finishes on the new weights and is tagged with the version it began under).
    ``backend``: "hf", "vllm", or "auto" (vLLM when it is usable here, see `choose_backend`);
    ``vllm`` holds extra keyword arguments of `VLLMBackend` (e.g. ``gpu_memory_utilization``).
    """

    def __init__(self, model_path: str, *, name: str = "", device: str = "cpu", seed: int = 0,
                 countdown: dict = {}, n_train_problems: int = 2000, n_heldout_problems: int = 100,
                 split_seed: int = 0, group_size: int = 8, prompts_per_batch: int = 8,
                 sampling: SamplingParams | None = None, sync_timeout_s: float = 120.0, cpu_threads: int = 0,
                 weight_update: str = "pause", backend: str = "hf", vllm: dict = {}):
        from asyncrl.rl.countdown import CountdownConfig, train_and_heldout

        for what, value in (("group_size", group_size), ("prompts_per_batch", prompts_per_batch),
                            ("n_train_problems", n_train_problems)):
            if value < 1:
                raise ValueError(f"{what} must be >= 1, not {value}")
        if weight_update not in ("pause", "in_flight"):
            raise ValueError(f"weight_update must be 'pause' or 'in_flight', not {weight_update!r}")
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be > 0, not {sync_timeout_s!r}")
        self.name = name or os.environ.get("ASYNCRL_ACTOR", "") or "sampler"
        self.group_size, self.prompts_per_batch = group_size, prompts_per_batch
        self.sync_timeout_s = sync_timeout_s
        self.in_flight = weight_update == "in_flight"
        self.device = _actor_device(device)
        if cpu_threads > 0:
            torch.set_num_threads(cpu_threads)
        self.model_path, self.vllm_options = model_path, dict(vllm)
        self.backend_name = choose_backend(backend, self.device)
        print(f"sampler {self.name}: {self.backend_name} backend (asked for {backend!r})", flush=True)
        model, tokenizer, self.fmt = self._load_policy(model_path, self.device)
        self.backend: SamplerBackend = self._make_backend(model, tokenizer, seed)
        self.sampling = _resolve_sampling(sampling, self.fmt)
        self.problems, _ = train_and_heldout(split_seed, n_train_problems, n_heldout_problems,
                                             CountdownConfig(**countdown))
        self._order = _walk(len(self.problems), random.Random(f"sampler/{seed}"))
        self._prompt_ids: dict[int, list[int]] = {}
        self.version = 0
        self.receiver = None
        self._ready = asyncio.Event()  # clear during a weight sync, and after a failed one until one succeeds
        self._ready.set()
        self._sync_lock = asyncio.Lock()
        self._stats = {"tokens": 0, "groups": 0, "completions": 0, "batches": 0, "generate_s": 0.0,
                       "weight_sync_s": 0.0, "pause_s": 0.0, "syncs": 0, "failed_syncs": 0,
                       "syncs_waited_for_generate": 0, "discarded_batches": 0}
        self._failures = 0  # failed syncs so far: a batch that saw one in flight is discarded
        self._generating = 0  # backend.generate calls in flight (rollouts and the generate endpoint)

    # --- construction hooks (a test or another engine overrides these) --------------------------

    def _load_policy(self, model_path: str, device: torch.device) -> tuple[Any, Any, Any]:
        if self.backend_name == "vllm":  # the engine loads the model itself: only the tokenizer here
            from asyncrl.rl.model import load_prompt_format

            tokenizer, fmt = load_prompt_format(model_path)
            return None, tokenizer, fmt
        from asyncrl.rl.model import load_policy  # transformers is heavy: import in the actor only

        return load_policy(model_path, device, torch.float32)

    def _make_backend(self, model: Any, tokenizer: Any, seed: int) -> SamplerBackend:
        if self.backend_name == "vllm":
            from asyncrl.rl.vllm_backend import VLLMBackend

            options = {"prefix_caching": not self.in_flight} | self.vllm_options
            return VLLMBackend(self.model_path, tokenizer=tokenizer, seed=seed, device=self.device,
                               resume_timeout_s=3 * self.sync_timeout_s, **options)
        from asyncrl.rl.hf_backend import HFBackend

        return HFBackend(model, tokenizer=tokenizer, seed=seed, resume_timeout_s=3 * self.sync_timeout_s)

    # --- endpoints ------------------------------------------------------------------------------

    @endpoint
    async def rollouts(self, max_groups: int = 0) -> AsyncIterator[RolloutGroup]:
        """One scored group per prompt, ``max_groups`` of them (0: until the caller stops). A
        consumer that stops reading pauses generation (the stream's credit window). Prompts are
        generated ``prompts_per_batch`` at a time; ``generate_s`` is the wall time of the group's
        batch, ``version`` the weight version the whole batch was sampled under."""
        from asyncrl.rl.countdown import reward

        produced = 0
        while max_groups <= 0 or produced < max_groups:
            count = self.prompts_per_batch if max_groups <= 0 else min(self.prompts_per_batch, max_groups - produced)
            indices = [next(self._order) for _ in range(count)]
            prompts = [self._prompt(i) for i in indices]
            version, groups, seconds = await self._generate(prompts)
            finished = time.time()
            for index, prompt, completions in zip(indices, prompts, groups):
                problem = self.problems[index]
                yield RolloutGroup(
                    prompt_id=index, prompt_ids=prompt,
                    completion_ids=[c.token_ids for c in completions],
                    behaviour_logprobs=[c.logprobs for c in completions],
                    rewards=[reward(problem, c.text) for c in completions],
                    version=version, sampler=self.name, generate_s=seconds, finished_at=finished)
                self._stats["groups"] += 1
                produced += 1

    @endpoint
    async def generate(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None) -> list[list[Completion]]:
        """Raw completions from the backend, for evaluation and tests (not counted in stats)."""
        self._generating += 1
        try:
            return await self.backend.generate(prompts, n, params or self.sampling)
        finally:
            self._generating -= 1

    # SyncMember's endpoints, routed to the engine when it receives the weights itself: `form_group`
    # then puts the engine's process in the group, and this process never holds a communicator.

    @endpoint
    async def sync_join(self, host: str, port: int, rank: int, world_size: int, generation: int = 0,
                        backend: str = "auto", timeout_s: float = 60.0, name: str = "weights") -> str:
        """Join the trainer's weight-sync group (in the engine's process when it receives there)."""
        if not self.backend.receives_in_engine:
            return await super().sync_join(host, port, rank, world_size, generation, backend, timeout_s, name)
        self.receiver = None
        return await self.backend.join_weight_sync(host, port, rank, world_size, generation=generation,
                                                   backend=backend, timeout_s=timeout_s, name=name)

    @endpoint
    async def sync_leave(self) -> None:
        """Leave the weight-sync group. Idempotent."""
        self.receiver = None
        if self.backend.receives_in_engine:
            await self.backend.leave_weight_sync()
        await super().sync_leave()

    @endpoint
    async def sync_created(self) -> dict[str, int]:
        """Communicators created for weight sync, per backend (in the engine's process if it receives)."""
        if self.backend.receives_in_engine:
            return await self.backend.communicators_created()
        return await super().sync_created()

    @endpoint
    async def setup_receiver(self, timeout_s: float = 60.0) -> int:
        """After `form_group`: agree on the weight layout with the trainer. Returns the bucket count."""
        from asyncrl.comm.weights import WeightReceiver

        if self.backend.receives_in_engine:
            buckets = await self.backend.setup_weight_receiver(timeout_s)
            self.receiver = "engine"  # receive_weights may go ahead
            return buckets
        if self.sync_comm is None:
            raise SamplerError(f"sampler {self.name}: setup_receiver before joining a weight-sync group")
        self.receiver = await asyncio.to_thread(WeightReceiver.create, self.sync_comm, self.sync_group, src=0,
                                                expect=self.backend.weight_tensors(), timeout_s=timeout_s)
        return len(self.receiver.layout.buckets)

    @endpoint
    async def receive_weights(self, version: int) -> float:
        """Take ``version`` in place: after the batch in flight (``weight_update="pause"``) or
        between two of its decoding steps ("in_flight"); no new batch starts until it is done.
        Returns the seconds it took. If the transfer fails the weights may be half-written:
        rollouts then wait for the next successful sync instead of sampling from them, and a
        batch that was in flight is discarded."""
        if self.receiver is None:
            raise SamplerError(f"sampler {self.name}: receive_weights before setup_receiver")
        # One deadline for the wait to load and the transfer, as on the trainer, whose side of
        # the sync starts at once: the driver waits for our answer only a grace beyond it, so a
        # transfer that got a whole sync_timeout_s of its own after a long pause would answer
        # (a peer's failure, as a collective error) after the driver had judged us frozen.
        deadline = time.monotonic() + self.sync_timeout_s
        async with self._sync_lock:
            start = time.perf_counter()
            self._ready.clear()  # no rollout batch may start from here on
            if self._generating and not self.in_flight:
                self._stats["syncs_waited_for_generate"] += 1
            waited = 0.0

            def load(tensors: Mapping[str, torch.Tensor]) -> None:
                nonlocal waited
                waited = time.perf_counter() - start
                self.receiver.receive(version, tensors, timeout_s=max(deadline - time.monotonic(), 1e-3))

            try:
                if self.backend.receives_in_engine:
                    waited = await self.backend.receive_weights(version, in_flight=self.in_flight,
                                                                timeout_s=self.sync_timeout_s)
                else:
                    await self.backend.load_weights(load, in_flight=self.in_flight,
                                                    timeout_s=max(deadline - time.monotonic(), 1e-3))
            except SamplerTimeoutError:  # the weights were not touched: sampling may go on
                self._ready.set()
                self._stats["failed_syncs"] += 1
                raise SamplerTimeoutError(
                    f"sampler {self.name}: no moment free of generation came within {self.sync_timeout_s:g} s "
                    f"({'a decoding step did not end' if self.in_flight else 'the batch in flight did not finish'}), "
                    "so the weights could not be taken") from None
            except BaseException:
                self._stats["failed_syncs"] += 1
                self._failures += 1
                raise
            finally:
                self._stats["pause_s"] += waited
            self.version = version
            self._ready.set()
            seconds = time.perf_counter() - start
            self._stats["weight_sync_s"] += seconds
            self._stats["syncs"] += 1
            return seconds

    @endpoint
    async def stats(self) -> dict:
        """Counters since start: ``tokens``, ``completions``, ``groups`` (yielded), ``batches``,
        ``generate_s`` (wall time in rollout generation) and ``tokens_per_s`` over it; weight syncs:
        ``syncs``, ``failed_syncs``, ``weight_sync_s`` (wait + transfer), ``pause_s`` (waiting for
        the batch in flight, or for the end of a decoding step), ``syncs_waited_for_generate``,
        ``discarded_batches`` (in flight during a failed sync); ``version`` now; ``name``;
        ``backend`` (``"hf"`` or ``"vllm"``)."""
        s = dict(self._stats)
        s.update(version=self.version, name=self.name, backend=self.backend_name,
                 tokens_per_s=s["tokens"] / s["generate_s"] if s["generate_s"] > 0 else 0.0)
        return s

    # --- resume and fault-tolerance hooks (asyncrl/rl/checkpoint.py, recovery.py) ---------------

    @endpoint
    async def data_state(self) -> SamplerDataState:
        """Prompts drawn from the data walk so far and the sampling RNG, for a checkpoint
        (the walk is counted once `restore_data_state` has installed it; -1 before)."""
        generator = getattr(self.backend, "_generator", None)  # backends without one resume with a fresh RNG
        return SamplerDataState(seed=getattr(self._order, "seed", -1), drawn=getattr(self._order, "drawn", -1),
                                generator=bytes(generator.get_state().numpy()) if generator is not None else b"")

    @endpoint
    async def restore_data_state(self, state: SamplerDataState) -> None:
        """Continue the walk of ``state.seed`` after ``state.drawn`` prompts, and set (or reseed)
        the sampling RNG. Before the first rollout only: a walk half-consumed by a stream would
        be skipped ahead under it."""
        self._order = CountedWalk(_walk(len(self.problems), random.Random(f"sampler/{state.seed}")), state.drawn)
        self._order.seed = state.seed
        generator = getattr(self.backend, "_generator", None)
        if generator is not None and state.generator:
            generator.set_state(torch.frombuffer(bytearray(state.generator), dtype=torch.uint8))
        elif generator is not None and state.generator_seed >= 0:
            generator.manual_seed(state.generator_seed)

    @endpoint
    async def weights_digest(self) -> str:
        """SHA-256 of the weights this sampler generates with (`checkpoint.tensor_digest`)."""
        if self.backend.receives_in_engine:
            raise SamplerError(f"sampler {self.name}: the weights live in the engine's process; no digest here")
        return await asyncio.to_thread(tensor_digest, self.backend.weight_tensors())

    async def on_stop(self) -> None:
        try:  # an engine that receives weights drops its communicator while it still can
            async with timeout(10.0):
                await self.sync_leave()
        except Exception as exc:  # a dead or stuck engine: close() below ends it all the same
            print(f"sampler {self.name}: leaving the weight-sync group on stop failed: {exc!r}", flush=True)
        self.backend.close()
        await super().on_stop()

    # --- helpers --------------------------------------------------------------------------------

    def _prompt(self, index: int) -> list[int]:
        ids = self._prompt_ids.get(index)
        if ids is None:
            ids = self._prompt_ids[index] = list(self.fmt.prompt_ids(self.problems[index]))
        return ids

    async def _generate(self, prompts: list[list[int]]) -> tuple[int, list[list[Completion]], float]:
        """Generate for ``prompts`` and return the weight version it began under (the oldest of
        its tokens). The version is read right before calling the backend, with no ``await`` in
        between: a `receive_weights` that begins later either waits for this batch (the backend
        registers it before its first await) or loads between its steps, and one under way has
        cleared ``_ready``, so we wait for it first. A batch in flight during a failed sync may
        have read half-written weights: it is discarded and generated again."""
        while True:
            await self._wait_ready()
            version, failures = self.version, self._failures
            start = time.perf_counter()
            self._generating += 1
            try:
                groups = await self.backend.generate(prompts, self.group_size, self.sampling)
            finally:
                self._generating -= 1
            seconds = time.perf_counter() - start
            self._stats["generate_s"] += seconds
            self._stats["batches"] += 1
            if self._failures != failures:
                self._stats["discarded_batches"] += 1
                continue
            self._stats["completions"] += sum(len(g) for g in groups)
            self._stats["tokens"] += sum(len(c.token_ids) for g in groups for c in g)
            return version, groups, seconds

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        bound = 2 * self.sync_timeout_s + 5  # a sync and most of the next, each within sync_timeout_s
        deadline = loop.time() + bound
        while not self._ready.is_set():  # re-checked after waking: another sync may have begun
            try:
                async with timeout(max(deadline - loop.time(), 0.0)):  # not wait_for: see pause
                    await self._ready.wait()
            except TimeoutError:
                raise SamplerTimeoutError(
                    f"sampler {self.name}: no successful weight sync within {bound:g} s (the last one failed "
                    "or is still under way); not sampling from weights that may be half-written") from None


def _walk(n: int, rng: random.Random) -> Iterator[int]:
    """Indices 0..n-1 in a fresh shuffled order per epoch, forever."""
    order = list(range(n))
    while True:
        rng.shuffle(order)
        yield from order


def _resolve_sampling(sampling: SamplingParams | None, fmt: Any) -> SamplingParams:
    if sampling is None:
        sampling = SamplingParams(max_new_tokens=int(fmt.max_new_tokens_hint))
    if not sampling.stop_token_ids:
        sampling = msgspec.structs.replace(sampling, stop_token_ids=list(fmt.stop_token_ids))
    return sampling


def _actor_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":  # the actor sees only its own GPU (CUDA_VISIBLE_DEVICES)
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    return dev
