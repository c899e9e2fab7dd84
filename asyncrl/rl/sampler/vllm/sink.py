"""`EngineSink`: weight sync received by vLLM's worker process, driven from the sampler actor.

The worker (`asyncrl.rl.sampler.vllm.worker.WeightSyncExtension`) joins the trainer's group and
takes every bucket off the communicator itself; the sink only sends it small control values
through ``AsyncLLM.collective_rpc`` (`engine_call`) and turns its answers back into values, or into
the `asyncrl.comm.errors` type the worker's data plane raised.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import msgspec
import torch

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.errors import COMM_ERRORS_BY_PATH, RendezvousError, RendezvousTimeoutError
from asyncrl.comm.weights import SyncStats
from asyncrl.errors import type_path
from asyncrl.rl.sampler.backend import SamplerSyncStats, WeightSink
from asyncrl.rl.sampler.errors import SamplerClosedError, SamplerError, WeightsUnreadableError
from asyncrl.runtime.timeouts import timeout

ANSWER_GRACE_S = 10.0
"""Beyond a call's own timeout, how long the worker may take to answer (its waits are bounded by
that timeout: this is room to say why, not to work)."""


class EngineBackend(Protocol):
    """What the sink needs of `VLLMBackend` (named by shape, not imported: the backend imports us)."""

    engine: Any  # vLLM's AsyncLLM; None once closed
    prefix_caching: bool
    device: torch.device
    stage_weights: str  # the worker's `STAGE_MODES`

    marker: str  # in the vLLM ids of its requests, and of no other client's

    async def pause(self, timeout_s: float = 600.0) -> None: ...

    async def resume(self) -> None: ...

    def request_mark(self) -> int: ...

    def weights_changed(self, version: int, positions: dict[str, int] | None, since: int) -> None: ...


class EngineWeightSyncError(SamplerError):
    """The vLLM worker failed a weight-sync control call (join, set-up, receive) by itself (no
    data-plane error of a peer's making): says which and why. A `SamplerError`, not a
    `WeightSyncError`: the driver, which catches the data plane's errors by type, loses this
    sampler rather than counting it a victim of a peer (`driver/sync_group.suffered_from_peer`)."""


WORKER_ERRORS: dict[str, type[Exception]] = {
    **{
        path: RendezvousError if issubclass(cls, RendezvousTimeoutError) else cls
        for path, cls in COMM_ERRORS_BY_PATH.items()
    },
    type_path(WeightsUnreadableError): WeightsUnreadableError,
}
"""The classes an error the worker reported by its type path (``module.QualName``) is raised
again as, each from one message: the `asyncrl.comm.errors` class at that path (a
`RendezvousTimeoutError`, whose constructor takes group, what, missing and timeout, as its base
class `RendezvousError`), and `WeightsUnreadableError`."""


def worker_error(path: str) -> type[Exception]:
    """`WORKER_ERRORS`' class for ``path``; an unknown path's is `EngineWeightSyncError`."""
    return WORKER_ERRORS.get(path, EngineWeightSyncError)


DIGEST_TIMEOUT_S = 120.0
"""Reading a model's weights to the host to hash them: a 7B model's 15 GB take tens of seconds."""


async def engine_call(backend: EngineBackend, call: str, timeout_s: float, *args: Any) -> Any:
    """One control call to the worker (`WeightSyncExtension.asyncrl_call`); only plain values go
    in and come back. A data-plane error in the worker is raised here as the same
    `asyncrl.comm.errors` type, so the driver can tell a peer's failure from this engine's."""
    if backend.engine is None:
        raise SamplerClosedError(f"VLLMBackend is closed: cannot {call}")
    bound = timeout_s + ANSWER_GRACE_S
    try:
        async with timeout(bound + 5):  # collective_rpc's own timeout first, if it keeps it
            results = await backend.engine.collective_rpc("asyncrl_call", timeout=bound, args=(call, *args))
    except asyncio.TimeoutError:
        raise EngineWeightSyncError(f"the vLLM worker did not answer {call} within {bound + 5:g} s") from None
    except Exception as exc:
        raise EngineWeightSyncError(f"the vLLM worker failed {call}: {type(exc).__name__}: {exc}") from exc
    if len(results) != 1:
        raise EngineWeightSyncError(f"{call}: expected one vLLM worker's answer, got {len(results)}")
    answer = results[0]
    if not isinstance(answer, dict) or not ("ok" in answer or "error" in answer):
        raise EngineWeightSyncError(f"{call}: the vLLM worker answered {answer!r:.200}")
    if "error" in answer:
        path = answer["error"]
        name = str(path).rpartition(".")[2]
        raise worker_error(path)(f"the vLLM worker failed {call}: {name}: {answer.get('message', '')}")
    return answer["ok"]


class ReceivedWeights(msgspec.Struct, frozen=True):
    """The worker's answer to ``receive_weights`` (`WeightSyncExtension.asyncrl_receive_weights`)."""

    stats: SyncStats
    positions: dict[str, int] | None
    """Per request (vLLM's internal id), its tokens sampled before the new weights went in;
    None: the worker could not tell."""


class EngineSink(WeightSink):
    """``backend``'s weight sync, in its engine's worker. Pause mode: no new request, wait for
    those running, load, reset the prefix cache, resume. In-flight mode: the engine loads between
    two of its steps while requests keep running."""

    def __init__(self, backend: EngineBackend):
        self.backend = backend
        self._ready = False

    async def join(self, address: SyncAddress, rank: int) -> str:
        self._ready = False  # the worker drops its receiver with the old membership
        # As plain values: whatever carries collective_rpc's arguments, none of our types crosses it.
        return await engine_call(self.backend, "join", address.timeout_s, msgspec.to_builtins(address), rank)

    async def setup(self, timeout_s: float) -> int:
        stage = self.backend.stage_weights
        buckets = await engine_call(self.backend, "setup_receiver", timeout_s, float(timeout_s), stage)
        self._ready = True
        return buckets

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def weight_dtype(self) -> str:
        dtype = getattr(self.backend, "dtype", None)  # the engine's, once it is built
        return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else ""

    async def receive(self, version: int, *, in_flight: bool, timeout_s: float) -> SamplerSyncStats:
        # One deadline for the pause and the transfer: each with a whole timeout_s of its own
        # would let this side take twice as long as the trainer's, which started at once.
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 1e-3)

        start = time.perf_counter()
        if not in_flight:
            await self.backend.pause(timeout_s)  # SamplerTimeoutError: weights untouched
        try:
            waited = time.perf_counter() - start
            since = self.backend.request_mark()
            answer = await engine_call(self.backend, "receive_weights", left(), version, left())
            called = time.perf_counter()
            try:
                received = msgspec.convert(answer, ReceivedWeights)
            except msgspec.ValidationError as exc:
                raise EngineWeightSyncError(
                    f"receive_weights: the vLLM worker answered {answer!r:.200}: {exc}"
                ) from None
            stats = received.stats
            # Paused, no request ran across the load; in flight, where each one stood tells which
            # of its tokens the new weights sampled.
            self.backend.weights_changed(version, received.positions if in_flight else {}, since)
            reset_s = 0.0
            if self.backend.prefix_caching:  # cached prefixes were computed with the old weights
                try:
                    async with timeout(left() + ANSWER_GRACE_S):
                        reset = await self.backend.engine.reset_prefix_cache()
                except asyncio.TimeoutError:
                    raise EngineWeightSyncError("vLLM did not reset its prefix cache in time") from None
                if reset is False:
                    print("VLLMBackend: vLLM did not reset its prefix cache (requests still running)", flush=True)
                reset_s = time.perf_counter() - called
        finally:
            resuming = time.perf_counter()
            if not in_flight:
                await self.backend.resume()
        call_s = max(called - start - waited - stats.seconds, 0.0)
        return SamplerSyncStats(
            # in flight, the wait for the decoding step under way is the engine's taking the call
            pause_s=waited if not in_flight else call_s,
            receive=stats,
            reset_s=reset_s,
            resume_s=time.perf_counter() - resuming,
            call_s=call_s,
        )

    async def leave(self) -> None:
        self._ready = False
        if self.backend.engine is not None:
            await engine_call(self.backend, "leave", 30.0)

    async def created(self) -> dict[str, int]:
        return await engine_call(self.backend, "created", 30.0)

    async def digest(self) -> str:
        """Read in the engine's process, through the places a sync checked (the worker's digest)."""
        if self.backend.device.type != "cuda":
            raise WeightsUnreadableError("vLLM on the CPU repacks its weights for its kernels: no digest of them")
        return await engine_call(self.backend, "digest", DIGEST_TIMEOUT_S)
