"""Elastic samplers: ``asyncrl scale RUN_DIR --samplers N`` grows or shrinks a live run's fleet.

`Scaler` holds the fleet's target. A request (`Scaler.request`: from the status socket that
``asyncrl scale`` and `asyncrl.rl.driver.fleet.scaling.scale` talk to) is checked at once against the
run's device plan and refused in one line if it cannot be met; an accepted one only sets the
target. The driver applies it at its next weight sync (`Scaler.at_sync`, called right before
`SamplerPool.sync`, so never while a sync, a rebuild or a batch's training is in flight):

* Up: the missing samplers are spawned at once, in the background, placed as the run's first
  ones were (a free GPU each on the first node with one, the trainer's GPU when colocated, the
  CPU), each a new actor ``samplerK`` with its own seed and data walk. A sampler whose process
  is up is added to the pool as a candidate at the next sync, and that sync re-forms the group
  with it: it takes the current weights in the rebuild, and its rollouts are pumped only after
  that (the pool's invariant), so it never generates with other weights than the run's. (When no
  sampler is in the group, every other one lost, no sync comes until one joins: a sampler that
  comes up then is added at once, and the pool's wait for a batch re-forms the group with it.)
* Down: the samplers to drain are picked so that the fewest groups are lost: those still starting
  (their start is cancelled), then those waiting for a restart, then the newest in the group.
  Each leaves the group at once (`Membership.drain`): its stream is cut, the groups it was making
  are handed back (never accepted; the pacer gives their credit to the others), and the sync that
  follows re-forms the group without it; then its process is stopped.

So every change applied at one sync costs one re-formation of the group, whatever it adds and
removes; nothing accepted is dropped (the queue keeps what a drained sampler delivered, tagged
and checked as before), no group id repeats (each new sampler has a name of its own), and the
staleness bound is the queue's and the pacer's, which know no sampler count. A target is kept:
a sampler lost for good later is replaced by a new one to meet it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from asyncrl.errors import ActionableError, first_line
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle
from asyncrl.rl.driver.fleet.membership import Member, MemberState
from asyncrl.rl.driver.fleet.pool import SamplerPool
from asyncrl.rl.view.fleet import fleet_text
from asyncrl.runtime.state import ActorState

if TYPE_CHECKING:
    from asyncrl.runtime.cluster.nodes import NodeStatus
    from asyncrl.runtime.record import ActorStatus

STOP_S = 60.0
"""How long `Scaler.close` waits for the stops of drained samplers and the starts it cancelled."""

# Drained first: the members whose leaving costs the least work (a LOST one makes nothing).
_DRAIN_ORDER = {MemberState.LOST: 0, MemberState.CANDIDATE: 1, MemberState.JOINED: 2}


class ScaleRefusedError(ActionableError):
    """A scale request the run cannot meet; the message says what can be asked instead."""


class ScalingProgress(msgspec.Struct, kw_only=True, frozen=True):
    """The fleet's target and the samplers starting (`Scaler.progress`), for progress.json and
    ``asyncrl status``; the field names are the keys there."""

    samplers_target: int
    """The last size asked, else the count this run segment started."""
    samplers_starting: list[str]
    """The samplers a scale-up spawned that are not up yet, by name."""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def check_target(
    n: object,
    *,
    active: int,
    device: str,
    colocated: bool,
    started: int,
    free_gpus: int,
    cores: int = 0,
    force: bool = False,
    per_gpu: int = 1,
) -> int:
    """``n`` as the fleet's new size, or a `ScaleRefusedError` naming why not: ``active``
    samplers run or are coming; the run's device plan (``device``, ``colocated``, ``started``:
    its first sampler count) and ``free_gpus`` (over every node) say how many more fit. On the
    CPU, growing past ``cores`` (the cores of the run's nodes; 0: unknown) is refused unless
    ``force``: the host could start them, not run them. A GPU limit is not forced: there is no
    device to place another sampler on (``per_gpu`` of them share one: ``--sampler.per_gpu``)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ScaleRefusedError(f"--samplers must be a whole number, not {n!r}")
    if n < 1:
        raise ScaleRefusedError(f"--samplers {n}: a run needs at least 1 sampler; stop the run to free them all")
    more = n - active
    if device == "cpu" and cores and n > max(cores, active) and not force:
        raise ScaleRefusedError(
            f"--samplers {n}: more CPU samplers than the {cores} core(s) of the run's node(s) (each decodes "
            f"on a core of its own, beside the trainer); ask for at most {max(cores, active)}, or add --force"
        )
    if device == "cuda" and colocated and n > started:
        raise ScaleRefusedError(
            f"--samplers {n}: the samplers share the trainer's GPU, whose memory was split "
            f"among {started} at the start; ask for at most {started}, or start the run with "
            f"--sampler.count {n}"
        )
    if device == "cuda" and not colocated and -(-more // per_gpu) > free_gpus:
        each = "a GPU each" if per_gpu == 1 else f"a GPU for every {per_gpu} (--sampler.per_gpu)"
        raise ScaleRefusedError(
            f"--samplers {n}: {more} more sampler(s) need {each}, but {free_gpus} "
            f"GPU(s) are free; ask for at most {active + free_gpus * per_gpu}"
        )
    return n


def least_loaded_node(nodes: list[NodeStatus], actors: list[ActorStatus], prefix: str = "sampler") -> int:
    """The joined node (a `NodeStatus`) running the fewest live actors named ``prefix...``, the
    lowest rank on a tie: where a CPU sampler started by a scale-up goes, so that a node that
    joined an elastic cluster mid-run takes the new samplers."""
    load = {n.rank: 0 for n in nodes if n.joined}
    for a in actors:
        if a.name.startswith(prefix) and not ActorState(a.state).final and a.node in load:
            load[a.node] += 1
    return min(load, key=lambda rank: (load[rank], rank)) if load else 0


class SamplerSource(Protocol):
    """Where a scale-up's samplers come from, and a scale-down's go: the run's `SamplerSpawner`
    (driver/spawn.py), which places and spawns them as it did the run's first ones."""

    device: str
    """The samplers' device type ("cuda", "cpu")."""
    colocated: bool
    """They share the trainer's GPU."""
    per_gpu: int
    """Samplers sharing one GPU (``--sampler.per_gpu``)."""
    clients_per_engine: int
    """Samplers sharing one vLLM engine (``--sampler.clients_per_engine``)."""

    def __call__(self, index: int, /) -> Awaitable[SamplerHandle]:
        """Spawn sampler ``index`` (``sampler<index>``)."""
        ...

    def seed_of(self, index: int, /) -> int: ...

    async def stop(self, handle: SamplerHandle, /) -> None: ...

    def free_gpus(self) -> int:
        """GPUs free over every node (0 on the CPU)."""
        ...

    def nodes(self) -> list[NodeStatus]:
        """The cluster's nodes: a node leaving an elastic cluster is drained."""
        ...

    def cores(self) -> int:
        """The CPU cores CPU samplers may use (0: unknown): more is refused unless forced."""
        ...


class Scaler:
    """The fleet's target and the changes that reach it (see the module docstring): ``pool``'s
    samplers, grown from and given back to ``source``."""

    def __init__(
        self,
        pool: SamplerPool,
        source: SamplerSource,
        *,
        log: Log = print,
        started: int | None = None,
        target: int | None = None,
    ):
        self.pool, self.membership, self.source = pool, pool.membership, source
        self.device, self.colocated, self.per_gpu, self.log = source.device, source.colocated, source.per_gpu, log
        self.leaving: set[int] = set()  # the ranks of the nodes whose samplers were drained
        # How many samplers the run's first segment started (a colocated GPU's memory was split
        # among them); a resumed segment may start another count (``target``).
        self.started = started or len(pool.members)
        self.target = target
        """None: never asked, the fleet is the run's as started; else kept, across resumes too
        (the checkpoint records it: run_state.py)."""
        self.starting: dict[int, asyncio.Task] = {}  # index -> its spawn
        self.next_index = len(pool.members)
        self.closed = False
        self._tasks: set[asyncio.Task] = set()
        # Samplers that share a GPU start one at a time, as at the run's start (sampler_start.py):
        # vLLM measures the GPU's free memory as it starts, and two at once would count each other's.
        self._one_at_a_time = asyncio.Lock() if self.colocated or self.per_gpu > 1 else None

    def active(self) -> int:
        """Samplers in the group, coming to it (candidates, restarts awaited) or starting."""
        live = self.membership.with_state(MemberState.JOINED, MemberState.CANDIDATE, MemberState.LOST)
        return len(live) + len(self.starting)

    def current_target(self) -> int:
        """The fleet's target: the last one asked, else the count this run segment started."""
        return self.target if self.target is not None else len(self.pool.members)

    def request(self, args: dict[str, object]) -> dict[str, int]:
        """The status socket's ``scale`` command: ``{"samplers": N}`` (and ``"force": true`` past
        the CPU cores). Called on the driver's loop; sets the target (applied at the next sync)
        and answers at once: the samplers running, restarting and starting, and the target before."""
        if self.closed:
            raise ScaleRefusedError("the run is ending; its samplers are no longer scaled")
        unknown = sorted(set(args) - {"samplers", "force"})
        if unknown or "samplers" not in args:
            raise ScaleRefusedError(
                f"scale takes samplers=N and force only (got {', '.join(sorted(args)) or 'nothing'})"
            )
        if self.source.clients_per_engine > 1:
            raise ScaleRefusedError(
                f"the samplers share vLLM engines (--sampler.clients_per_engine {self.source.clients_per_engine}), "
                "which asyncrl scale does not start or drain yet"
            )
        active, before = self.active(), self.current_target()
        running = len(self.membership.with_state(MemberState.JOINED, MemberState.CANDIDATE))
        restarting, starting = len(self.membership.with_state(MemberState.LOST)), len(self.starting)
        n = check_target(
            args["samplers"],
            active=active,
            device=self.device,
            colocated=self.colocated,
            started=self.started,
            free_gpus=self.source.free_gpus(),
            cores=self.source.cores(),
            force=args.get("force") is True,
            per_gpu=self.per_gpu,
        )
        self.target = n
        now = fleet_text(running, restarting, starting, before)
        self.membership.event(
            "scale_requested", "", f"{now} -> {n} sampler(s), applied at the next sync", samplers=active, target=n
        )
        self.log(f"scale: {now} -> {n} sampler(s) asked; applied at the next weight sync")
        self._start_missing(n)  # now: a start takes long, and the driver may wait for a batch meanwhile
        return {
            "samplers": active,
            "running": running,
            "restarting": restarting,
            "starting": starting,
            "previous_target": before,
            "target": n,
            "step": self.membership.step,
        }

    async def at_sync(self) -> None:
        """Apply the target before a sync (nothing group-wide is in flight): add the samplers
        started since, drain the ones on a node that is leaving, start the ones missing (a sampler
        lost for good or drained with its node, when a target is set), drain the ones too many."""
        self._admit()
        self._drain_leaving_nodes()
        if self.target is None:
            return
        self._start_missing(self.target)
        if self.target < self.active():
            self._drain(self.active() - self.target)

    def _start_missing(self, target: int) -> None:
        for _ in range(target - self.active()):
            self._start(self.next_index)
            self.next_index += 1

    def progress(self) -> ScalingProgress:
        """For progress.json and ``asyncrl status``: the target from the start (the run's count
        until a scale is asked), and the samplers starting."""
        return ScalingProgress(
            samplers_target=self.current_target(), samplers_starting=sorted(f"sampler{i}" for i in self.starting)
        )

    async def close(self) -> None:
        """Cancel the starts under way and wait (bounded) for them and the stops of drained ones."""
        self.closed = True
        for task in self.starting.values():
            task.cancel()
        self.starting.clear()
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_S)
            if pending:
                self.log(f"scale: {len(pending)} start(s) or stop(s) still running {STOP_S:g} s after the run ended")

    # --- the changes ------------------------------------------------------------------------------

    def _start(self, index: int) -> None:
        started = time.monotonic()
        task = self._track(self._spawn_one(index))
        self.starting[index] = task
        self.membership.event("scale_starting", f"sampler{index}", "spawned by a scale-up")

        def done(task: asyncio.Task, index: int = index) -> None:
            if not task.cancelled() and task.exception() is None:
                self.log(
                    f"scale: sampler{index} is up ({time.monotonic() - started:.1f} s); "
                    "it joins the group at the next sync"
                )
            if not self.membership.with_state(MemberState.JOINED):
                # No sampler in the group: the driver waits for a batch, and no sync comes until
                # one joins, so this one joins now (the pool rebuilds for a candidate at once).
                self._admit()
            self.membership.changed.set()

        task.add_done_callback(done)

    def _admit(self) -> None:
        """Samplers whose start ended: the ones up join the pool as candidates; one whose start
        failed lowers the target (starting it again would fail again), said in one line."""
        for index, task in list(self.starting.items()):
            if not task.done():
                continue
            del self.starting[index]
            error = None if task.cancelled() else task.exception()
            handle = None if task.cancelled() or error is not None else task.result()
            if handle is not None and not handle.info().state.final:
                self.pool.membership.add(handle, self.source.seed_of(index))
                continue
            why = (
                first_line(error)
                if error is not None
                else first_line(handle.info().error or handle.info().state)
                if handle is not None
                else "cancelled"
            )
            if self.target is not None and self.target > self.active():
                self.target = self.active()
            self.membership.event("scale_failed", f"sampler{index}", why, target=self.target)
            self.log(f"scale: sampler{index} did not come up ({why}); the target is now {self.target} sampler(s)")

    def _drain(self, count: int) -> None:
        for index in sorted(self.starting, reverse=True)[:count]:  # a start cancelled kills its process
            self.starting.pop(index).cancel()
            self.membership.event("drained", f"sampler{index}", "its start was cancelled by a scale-down")
            count -= 1
        live = [m for m in self.membership.members if m.state in _DRAIN_ORDER]
        live.sort(key=lambda m: (_DRAIN_ORDER[m.state], -m.index))
        for m in live[:count]:
            self.membership.drain(m, f"scaled down to {self.target} sampler(s)")
            self._track(self._stop_drained(m))

    def _drain_leaving_nodes(self) -> None:
        """Every sampler on a node that is leaving (its agent was told to stop: ``draining`` in
        the cluster's view) leaves the group now, as a scale-down's do: its stream is cut, what it
        was making is handed back, the sync that follows re-forms the group once without all of
        them, and its process is stopped, which lets the node's agent go."""
        for node in self.source.nodes():
            if not node.draining or node.rank in self.leaving:
                continue
            self.leaving.add(node.rank)
            why = f"its node {node.rank} ({node.hostname}) is leaving ({node.state.split(': ', 1)[-1]})"
            here = [m for m in self.membership.members if m.state in _DRAIN_ORDER and m.handle.info().node == node.rank]
            self.membership.event("node_leaving", "", why, node=node.rank, samplers=len(here))
            self.log(f"scale: node {node.rank} is leaving: draining {len(here)} sampler(s) there")
            for m in here:
                self.membership.drain(m, why)
                self._track(self._stop_drained(m))

    async def _spawn_one(self, index: int) -> SamplerHandle:
        if self._one_at_a_time is None:
            return await self.source(index)
        async with self._one_at_a_time:
            return await self.source(index)

    async def _stop_drained(self, m: Member) -> None:
        await self.source.stop(m.handle)
        self.log(f"scale: {m.name} stopped")

    def _track(self, coro: Awaitable[object]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None and task not in self.starting.values():
            self.log(f"scale: {task.get_name()} failed: {first_line(error)}")


def scale(run_dir: str, samplers: int, timeout_s: float = 5.0, force: bool = False) -> dict[str, Any]:
    """Ask the live run in ``run_dir`` to run ``samplers`` samplers (what ``asyncrl scale`` does;
    ``force``: past the CPU cores): ``{"samplers": before, "running", "restarting", "starting",
    "previous_target", "target": samplers, "step"}`` once the run accepted it (applied at its next
    sync). Raises `CommandRefusedError` with the run's one line if it refused, and a
    `StatusUnavailableError` if no live run serves ``run_dir`` or none answered in ``timeout_s``."""
    from asyncrl.runtime.status import send_command

    args: dict[str, Any] = {"samplers": samplers} | ({"force": True} if force else {})
    return send_command(run_dir, "scale", args, timeout_s)
