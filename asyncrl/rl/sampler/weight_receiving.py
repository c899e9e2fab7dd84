"""`WeightReceiving`: the sampler actor's side of a weight sync, and the gate it keeps rollouts behind.

`SyncMember`'s endpoints and the receiver's are forwarded to the backend's `WeightSink`
(``backend.py``): for vLLM `form_group` then puts the engine's process in the group, and the
actor's process holds no communicator. While a sync is under way, and after a failed one until
one succeeds, the gate (``_ready``) is shut: no generate begins (`_wait_ready`), so no batch
samples from weights that may be half-written.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.member import SyncMember
from asyncrl.rl.sampler.backend import SamplerError, SamplerSyncStats, SamplerTimeoutError
from asyncrl.runtime.actor import endpoint
from asyncrl.runtime.timeouts import timeout


class WeightReceiving(SyncMember):
    """The weight-sync endpoints of a sampler. The actor provides ``sink`` (its backend's
    `WeightSink`), ``name``, ``in_flight``, ``sync_timeout_s``, ``version``, the gate
    (``_ready``, set; ``_sync_lock``), ``_stats``, ``_failures`` and ``_generating``."""

    @endpoint
    async def sync_join(self, address: SyncAddress, rank: int) -> str:
        """Join the trainer's weight-sync group (where the backend receives: here, or its engine)."""
        return await self.sink.join(address, rank)

    @endpoint
    async def sync_leave(self) -> None:
        """Leave the weight-sync group. Idempotent."""
        await self.sink.leave()
        await super().sync_leave()  # what this process holds itself (a reserved listener)

    @endpoint
    async def sync_created(self) -> dict[str, int]:
        """Communicators created for weight sync, per backend (in the process that receives)."""
        return await self.sink.created()

    @endpoint
    async def setup_receiver(self, timeout_s: float = 60.0) -> int:
        """After `form_group`: agree on the weight layout with the trainer. Returns the bucket count."""
        try:
            return await self.sink.setup(timeout_s)
        except SamplerError as exc:
            raise SamplerError(f"sampler {self.name}: {exc}") from None

    @endpoint
    async def receive_weights(self, version: int) -> SamplerSyncStats:
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
        async with self._sync_lock:
            start = time.perf_counter()
            self._ready.clear()  # no rollout batch may start from here on
            if self._generating and not self.in_flight:
                self._stats["syncs_waited_for_generate"] += 1
            try:
                phases = await self.sink.receive(
                    version, in_flight=self.in_flight, timeout_s=max(deadline - time.monotonic(), 1e-3)
                )
            except SamplerTimeoutError:  # the weights were not touched: sampling may go on
                self._ready.set()
                self._stats["failed_syncs"] += 1
                raise SamplerTimeoutError(
                    f"sampler {self.name}: no moment free of generation came within {self.sync_timeout_s:g} s "
                    f"({'a decoding step did not end' if self.in_flight else 'the batch in flight did not finish'}), "
                    "so the weights could not be taken"
                ) from None
            except BaseException:
                self._stats["failed_syncs"] += 1
                self._failures += 1
                raise
            self.version = version
            self._ready.set()
            seconds = time.perf_counter() - start
            self._stats["pause_s"] += phases.pause_s
            self._stats["weight_sync_s"] += seconds
            self._stats["syncs"] += 1
            return msgspec.structs.replace(phases, seconds=seconds)

    @endpoint
    async def weights_digest(self) -> str:
        """SHA-256 of the weights this sampler generates with (`asyncrl.rl.digest.tensor_digest`)."""
        try:
            return await self.sink.digest()
        except SamplerError as exc:
            raise SamplerError(f"sampler {self.name}: {exc}") from None

    async def _wait_ready(self) -> None:
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
