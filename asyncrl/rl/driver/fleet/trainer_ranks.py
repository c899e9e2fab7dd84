"""The driver's side of the trainer's ranks (``--trainer.world_size N``): spawning the ranks,
forming their group, and `TrainerRanks`, the handle the driver uses for the trainer, one rank
included (then every call goes to that rank's handle as it is: no group, no verdict).

`TrainerRanks` makes the trainer's calls, each with its endpoint's own signature (mypy checks them
as it checks a handle's). A call that runs collectives on the trainer group goes to every rank at
once with the call's deadline (each rank is told it, as ``deadline_s``), and the answer is rank
0's; the others (joining the weight-sync group, of which rank 0 alone is a member; the progress of
an evaluation) go to rank 0. One verdict per call, naming the rank that caused a failure:

* a rank that died: its death (`ActorDiedError`, naming the rank), at once; the survivors are told
  (`abort_call`), so they leave their collectives even where the backend (NCCL) would not notice;
* a rank whose call raised by itself: a `TrainerRankFailedError` naming the rank and its error
  (for train steps and evaluations; for the calls whose callers read the remote error, such as a
  full disk in a checkpoint write, that rank's `RemoteError` as it is);
* a rank that did not answer within the call's deadline: its `CallTimeoutError`;
* ranks that only left their collectives because of a peer (`LEFT_FOR_A_PEER`) are never the cause.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from asyncrl.comm.address import SyncAddress
from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.config.trainer import TrainerConfig
from asyncrl.rl.driver.faults import RunStoppedError
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.trainer.errors import LEFT_FOR_A_PEER
from asyncrl.runtime.handle import ActorHandle
from asyncrl.runtime.record import ActorStatus
from asyncrl.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    import torch

    from asyncrl.comm.sync_stats import SyncStats
    from asyncrl.rl.model.tally import HeldoutAsk, HeldoutPart
    from asyncrl.rl.rollout import RolloutGroup
    from asyncrl.rl.trainer.actor import TrainerActor
    from asyncrl.rl.trainer.metrics import TrainStepMetrics

T = TypeVar("T")
RankCall = Callable[["ActorHandle[TrainerActor]", float], Awaitable[T]]
"""One call of a rank, given the deadline its side of it is told (``deadline_s``; 0: none)."""
ABORT_CALL_S = 10.0
GROUP_NAME = "trainer"
"""The trainer group's name on its rendezvous (its store keys live under ``asyncrl/trainer/``)."""


class TrainerRankFailedError(RunStoppedError):
    """One trainer rank failed during a call; the message names it, its error, and the ranks that
    left their collectives because of it."""


class TrainerRanks:
    """The trainer's N ranks as one trainer (see the module docstring). Each method is the
    trainer's endpoint of the same name, without the ``deadline_s`` its ranks are told: the
    deadline of `with_timeout` is theirs too."""

    def __init__(self, handles: list[ActorHandle[TrainerActor]], timeout_s: float | None = None):
        self.handles = list(handles)
        self._timeout_s = timeout_s
        self._aborts: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        return self.handles[0].name

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def info(self) -> ActorStatus:
        """Rank 0's status, as the supervisor sees it now (its node: where the weight-sync group meets)."""
        return self.handles[0].info()

    def with_timeout(self, timeout_s: float) -> TrainerRanks:
        ranks = TrainerRanks(self.handles, timeout_s)
        ranks._aborts = self._aborts
        return ranks

    # --- the calls that run collectives on the trainer group: made on every rank together -------

    def train_step(self, groups: list[RolloutGroup]) -> Awaitable[TrainStepMetrics]:
        return self._every_rank("train_step", lambda h, d: h.train_step(groups, d), stops_the_run=True)

    def evaluate(
        self, samples: int = 4, max_new_tokens: int = 0, batch_size: int = 64
    ) -> Awaitable[dict[str, float | dict[str, int]]]:
        return self._every_rank(
            "evaluate", lambda h, d: h.evaluate(samples, max_new_tokens, batch_size, d), stops_the_run=True
        )

    def evaluate_heldout(self, ask: HeldoutAsk) -> Awaitable[list[HeldoutPart]]:
        return self._every_rank("evaluate_heldout", lambda h, d: h.evaluate_heldout(ask, d), stops_the_run=True)

    def setup_sender(
        self, timeout_s: float = 60.0, bucket_bytes: int = 0, wire_dtype: str = "", delta: bool = False
    ) -> Awaitable[int]:
        # bounded by its own timeout_s (the weight sync's), not by a deadline of the group's
        return self._every_rank("setup_sender", lambda h, _: h.setup_sender(timeout_s, bucket_bytes, wire_dtype, delta))

    def send_weights(self, version: int) -> Awaitable[SyncStats]:
        return self._every_rank("send_weights", lambda h, _: h.send_weights(version))

    def save(self, path: str, extra_files: dict[str, str] | None = None) -> Awaitable[str]:
        return self._every_rank("save", lambda h, d: h.save(path, extra_files, d))

    def save_checkpoint(self, run_dir: str, step: int, keep: int, run_state: bytes) -> Awaitable[str]:
        return self._every_rank("save_checkpoint", lambda h, d: h.save_checkpoint(run_dir, step, keep, run_state, d))

    def load_checkpoint(self, path: str) -> Awaitable[int]:
        return self._every_rank("load_checkpoint", lambda h, d: h.load_checkpoint(path, d))

    def check_fits(self, longest: int) -> Awaitable[None]:
        return self._every_rank("check_fits", lambda h, _: h.check_fits(longest))

    def weights_digest(self) -> Awaitable[str]:
        return self._every_rank("weights_digest", lambda h, d: h.weights_digest(d))

    def gradients(self) -> Awaitable[dict[str, torch.Tensor]]:
        return self._every_rank("gradients", lambda h, d: h.gradients(d))

    # --- rank 0's alone: the weight-sync group (of which rank 0 alone is a member), the progress --

    def sync_listen(self, host: str, port: int = 0) -> Awaitable[int]:
        return self._rank(0).sync_listen(host, port)

    def sync_join(self, address: SyncAddress, rank: int) -> Awaitable[str]:
        return self._rank(0).sync_join(address, rank)

    def sync_created(self) -> Awaitable[dict[str, int]]:
        return self._rank(0).sync_created()

    def heldout_progress(self) -> Awaitable[list[int]]:
        return self._rank(0).heldout_progress()

    def _every_rank(self, what: str, call: RankCall[T], *, stops_the_run: bool = False) -> Awaitable[T]:
        """One rank: its handle's call as it is (no group, no verdict, no deadline of the group's)."""
        if len(self.handles) == 1:
            return call(self._rank(0), 0.0)
        return self._all(what, call, stops_the_run)

    def _rank(self, r: int) -> ActorHandle[TrainerActor]:
        handle = self.handles[r]
        return handle.with_timeout(self._timeout_s) if self._timeout_s is not None else handle

    async def _all(self, what: str, call: RankCall[T], stops_the_run: bool) -> T:
        deadline_s = self._timeout_s or 0.0  # each rank's side of the call ends within the group's deadline
        answers = await call_all(
            self.handles, lambda h, _: call(h, deadline_s), timeout_s=self._timeout_s, what=what, died=self._died
        )
        if answers.ok:
            return answers.values()[0]
        raise self._verdict(what, answers.results, stops_the_run=stops_the_run)

    def _died(self, rank: int, error: ActorDiedError) -> None:
        """A rank that died leaves no record for its peers: tell them, so they leave at once."""
        reason = f"died ({error.reason})"
        for r, handle in enumerate(self.handles):
            if r != rank:
                task = asyncio.ensure_future(handle.with_timeout(ABORT_CALL_S).abort_call(rank, reason))
                self._aborts.add(task)
                task.add_done_callback(_forget(self._aborts))

    def _verdict(self, method: str, results: Sequence[object], *, stops_the_run: bool) -> BaseException:
        """The one error of a failed call (see the module docstring). ``stops_the_run``: the call is
        a train step or an evaluation, whose every failure is a rank's (else a rank's own
        `RemoteError` is passed on as it is: its caller reads it, a full disk say)."""
        errors = {r: x for r, x in enumerate(results) if isinstance(x, BaseException)}
        victims = {r: x for r, x in errors.items() if isinstance(x, RemoteError) and isinstance(x, LEFT_FOR_A_PEER)}
        left = sorted(victims)
        also = f"; rank(s) {', '.join(map(str, left))} left their collectives" if left else ""
        for r, x in errors.items():
            if isinstance(x, ActorDiedError):
                return ActorDiedError(self.handles[r].name, f"trainer rank {r}: {x.reason}{also}")
        for r, x in errors.items():
            if r in victims or isinstance(x, CallTimeoutError):
                continue
            if isinstance(x, RemoteError) and not stops_the_run:
                return x
            what = (
                f"{x.remote_type}: {first_line(x.remote_message)}"
                if isinstance(x, RemoteError)
                else f"{type(x).__name__}: {first_line(x)}"
            )
            error = TrainerRankFailedError(
                f"trainer rank {r} ({self.handles[r].name}) failed during {method}: {what}{also}"
            )
            error.__cause__ = x
            return error
        for x in errors.values():
            if isinstance(x, CallTimeoutError):
                return x
        r, x = next(iter(victims.items()))
        return TrainerRankFailedError(
            f"trainer rank {r} failed during {method}: {x.remote_type}: {first_line(x.remote_message)}"
        )


def _forget(tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # an abort sent to a rank that died too (its node lost, say) fails: expected

    return done


def node_address(sup: Supervisor, handle: ActorHandle) -> str:
    """The address at which actors on other nodes reach the node that ``handle``'s actor runs on:
    where a store hosted by that actor must listen (the driver's own ``ASYNCRL_NODE_ADDR`` names
    node 0, which is wrong for an actor placed on another node)."""
    node = handle.info().node
    (status,) = [n for n in sup.nodes() if n.rank == node]
    return status.address


async def spawn_trainer_ranks(
    sup: Supervisor,
    model_path: str,
    config: TrainerConfig,
    *,
    timeout_s: float,
    gpus: int,
    env: dict[str, str],
    options: dict[str, object],
    nodes: list[int | None] | None = None,
    host: str | None = None,
) -> TrainerRanks:
    """Spawn ``config.world_size`` trainer ranks (rank 0 named ``trainer``, the others
    ``trainer-<r>``; ``options``: `TrainerActor`'s keyword arguments), concurrently, on ``nodes``
    (one per rank; None: where the supervisor puts them), and form their group: every join at once,
    under one deadline, ``timeout_s`` (the rendezvous contract); a rank that fails to start or to
    join fails the whole call, naming it. The group's store is hosted by rank 0 on ``host``, by
    default the address of rank 0's node (`node_address`). One rank forms no group: it is built
    whole."""
    from asyncrl.comm.rendezvous import join_all
    from asyncrl.rl.trainer.actor import TrainerActor

    world_size = config.world_size
    names = [GROUP_NAME] + [f"{GROUP_NAME}-{r}" for r in range(1, world_size)]
    nodes = nodes or [None] * world_size
    spawned = await asyncio.gather(
        *(
            sup.spawn(TrainerActor, model_path, config, name=name, gpus=gpus, env=env, kwargs=options, node=node)
            for name, node in zip(names, nodes)
        ),
        return_exceptions=True,
    )
    failed = [x for x in spawned if isinstance(x, BaseException)]
    if failed:
        await asyncio.gather(
            *(sup.stop(h) for h in spawned if not isinstance(h, BaseException)), return_exceptions=True
        )
        raise failed[0]
    ranks = [h for h in spawned if not isinstance(h, BaseException)]  # all of them: none failed
    if world_size == 1:
        return TrainerRanks(ranks)
    host = host or node_address(sup, ranks[0])
    port = await ranks[0].with_timeout(timeout_s).rank_listen(host)
    address = SyncAddress(host=host, port=port, world_size=world_size, timeout_s=timeout_s, name=GROUP_NAME)
    joins = [h.with_timeout(timeout_s + 10).rank_join(address, r) for r, h in enumerate(ranks)]
    await join_all(joins, timeout_s + 15, what="form the trainer group")
    return TrainerRanks(ranks)
