"""The sampler backend interface (its request and result types are ``rl/generation.py``'s).

A `SamplerBackend` turns token-id prompts into completions with per-token log-probs and can be
paused; its `WeightSink` takes the trainer's weights in place, wherever the backend keeps them.
What differs between engines is said by the backend itself (`load`, `batches_requests`,
`warm_up`, `digestible_on`, `loaded_adapters`): the sampler actor asks, never compares a name.
`PausableBackend` is the pause/resume bookkeeping both implementations share (``hf.py``,
``vllm/backend.py``); `asyncrl.rl.sampler.factory.backend_class` picks the class, once. Nothing
here imports an implementation.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from asyncrl.comm.weights import SyncStats
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.sampler.errors import SamplerClosedError, SamplerTimeoutError
from asyncrl.runtime.timeouts import timeout

if TYPE_CHECKING:
    from asyncrl.comm.address import SyncAddress
    from asyncrl.comm.member import SyncSeat
    from asyncrl.rl.config.trainer import LoRAConfig
    from asyncrl.rl.model.policy import PromptFormat


@dataclass(frozen=True)
class BackendOptions:
    """How a backend is built (`SamplerBackend.load`), whichever it is."""

    device: torch.device
    seed: int = 0
    """The RNG of requests that name no seed."""
    in_flight: bool = False
    """Weights will be taken between decoding steps (vLLM then keeps no prefix cache, unless
    ``vllm`` says otherwise)."""
    resume_timeout_s: float = 600.0
    """How long a generate waits out a pause."""
    vllm: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of `VLLMBackend` (read by vLLM only), passed on as they are."""
    adapter: LoRAConfig | None = None
    """The policy carries these LoRA adapters, and weight syncs bring only them."""
    start_timeout_s: float = 0.0
    """What an engine that compiles as it starts may take (``--sampler.engine_start_timeout_s``;
    0: the supervisor's start deadline)."""


class SamplerSyncStats(msgspec.Struct, frozen=True):
    """Where one sampler's side of a weight sync went, in seconds (`WeightSink.receive`; the driver
    puts them in each step's record, ``rl/observe/sync_metrics.py``). Append new fields, with
    defaults, at the end only."""

    seconds: float = 0.0
    """The whole `SamplerActor.receive_weights`, from taking its sync lock to returning."""
    pause_s: float = 0.0
    """Waiting for a moment free of generation: the batch in flight to finish (pause mode), or
    the decoding step under way (in-flight mode)."""
    receive: SyncStats | None = None
    """The receiver's own side (in the process that receives: vLLM's engine worker for vLLM):
    its votes, ``transfer_s``, and ``copy_s``, the unpacking into the model (the engine's
    ``load_weights``, or vLLM's CPU reload, included)."""
    reset_s: float = 0.0
    """vLLM: resetting the prefix cache (prefixes cached under the old weights)."""
    resume_s: float = 0.0
    """Letting generation go on after the load."""
    call_s: float = 0.0
    """vLLM: the control call to the engine's worker beyond the worker's own receive
    (``collective_rpc``'s round trip and the engine's scheduling of it: in in-flight mode that is
    the wait for the decoding step under way, so ``pause_s`` is this too)."""
    preemptions: int | None = None
    """Not of the sync: what the sampler's engine did since its previous answer, carried on the
    one call it answers every step (`SamplerBackend.take_engine_window`; vLLM with
    ``--sampler.engine_stats``, else None): requests it preempted to free KV cache..."""
    kv_cache_peak: float | None = None
    """...and the most of its KV cache in use at once, 0..1."""

    @property
    def load_s(self) -> float:
        """The engine's load into its model: the receiver's copies and the prefix-cache reset."""
        return (self.receive.copy_s if self.receive is not None else 0.0) + self.reset_s


class WeightSink(abc.ABC):
    """Where a sampler's weight syncs land: its side of the weight-sync group. The backend owns
    it (`SamplerBackend.weight_sink`); the sampler's endpoints reach it through `WeightReceiving`,
    which never asks where the weights live. `asyncrl.rl.sampler.sink.ActorSink` receives in the
    actor's own process (it joins through the sampler's `SyncSeat` and copies into the backend's tensors); vLLM's
    receives in the engine's process, which joins the group itself. A sink holds one membership at
    a time."""

    @abc.abstractmethod
    async def join(self, address: SyncAddress, rank: int) -> str:
        """Leave any previous group and join the one at ``address`` as ``rank`` (see
        `SyncSeat.join`). Returns the communicator's backend."""

    @abc.abstractmethod
    async def setup(self, timeout_s: float) -> int:
        """Agree on the weight layout with the sender (`WeightReceiver.create`). Returns the
        bucket count."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """`setup` succeeded since the last `join`: `receive` may go ahead."""

    @abc.abstractmethod
    async def receive(self, version: int, *, in_flight: bool, timeout_s: float) -> SamplerSyncStats:
        """Take sync ``version`` into the weights the backend generates with, at a moment no
        generation reads them: once the generates in flight have finished, none starting
        meanwhile (``in_flight=False``), or between two decoding steps of them, which go on with
        the new weights (``in_flight=True``). The wait for that moment and the transfer share
        one deadline, ``timeout_s``: the trainer's side starts at once and the driver waits for
        ours only a grace beyond it. `SamplerTimeoutError` when the moment does not come in time
        (weights untouched); what the transfer raises propagates (weights may be half-written).
        Returns its phases (``seconds`` left to the caller, which times the whole)."""

    @property
    def weight_dtype(self) -> str:
        """The dtype its floating-point weights are held in ("bfloat16", "float32"), "" when they
        are of several or it cannot say: the trainer sends in this dtype (`SyncGroup`), so a sync
        moves what the sampler keeps, not the trainer's fp32 master copy."""
        return ""

    @abc.abstractmethod
    async def leave(self) -> None:
        """Drop the communicator and the store handle. Idempotent; a no-op once closed."""

    @abc.abstractmethod
    async def created(self) -> dict[str, int]:
        """Communicators created for weight sync by the process that receives, per backend."""

    @abc.abstractmethod
    async def digest(self) -> str:
        """`asyncrl.rl.digest.tensor_digest` of the weights generated with; `SamplerError` where
        they cannot be read (a vLLM engine's, repacked for its kernels)."""


class SamplerBackend(abc.ABC):
    """What a sampler actor needs from an inference engine: generation that can be paused, and a
    `WeightSink` that takes the trainer's weights in place."""

    name: str = ""
    """The backend's kind as `choose_backend` names it (``"hf"``, ``"vllm"``), for people to read."""
    batches_requests: bool = False
    """Whether the engine batches concurrent requests itself (vLLM's scheduler): then requests are
    sent as they come (an evaluation's parts all at once, the OpenAI endpoint's calls one by one,
    each rollout problem a call of its own, taken back as it ends, at no cost in throughput);
    else they are batched, a batch at a time, by the caller."""
    shares_engines: bool = False
    """Whether several samplers can share one engine of this backend (``--sampler.clients_per_engine``:
    `BackendOptions.vllm`'s ``share``)."""

    @classmethod
    @abc.abstractmethod
    def load(cls, model_path: str, options: BackendOptions) -> tuple[SamplerBackend, PromptFormat]:
        """This backend on the checkpoint at ``model_path`` (its start phase told the supervisor
        first: `start_phase`), and the checkpoint's prompt format."""

    @classmethod
    def digestible_on(cls, device: torch.device) -> bool:
        """Whether this backend's weights on ``device`` can be read as they were sent (a digest
        of them is the trainer's: ``--run.check_weights``)."""
        return True

    def loaded_adapters(self) -> int | None:
        """LoRA adapters the engine holds now (None: it serves none), for the sampler's stats."""
        return None

    async def warm_up(self, prompt: list[int], params: SamplingParams) -> None:  # noqa: B027  # a hook, not abstract
        """Anything the engine compiles on its first generates, done before the sampler is up (a
        weight sync would otherwise wait for it). Nothing by default."""

    @abc.abstractmethod
    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None = None
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt, in prompt order. While paused, waits for `resume`.
        ``progress``: told each row's tokens as they are generated (the OpenAI endpoint's streams)."""

    @abc.abstractmethod
    def weight_sink(self, seat: SyncSeat) -> WeightSink:
        """This backend's side of weight sync, given the sampler's ``seat`` (through which
        an in-process sink joins; a sink in another process ignores it)."""

    @abc.abstractmethod
    async def pause(self, timeout_s: float = 600.0) -> None:
        """From now on no generate starts; returns once the ones in flight have finished."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Let generates start again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; later generates raise `SamplerClosedError`."""

    @property
    def generator(self) -> torch.Generator | None:
        """The RNG of unseeded requests, saved in checkpoints; None where the engine keeps its own."""
        return None

    def tokens_decoded(self) -> int:
        """Tokens decoded since the start, those of calls still running included: a count that
        moves while the engine decodes, however long its completions (`SamplerStats.decoded`, by
        which the driver tells a long generation from a stuck one). 0: the backend cannot tell,
        and its rollouts are judged by their groups alone."""
        return 0

    def engine_stats(self) -> dict[str, int | float]:
        """What the engine says of its cache for the sampler's stats (`SamplerStats`' fields
        ``kv_cache_tokens``, ``preemptions``, ``kv_cache_peak``); {}: nothing."""
        return {}

    def take_engine_window(self) -> tuple[int, float] | None:
        """The engine's preemptions and its peak KV cache use (0..1) since the previous call: the
        sampler answers each weight sync with them, so every step's record has its own. None:
        not counted (no engine statistics)."""
        return None


Progress = Callable[[int, list[int]], None]
"""``progress(row, token_ids)``: the tokens row ``row`` (sample j of prompt i is row ``i * n + j``)
has generated so far, called on the caller's event loop as they come (after each decoding step on
HF; with each engine output on vLLM) until the row ends; the call's result stays what counts."""

Work = asyncio.Future | concurrent.futures.Future
"""What `PausableBackend._submit` returns: a task or future on the loop, or a worker thread's future."""


class PausableBackend(SamplerBackend):
    """The pause/resume bookkeeping every backend shares, and `generate` as a template around it:
    validate (`_check`), wait while paused, count the call in flight, start the generation itself
    (`_submit`, the subclass's part) and count it out when that work has really ended.

    Concurrency contract (the sampler actor's version tagging relies on it): when not paused,
    `generate` counts itself in flight before its first ``await``, so a `pause` that starts after
    the call began waits for it."""

    vocab_size: int
    """Set by the subclass: `_check` refuses token ids outside ``[0, vocab_size)``."""

    def __init__(self, *, resume_timeout_s: float):
        self.resume_timeout_s = resume_timeout_s
        self.weights_version = 0
        """The version of the weights generation reads now, as the sink last set it: a
        generation's first tokens are of this version, and a completion's `version_spans` say
        where it changed under it."""
        self._closed = False
        self._paused = False
        self._inflight = 0
        # Made here: an asyncio.Event binds to the loop that first waits on it (Python >= 3.10).
        self._resumed, self._idle = asyncio.Event(), asyncio.Event()
        self._resumed.set()
        self._idle.set()

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None = None
    ) -> list[list[Completion]]:
        self._check(prompts, n, params)
        if self._closed:
            raise SamplerClosedError(f"{type(self).__name__} is closed")
        if self._paused:  # no await before this point when not paused: see the class docstring
            await self._wait_resumed()
        self._inflight += 1
        self._idle.clear()
        try:
            work = self._submit(prompts, n, params, progress)
        except BaseException:
            self._finished()
            raise
        # Counted in flight until the work itself ends, not until our await does: a cancelled
        # caller may leave a thread running (HF), and weights must not change under it.
        if isinstance(work, concurrent.futures.Future):  # done on the worker thread: back to our loop
            loop = asyncio.get_running_loop()
            work.add_done_callback(lambda _: _call_soon(loop, self._finished))
        else:
            work.add_done_callback(lambda _: self._finished())
        return await asyncio.wrap_future(work)

    def _check(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        """Refuse a bad request before it is counted; `check_request` against ``vocab_size``."""
        check_request(prompts, n, self.vocab_size, params)

    @abc.abstractmethod
    def _submit(self, prompts: list[list[int]], n: int, params: SamplingParams, progress: Progress | None) -> Work:
        """Start generating (no ``await``: the call is counted in flight already) and return the
        work: a future done when it has ended, with the completions as its result. Cancelling it
        (a caller that went away) stops what can be stopped; its end is still awaited for the count."""

    async def pause(self, timeout_s: float = 600.0) -> None:
        """Stop new generates from starting and wait for those in flight. On timeout the pause is
        undone (it either holds with nothing in flight, or has no effect) and this raises."""
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
        self._paused = False
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def _mark_closed(self) -> None:
        """For ``close``: refuse new generates, and wake those held by a pause (they raise
        `SamplerClosedError`)."""
        self._closed = True
        self._resumed.set()

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


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop is closed: nobody is left to wait for the count
        pass


def check_request(prompts: list[list[int]], n: int, vocab_size: int, params: SamplingParams | None = None) -> None:
    """Refuse what would otherwise fail deep inside the model, or on the worker thread."""
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    if params is not None and params.exact_lengths and len(params.exact_lengths) != len(prompts) * n:
        raise ValueError(f"{len(params.exact_lengths)} exact_lengths for {len(prompts)} prompts of {n} rows each")
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} has no tokens")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
