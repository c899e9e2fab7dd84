"""Several samplers on one vLLM engine: its host starts the engine core, the others attach to it.

vLLM's engine core serves any number of client processes (what its ``--api-server-count`` does):
the core is started with one pair of ZeroMQ addresses per client, each client's ``AsyncLLM`` binds
its own pair, and the core sends each request's outputs to the client that sent it. Where the one
client process of an engine is the bound (detokenising, building each step's outputs in Python),
N clients feed one core, with one copy of the weights and one KV cache, instead of N engines.

Here the clients are samplers. The *host* (`EngineShare.client` 0) starts the core, a child of its
own process as an engine of its own would be, and is its first client; the others attach. Only the
host is in the weight-sync group: it loads every sync into the engine (``sink.py``), and each
other client then asks the engine, through its own ``collective_rpc``, where its requests stood at
that load (`ClientSink`).

Addresses: Linux abstract-namespace sockets (``ipc://@...``), named by the run's token for the
engine, so nothing is left on disk whichever way a process ends. vLLM's client waits for a
"ready" message that the core sends each pair once, as it starts (ZeroMQ holds it until the pair
is bound), so a restarted client cannot take its predecessor's pair: each client has a pair per
incarnation its restarts allow (`EngineShare.slot`), all of them given to the core at its start.
A restarted host starts a new core on the same addresses, which the restarted clients then reach.

Ends: the core goes with the host's process group, as any engine's. A client watches the core's
process (`EngineWatch`, a pidfd on the event loop): when it ends, the client's engine is shut
and its generates fail at once, so the driver loses the sampler as any other whose stream failed
(and loses every client with their host: ``driver/fleet/membership.py``).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from asyncrl.rl.sampler.backend import SamplerSyncStats
from asyncrl.rl.sampler.errors import SamplerError
from asyncrl.rl.sampler.vllm.sink import EngineBackend, EngineSink, EngineWeightSyncError, engine_call

if TYPE_CHECKING:
    from asyncrl.comm.address import SyncAddress

_TOKEN = re.compile(r"^[0-9a-f]{8,32}$")


class EngineShare(msgspec.Struct, frozen=True, kw_only=True):
    """One sampler's place among the clients of a shared vLLM engine: made by the driver
    (`SamplerSpawner`), the same for every incarnation of the sampler."""

    token: str
    """Hex digits naming this engine's sockets, drawn by the driver for each engine of a run."""
    host: str
    """The sampler that starts the engine, its client 0 (named in errors)."""
    client: int
    """This sampler's place among the engine's clients: 0 for the host."""
    clients: int
    """Samplers sharing the engine (``--sampler.clients_per_engine``)."""
    incarnations: int
    """Incarnations of each client that can attach: its restarts (``--run.sampler_max_restarts``) + 1."""

    def __post_init__(self) -> None:
        if not _TOKEN.match(self.token):
            raise ValueError(f"an engine's token is 8-32 hex digits, not {self.token!r}")
        if self.clients < 2 or not 0 <= self.client < self.clients:
            raise ValueError(f"client {self.client} of {self.clients}: need 0 <= client < clients, clients >= 2")
        if self.incarnations < 1:
            raise ValueError(f"incarnations must be >= 1, not {self.incarnations}")

    @property
    def is_host(self) -> bool:
        return self.client == 0

    def slot(self, incarnation: int) -> int:
        """The address pair (vLLM's client index) of this sampler's ``incarnation`` (1, 2, ...)."""
        if not 1 <= incarnation <= self.incarnations:
            raise SamplerError(
                f"incarnation {incarnation} of client {self.client} of {self.host}'s engine has no place "
                f"on it: the engine was started for {self.incarnations} (--run.sampler_max_restarts + 1)"
            )
        return self.client * self.incarnations + incarnation - 1

    def addresses(self) -> tuple[list[str], list[str]]:
        """Every pair's input and output address, by slot: what the core is started with."""
        slots = range(self.clients * self.incarnations)
        return [self._address(s, "in") for s in slots], [self._address(s, "out") for s in slots]

    def _address(self, slot: int, way: str) -> str:
        return f"ipc://@asyncrl-engine-{self.token}-{slot}-{way}"


def incarnation() -> int:
    """This actor process's incarnation (the runtime's ``ASYNCRL_INCARNATION``; 1 outside one)."""
    from asyncrl.runtime.worker import ENV_INCARNATION

    return int(os.environ.get(ENV_INCARNATION, "1"))


class EngineWatch:
    """Calls ``ended(pid)`` on the running event loop once process ``pid`` has ended, waiting on
    a pidfd (Linux 5.3+) rather than polling. `close` stops watching. Raises `SamplerError` where
    no pidfd can be had for ``pid`` (gone already, or no such call)."""

    def __init__(self, pid: int, ended: Callable[[int], None]):
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:
            raise SamplerError(f"cannot watch the engine's process {pid}: {exc}") from None
        self.pid, self.ended = pid, ended
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        self.close()
        self.ended(self.pid)

    def close(self) -> None:
        """Idempotent."""
        fd, self.fd = self.fd, None
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)


class LoadedWeights(msgspec.Struct, frozen=True):
    """The worker's answer to ``loaded`` (`WeightSyncExtension.asyncrl_loaded`)."""

    version: int
    positions: dict[str, int] | None
    """Per request of the asking client (vLLM's internal id), its tokens sampled before that load;
    None: the worker could not tell."""


class ClientSink(EngineSink):
    """The weight syncs of a client of a shared engine other than its host. It joins no group:
    the host receives into the engine for all. The driver tells it of each sync once the host's
    is done (`receive`): it asks the engine which version it holds and where this client's
    requests stood at that load. Requests it does not find there keep the old version for their
    tokens, unless sent after the asking (`VLLMBackend.weights_changed`): a client learns of a
    load after it, so a request that ended before it can be missing; its lag is over-counted,
    never hidden. In pause mode the host paused the whole engine for the load (`VLLMBackend.pause`)."""

    def __init__(self, backend: EngineBackend, host: str):
        super().__init__(backend)
        self.host = host

    async def join(self, address: SyncAddress, rank: int) -> str:
        raise SamplerError(self._no_group("join"))

    async def setup(self, timeout_s: float) -> int:
        raise SamplerError(self._no_group("set up a receiver"))

    @property
    def ready(self) -> bool:
        return True

    async def receive(self, version: int, *, in_flight: bool, timeout_s: float) -> SamplerSyncStats:
        start = time.perf_counter()
        since = self.backend.request_mark()
        answer = await engine_call(self.backend, "loaded", timeout_s, self.backend.marker)
        try:
            loaded = msgspec.convert(answer, LoadedWeights)
        except msgspec.ValidationError as exc:
            raise EngineWeightSyncError(f"loaded: the vLLM worker answered {answer!r:.200}: {exc}") from None
        if loaded.version != version:
            raise EngineWeightSyncError(
                f"{self.host}'s engine holds v{loaded.version}, not v{version}: its host's sync did not land"
            )
        self.backend.weights_changed(version, loaded.positions, since)
        return SamplerSyncStats(call_s=time.perf_counter() - start)

    async def leave(self) -> None:
        pass  # the engine's membership is its host's, not this client's to drop

    def _no_group(self, what: str) -> str:
        return f"a client of {self.host}'s vLLM engine does not {what} in the weight-sync group: its host receives"
