"""`WeightReceiving`: the sampler's side of a weight sync, and the gate it keeps rollouts behind.

The sampler's seat in the weight-sync group is owned here and handed to the backend's `WeightSink`
(``backend.py``), which joins through it where it receives in this process (`ActorSink`) and
ignores it where it does not: for vLLM a join puts the engine's process in the group, and the
actor's process holds no communicator. While a sync is under way, and after a failed one until
one succeeds, the gate is shut: no generate begins (`wait_ready`), so no batch samples from
weights that may be half-written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.member import SyncSeat
from asyncrl.rl.sampler.backend import SamplerSyncStats, WeightSink
from asyncrl.rl.sampler.errors import SamplerError, SamplerTimeoutError, WeightsUnreadableError
from asyncrl.runtime.timeouts import timeout


class WeightReceiving:
    """A sampler's weight syncs. ``make_sink`` builds the backend's `WeightSink` over this seat;
    ``name`` names the sampler in errors; ``in_flight``: weights are taken between decoding steps
    (``weight_update="in_flight"``), not after the batch in flight; each sync has
    ``sync_timeout_s``; ``generating`` says how many generate calls are in flight now.
    ``version``: the weights' version; ``failures``: failed syncs so far (a batch that saw one in
    flight is discarded); ``counts``: the syncs' counters in the sampler's stats."""

    def __init__(
        self,
        make_sink: Callable[[SyncSeat], WeightSink],
        *,
        name: str,
        in_flight: bool,
        sync_timeout_s: float,
        generating: Callable[[], int],
    ):
        self.seat = SyncSeat()
        self.sink = make_sink(self.seat)
        self.name, self.in_flight, self.sync_timeout_s, self.generating = name, in_flight, sync_timeout_s, generating
        self.version = 0
        self.failures = 0
        self.counts = {
            "weight_sync_s": 0.0,
            "pause_s": 0.0,
            "syncs": 0,
            "failed_syncs": 0,
            "syncs_waited_for_generate": 0,
        }
        self._ready = asyncio.Event()  # clear during a weight sync, and after a failed one until one succeeds
        self._ready.set()
        self._lock = asyncio.Lock()

    def listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the store's listening socket now (`SyncSeat.listen`). Returns the port."""
        return self.seat.listen(host, port)

    async def join(self, address: SyncAddress, rank: int) -> str:
        """Join the trainer's weight-sync group (where the backend receives: here, or its engine)."""
        return await self.sink.join(address, rank)

    async def leave(self) -> None:
        """Leave the weight-sync group, in the process that receives and in this one (a reserved
        listener). Idempotent."""
        await self.sink.leave()
        await self.seat.leave()

    async def created(self) -> dict[str, int]:
        """Communicators created for weight sync, per backend (in the process that receives)."""
        return await self.sink.created()

    async def setup(self, timeout_s: float) -> int:
        """After `form_group`: agree on the weight layout with the trainer. Returns the bucket count."""
        try:
            return await self.sink.setup(timeout_s)
        except SamplerError as exc:
            raise SamplerError(f"sampler {self.name}: {exc}") from None

    async def receive(self, version: int) -> SamplerSyncStats:
        """Take ``version`` in place: after the batch in flight (``weight_update="pause"``) or
        between two of its decoding steps ("in_flight"); no new batch starts until it is done.
        Returns where its time went (`SamplerSyncStats`). If the transfer fails the weights may be
        half-written: rollouts then wait for the next successful sync instead of sampling from
        them, and a batch that was in flight is discarded."""
        if not self.sink.ready:
            raise SamplerError(f"sampler {self.name}: receive_weights before setup_receiver")
        # One deadline for the wait to load and the transfer (the sink keeps it), as on the
        # trainer, whose side of the sync starts at once: the driver waits for our answer only a
        # grace beyond it, so a transfer that got a whole sync_timeout_s of its own after a long
        # pause would answer (a peer's failure, as a collective error) after the driver had
        # judged us frozen.
        deadline = time.monotonic() + self.sync_timeout_s
        async with self._lock:
            start = time.perf_counter()
            self._ready.clear()  # no rollout batch may start from here on
            if self.generating() and not self.in_flight:
                self.counts["syncs_waited_for_generate"] += 1
            try:
                phases = await self.sink.receive(
                    version, in_flight=self.in_flight, timeout_s=max(deadline - time.monotonic(), 1e-3)
                )
            except SamplerTimeoutError:  # the weights were not touched: sampling may go on
                self._ready.set()
                self.counts["failed_syncs"] += 1
                why = (
                    "a decoding step did not end"
                    if self.in_flight
                    else "the batch in flight did not finish: long completions take their weights between "
                    "decoding steps with --sampler.weight_update in_flight, or need a longer --run.sync_timeout_s"
                )
                raise SamplerTimeoutError(
                    f"sampler {self.name}: no moment free of generation came within {self.sync_timeout_s:g} s "
                    f"({why}), so the weights could not be taken"
                ) from None
            except BaseException:
                self.counts["failed_syncs"] += 1
                self.failures += 1
                raise
            self.version = version
            self._ready.set()
            seconds = time.perf_counter() - start
            self.counts["pause_s"] += phases.pause_s
            self.counts["weight_sync_s"] += seconds
            self.counts["syncs"] += 1
            return msgspec.structs.replace(phases, seconds=seconds)

    async def digest(self) -> str:
        """SHA-256 of the weights this sampler generates with (`asyncrl.rl.digest.tensor_digest`)."""
        try:
            return await self.sink.digest()
        except SamplerError as exc:  # a refused digest keeps its type: the driver stops the run for it
            kind = WeightsUnreadableError if isinstance(exc, WeightsUnreadableError) else SamplerError
            raise kind(f"sampler {self.name}: {exc}") from None

    async def wait_ready(self) -> None:
        """Return once no sync is under way and the last one succeeded; `SamplerTimeoutError`
        when that takes longer than a sync and most of the next."""
        loop = asyncio.get_running_loop()
        bound = 2 * self.sync_timeout_s + 5  # a sync and most of the next, each within sync_timeout_s
        deadline = loop.time() + bound
        while not self._ready.is_set():  # re-checked after waking: another sync may have begun
            try:
                async with timeout(max(deadline - loop.time(), 0.0)):  # not wait_for: see backend.py's pause
                    await self._ready.wait()
            except TimeoutError:
                raise SamplerTimeoutError(
                    f"sampler {self.name}: no successful weight sync within {bound:g} s (the last one failed "
                    "or is still under way); not sampling from weights that may be half-written"
                ) from None
