"""The driver's side of the trainer's ranks (``--trainer.world_size N``): spawning the ranks,
forming their group, and `TrainerRanks`, the handle the driver uses for the trainer, one rank
included (then every call goes to that rank's handle as it is: no group, no verdict).

`TrainerRanks` makes the same calls as a trainer handle. A call that runs collectives on the
trainer group (each one of its methods) goes to every rank at once with the call's deadline, and the answer is
rank 0's; anything else (joining the weight-sync group, of which rank 0 alone is a member) goes to
rank 0. One verdict per call, naming the rank that caused a failure:

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
from collections.abc import Awaitable
from typing import Any

from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.driver.faults import RunStoppedError
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.trainer.errors import LEFT_FOR_A_PEER

_DEADLINE_ARG = frozenset(
    {
        "train_step",
        "evaluate",
        "evaluate_heldout",
        "save",
        "save_checkpoint",
        "load_checkpoint",
        "weights_digest",
        "gradients",
    }
)
"""Of the calls made on every rank (`TrainerRanks`' methods), the ones whose deadline the ranks are
told (``deadline_s``); the weight sync's calls carry their own (``sync_timeout_s``)."""
_STOPS_THE_RUN = frozenset({"train_step", "evaluate", "evaluate_heldout"})
ABORT_CALL_S = 10.0


class TrainerRankFailedError(RunStoppedError):
    """One trainer rank failed during a call; the message names it, its error, and the ranks that
    left their collectives because of it."""


class TrainerRanks:
    """The trainer's N ranks as one trainer (see the module docstring)."""

    def __init__(self, handles: list[Any], timeout_s: float | None = None):
        self.handles = list(handles)
        self._timeout_s = timeout_s
        self._aborts: set[asyncio.Task] = set()

    @property
    def name(self) -> str:
        return self.handles[0].name

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def with_timeout(self, timeout_s: float) -> TrainerRanks:
        ranks = TrainerRanks(self.handles, timeout_s)
        ranks._aborts = self._aborts
        return ranks

    # --- the calls that run collectives on the trainer group: made on every rank together -------

    def train_step(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("train_step", args, kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("evaluate", args, kwargs)

    def evaluate_heldout(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("evaluate_heldout", args, kwargs)

    def setup_sender(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("setup_sender", args, kwargs)

    def send_weights(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("send_weights", args, kwargs)

    def save(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("save", args, kwargs)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("save_checkpoint", args, kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("load_checkpoint", args, kwargs)

    def weights_digest(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("weights_digest", args, kwargs)

    def gradients(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._every_rank("gradients", args, kwargs)

    def __getattr__(self, method: str) -> Any:
        """Any other call (joining the weight-sync group, stats): rank 0's alone."""
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self._rank(0), method)

    def _every_rank(self, method: str, args: tuple, kwargs: dict) -> Awaitable[Any]:
        """One rank: its handle's call as it is (no group, no verdict, no deadline added)."""
        if len(self.handles) == 1:
            return getattr(self._rank(0), method)(*args, **kwargs)
        return self._all(method, args, kwargs)

    def _rank(self, r: int) -> Any:
        handle = self.handles[r]
        return handle.with_timeout(self._timeout_s) if self._timeout_s is not None else handle

    async def _all(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self._timeout_s is not None and method in _DEADLINE_ARG:
            kwargs = {**kwargs, "deadline_s": self._timeout_s}
        answers = await call_all(
            self.handles,
            lambda h, _: getattr(h, method)(*args, **kwargs),
            timeout_s=self._timeout_s,
            what=method,
            died=self._died,
        )
        if answers.ok:
            return answers.results[0]
        raise self._verdict(method, answers.results)

    def _died(self, rank: int, error: ActorDiedError) -> None:
        """A rank that died leaves no record for its peers: tell them, so they leave at once."""
        reason = f"died ({error.reason})"
        for r, handle in enumerate(self.handles):
            if r != rank:
                task = asyncio.ensure_future(handle.with_timeout(ABORT_CALL_S).abort_call(rank, reason))
                self._aborts.add(task)
                task.add_done_callback(_forget(self._aborts))

    def _verdict(self, method: str, results: list[Any]) -> BaseException:
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
            if isinstance(x, RemoteError) and method not in _STOPS_THE_RUN:
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


def _forget(tasks: set) -> Any:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # an abort sent to a rank that died too (its node lost, say) fails: expected

    return done


def node_address(sup: Any, handle: Any) -> str:
    """The address at which actors on other nodes reach the node that ``handle``'s actor runs on:
    where a store hosted by that actor must listen (the driver's own ``ASYNCRL_NODE_ADDR`` names
    node 0, which is wrong for an actor placed on another node)."""
    node = handle.info().node
    (status,) = [n for n in sup.nodes() if n.rank == node]
    return status.address


async def spawn_trainer_ranks(
    sup: Any,
    cls: type,
    args: tuple,
    *,
    world_size: int,
    host: str | None,
    timeout_s: float,
    gpus: int,
    env: dict[str, str],
    kwargs: dict[str, Any],
    nodes: list[int | None] | None = None,
) -> TrainerRanks:
    """Spawn ``world_size`` trainer ranks (rank 0 named ``trainer``, the others ``trainer-<r>``),
    concurrently, on ``nodes`` (one per rank; None: where the supervisor puts them), and form
    their group: every join at once, under one deadline (the rendezvous contract); a rank that
    fails to start or to join fails the whole call, naming it. The group's store is hosted by rank
    0 on ``host``, by default the address of rank 0's node (`node_address`). One rank forms no
    group."""
    from asyncrl.comm.rendezvous import join_all

    names = ["trainer"] + [f"trainer-{r}" for r in range(1, world_size)]
    nodes = nodes or [None] * world_size
    spawned = await asyncio.gather(
        *(
            sup.spawn(cls, *args, name=name, gpus=gpus, env=env, kwargs=kwargs, node=node)
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
    joins = [
        h.with_timeout(timeout_s + 10).rank_join(host, port, r, world_size, timeout_s) for r, h in enumerate(ranks)
    ]
    await join_all(joins, timeout_s + 15, what="form the trainer group")
    return TrainerRanks(ranks)
