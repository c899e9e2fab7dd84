"""Weight transfer: `WeightSender` on the trainer, `WeightReceiver` on each sampler.

One sync, on every member, in the same order on the communicator:

1. **Vote** (one small all_reduce): every member contributes its ``(version, layout hash)`` and
   whether it refuses (a version not newer than its last, tensors that do not match the layout).
   All members learn the same result, so a refusal fails the sync on every member before any
   weight moves.
2. **Buckets**: bucket k is packed into one of two staging buffers while bucket k-1 is on the wire
   (GPU: a copy stream and the communicator's stream ordered by events; CPU: gloo's threads), then
   broadcast from the sender; receivers unpack bucket k while bucket k+1 arrives.
3. **Commit vote**: each member reports whether it applied every bucket. It completes only after
   every receiver unpacked everything, so a sender that returns knows every receiver holds the
   same bytes, and a failure anywhere fails the sync everywhere.

Extra memory on either side is the two staging buffers (at most two buckets), whatever the model
size. A receiver whose consumer wants whole tensors (not in-place copies) also needs one
temporary per tensor that is larger than a bucket, while it is assembled (``delivery.py``: what
a receiver hands a consumer). What each member measured of a sync is a `SyncStats`
(``sync_stats.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping

import msgspec
import torch

from asyncrl.comm.communicator import Communicator
from asyncrl.comm.delivery import BatchConsumer, ConsumerGuard, Destination, deliver_bucket
from asyncrl.comm.errors import LayoutMismatchError, WeightSyncError
from asyncrl.comm.layout import WeightLayout, default_bucket_bytes, sender_layout
from asyncrl.comm.phase_clock import COPY, TRANSFER
from asyncrl.comm.rendezvous import StoreGroup
from asyncrl.comm.staging import CopyPlan, Staging, tensor_part
from asyncrl.comm.sync_stats import SyncStats
from asyncrl.comm.transfer_hook import at_transfer_start

BucketSource = Callable[[int], list[torch.Tensor]]
"""A sender's tensors produced a bucket at a time: called with bucket ``k`` (in order, once per
sync), it returns the parts of bucket k's segments, in order, each shaped as its staging view
(a sharded model gathers each bucket's parameters here: never the whole model at once)."""


class _SetupResult(msgspec.Struct, array_like=True, frozen=True):
    rank: int
    error: str  # empty when this member accepts the layout


class _WeightSync:
    """What sender and receiver share: the layout, the staging buffers and the two votes."""

    def __init__(self, comm: Communicator, layout: WeightLayout, src: int, timeout_s: float):
        self.comm = comm
        self.layout = layout
        self.layout_hash = layout.digest()
        self.src = src
        self.timeout_s = timeout_s
        self.last_version = -1
        self._deadline = 0.0
        self.staging = Staging(comm, layout, self._remaining)
        self._expected = [(spec.name, torch.Size(spec.shape), spec.torch_dtype) for spec in layout.tensors]
        self._chunked = [spec.name for spec in layout.tensors if spec.nbytes > layout.bucket_bytes]
        self._total_bytes = layout.total_bytes
        self._plan_key: tuple[int, ...] = ()
        self._plan: list[CopyPlan] = []

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            remaining = 1e-3  # the wait itself raises the timeout, naming the operation
        return remaining

    @property
    def _who(self) -> str:
        return f"group {self.comm.group!r} rank {self.comm.rank}"

    def _agree(self, version: int, refusal: str) -> None:
        """First vote: same version, same layout, nobody refusing; else fail everywhere."""
        h = self.layout_hash
        code = self.comm.rank + 1 if refusal else 0
        vmax, vneg, hmax, hneg, refuser = self.staging.vote([version, -version, h, -h, code])
        if refusal:
            raise WeightSyncError(f"{self._who} refused weight sync v{version}: {refusal}")
        if hmax != -hneg:
            raise LayoutMismatchError(f"{self._who}: members disagree on the weight layout in sync v{version}")
        if vmax != -vneg:
            raise WeightSyncError(
                f"{self._who}: members disagree on the version of this sync (from v{-vneg} to v{vmax})"
            )
        if refuser:
            raise WeightSyncError(f"{self._who}: rank {refuser - 1} refused weight sync v{version} (see its error)")

    def _commit(self, version: int, failure: str) -> None:
        """Second vote: succeeds only if every member applied every bucket."""
        (failed,) = self.staging.vote([self.comm.rank + 1 if failure else 0])
        if failure:
            raise WeightSyncError(f"{self._who}: weight sync v{version} failed here: {failure}")
        if failed:
            raise WeightSyncError(f"{self._who}: weight sync v{version} failed on rank {failed - 1}")

    def _run(self, version: int, refusal: str, move: Callable[[], str], timeout_s: float | None) -> SyncStats:
        """Vote, move the buckets, commit, within ``timeout_s`` (default: the one given at set-up).
        ``move`` returns "" or why this member could not apply what it received; it must keep
        taking part in every transfer either way, so that the members' sequences of collectives
        stay identical and the commit vote can report it."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if not refusal and version <= self.last_version:
            refusal = f"version {version} is not newer than the last synced v{self.last_version}"
        start = time.perf_counter()
        self._deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self.staging.begin()
        try:
            self._agree(version, refusal)
            voted = time.perf_counter()
            at_transfer_start(self.comm.rank, version)  # test-only; inert unless its variable is set
            failure = move()
            moved = time.perf_counter()
            self._commit(version, failure)
            self.last_version = version
        except BaseException:
            self.last_version = max(self.last_version, version)  # a failed version is never reused
            raise
        finally:
            self.staging.end()
        end = time.perf_counter()
        phases = self.staging.clock.totals()  # after the commit: every span's work has completed
        return SyncStats(
            version,
            self._total_bytes,
            len(self.layout.buckets),
            end - start,
            vote_s=voted - start,
            move_s=moved - voted,
            commit_s=end - moved,
            copy_s=phases[COPY],
            transfer_s=phases[TRANSFER],
        )

    def _refusal(self, tensors: Mapping[str, torch.Tensor], who: str) -> str:
        """Everything that could stop this member half-way is checked before the first vote."""
        if not self._matches(tensors):
            return _mismatch(self._expected, tensors, who)
        for name in self._chunked:
            if not tensors[name].is_contiguous():
                return f"{name} is larger than a bucket and must be contiguous to be synced in chunks"
        return ""

    def _matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """The fast path of `WeightLayout.check`, which only runs to explain a mismatch."""
        if len(tensors) != len(self._expected):
            return False
        for name, shape, dtype in self._expected:
            t = tensors.get(name)
            if t is None or t.shape != shape or t.dtype != dtype:
                return False
        return True

    def _plan_for(self, tensors: Mapping[str, torch.Tensor], staging_is_dst: bool) -> list[CopyPlan]:
        """The copy plan for these tensors, rebuilt only when they are not the same objects as
        last time (a model's parameters are; a fresh ``state_dict()`` each step is not)."""
        ordered = [tensors[spec.name] for spec in self.layout.tensors]
        key = tuple(id(t) for t in ordered)
        if key != self._plan_key:
            plans = []
            for k, bucket in enumerate(self.layout.buckets):
                parts = [tensor_part(ordered[seg.tensor], seg, self.layout.tensors[seg.tensor]) for seg in bucket]
                views = self.staging.views[k]
                plans.append(CopyPlan(views, parts) if staging_is_dst else CopyPlan(parts, views))
            self._plan_key, self._plan = key, plans
            self._plan_tensors = ordered  # keeps the ids in the key from being reused
        return self._plan


class WeightSender(_WeightSync):
    """The trainer's side. Holds references to the tensors (normally a model's parameters, updated
    in place by the optimizer), never a copy of them."""

    def __init__(self, comm: Communicator, layout: WeightLayout, tensors: Mapping[str, torch.Tensor], timeout_s: float):
        super().__init__(comm, layout, comm.rank, timeout_s)
        self.tensors = dict(tensors)

    @classmethod
    def create(
        cls,
        comm: Communicator,
        group: StoreGroup,
        tensors: Mapping[str, torch.Tensor],
        *,
        bucket_bytes: int | None = None,
        timeout_s: float = 60.0,
        wire_dtype: torch.dtype | None = None,
        allow_direct: bool = True,
    ) -> WeightSender:
        """Agree on the layout with every receiver (they call `WeightReceiver.create` together).
        ``wire_dtype``: send floating-point tensors in this dtype (e.g. fp32 master weights to
        bf16 samplers); the cast happens while packing, so it costs no extra memory.
        ``allow_direct=False``: every tensor goes through the buckets (a sender whose tensors
        come from a `BucketSource`, a sharded model's, has no whole tensor to send from)."""
        layout = sender_layout(
            tensors, bucket_bytes or default_bucket_bytes(comm.device), wire_dtype, allow_direct, device=comm.device
        )
        deadline = time.monotonic() + timeout_s  # the driver allows this call only a margin beyond it
        group.broadcast_obj(layout, src=comm.rank, type=WeightLayout, timeout_s=timeout_s, what="the weight layout")
        _agree_on_setup(group, "", deadline)
        sender = cls(comm, layout, tensors, timeout_s)
        sender._expected = [(n, t.shape, t.dtype) for n, t in tensors.items()]  # local dtypes, not the wire's
        return sender

    def send(
        self, version: int, tensors: Mapping[str, torch.Tensor] | None = None, *, source: BucketSource | None = None
    ) -> SyncStats:
        """Broadcast the tensors (those given at set-up unless others are given) as ``version``;
        with ``source``, each bucket's contents come from it (the tensors are only checked
        against the layout, by name, shape and dtype)."""
        tensors = self.tensors if tensors is None else tensors
        refusal = self._refusal(tensors, f"sender rank {self.comm.rank}")
        if source is not None:
            if self.layout.direct:
                raise WeightSyncError("a bucket source needs a layout without direct tensors (allow_direct=False)")
            return self._run(version, refusal, lambda: self._move_from(source), None)
        return self._run(version, refusal, lambda: self._move(self._plan_for(tensors, staging_is_dst=True)), None)

    def _move_from(self, source: BucketSource) -> str:
        staging = self.staging
        for k in range(len(self.layout.buckets)):
            parts = source(k)  # on the caller's stream: on GPU the copy stream must wait for it
            producer = torch.cuda.current_stream(self.comm.device) if staging.cuda else None
            with staging.copy(k):
                if producer is not None:
                    torch.cuda.current_stream(self.comm.device).wait_stream(producer)
                    for part in parts:  # freed after this loop: not reused until the copy is done
                        part.record_stream(staging.copy_stream)
                torch._foreach_copy_(staging.views[k], parts)
            staging.transfer(k, self.src)
        return ""

    def _move(self, plan: list[CopyPlan]) -> str:
        for i in self.layout.direct:  # first: they need no packing, which meanwhile fills bucket 0
            self.staging.transfer_direct(self._plan_tensors[i], self.src)
        for k in range(len(self.layout.buckets)):
            with self.staging.copy(k):
                plan[k].run()
            self.staging.transfer(k, self.src)
        return ""


class WeightReceiver(_WeightSync):
    """A sampler's side. ``receive`` copies into a mapping of tensors in place, or hands each whole
    tensor to a consumer callable as a view that is valid only during the call; with
    ``batched=True`` the consumer takes a list, once a bucket: every tensor the bucket completed."""

    @classmethod
    def create(
        cls,
        comm: Communicator,
        group: StoreGroup,
        *,
        src: int = 0,
        expect: Mapping[str, torch.Tensor] | None = None,
        timeout_s: float = 60.0,
    ) -> WeightReceiver:
        """Receive the sender's layout; if ``expect`` is given, check it holds exactly those names,
        shapes and dtypes. A mismatch on any member fails set-up on every member."""
        deadline = time.monotonic() + timeout_s  # the driver allows this call only a margin beyond it
        layout = group.broadcast_obj(None, src=src, type=WeightLayout, timeout_s=timeout_s, what="the weight layout")
        error = ""
        if expect is not None:
            try:
                layout.check(expect, f"receiver rank {comm.rank}")
            except LayoutMismatchError as exc:
                error = str(exc)
        _agree_on_setup(group, error, deadline)
        return cls(comm, layout, src, timeout_s)

    def receive(
        self, version: int, into: Destination | BatchConsumer, *, timeout_s: float | None = None, batched: bool = False
    ) -> SyncStats:
        """Take ``version`` into ``into`` within ``timeout_s`` (default: the one given at set-up;
        a caller that already spent part of its own deadline, say waiting for a pause, passes
        what is left, so that its error comes before its caller stops waiting for it).
        ``batched``: ``into`` is a `BatchConsumer`."""
        if isinstance(into, Mapping):
            if batched:
                raise TypeError("batched applies to a consumer, not to a mapping of tensors")
            refusal = self._refusal(into, f"receiver rank {self.comm.rank}")
        elif callable(into):
            refusal = ""
        else:
            raise TypeError("into must be a mapping of tensors or a callable(name, tensor)")
        return self._run(version, refusal, lambda: self._move(into, batched), timeout_s)

    def _move(self, into: Destination | BatchConsumer, batched: bool) -> str:
        layout = self.layout
        consumer = None if isinstance(into, Mapping) else ConsumerGuard(into, batched)
        plan = self._plan_for(into, staging_is_dst=False) if consumer is None else None
        if consumer is not None:
            for spec in layout.tensors:  # empty tensors carry no bytes but are still delivered
                if spec.nbytes == 0:
                    consumer(spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.comm.device))
            consumer.flush()
        self._move_direct(into, consumer)
        partial: dict[int, torch.Tensor] = {}  # tensors larger than a bucket, being assembled
        if layout.buckets:
            self.staging.transfer(0, self.src)
        for k in range(len(layout.buckets)):
            if k + 1 < len(layout.buckets):  # bucket k+1 arrives while bucket k is unpacked
                self.staging.transfer(k + 1, self.src)
            with self.staging.copy(k):
                if plan is not None:
                    plan[k].run()
                else:
                    deliver_bucket(consumer, layout, k, self.staging.views[k], partial)
                    consumer.flush()  # while bucket k's views are valid: k+2 reuses its buffer
        return consumer.failure if consumer is not None else ""

    def _move_direct(self, into: Destination, consumer: ConsumerGuard | None) -> None:
        """Tensors sent whole: received in place, or into temporaries handed to the consumer."""
        received = []
        for i in self.layout.direct:
            spec = self.layout.tensors[i]
            if consumer is None and into[spec.name].device == self.comm.device:
                self.staging.transfer_direct(into[spec.name], self.src)
                continue
            # A temporary on the communicator's device: for the consumer, or for a destination on
            # another device (a CUDA model taking weights over gloo), copied there once received.
            with torch.cuda.stream(self.staging.comm_stream) if self.staging.cuda else contextlib.nullcontext():
                whole = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.comm.device)
            self.staging.transfer_direct(whole, self.src)
            received.append((spec.name, whole))
        if received:
            self.staging.direct_done()
            copy_stream = self.staging.copy_stream if self.staging.cuda else None
            with (
                torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext(),
                self.staging.clock.span(COPY, copy_stream),
            ):
                for name, whole in received:
                    if consumer is None:
                        into[name].copy_(whole)
                    else:
                        consumer(name, whole)
                if consumer is not None:
                    consumer.flush()


def _mismatch(
    expected: list[tuple[str, torch.Size, torch.dtype]], tensors: Mapping[str, torch.Tensor], who: str
) -> str:
    """Why ``tensors`` do not fit what this member agreed to at set-up (names, shapes, dtypes)."""
    problems = []
    for name, shape, dtype in expected:
        t = tensors.get(name)
        if t is None:
            problems.append(f"{name}: {who} has no such tensor")
        elif t.shape != shape or t.dtype != dtype:
            problems.append(f"{name}: agreed {list(shape)} {dtype}, now {list(t.shape)} {t.dtype}")
    known = {name for name, _, _ in expected}
    problems += [f"{name}: not in the layout" for name in tensors if name not in known]
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return f"{who} disagrees with the weight layout: {shown}"


def _agree_on_setup(group: StoreGroup, error: str, deadline: float) -> None:
    results = group.all_gather_obj(
        _SetupResult(group.rank, error),
        type=_SetupResult,
        timeout_s=max(deadline - time.monotonic(), 1e-3),
        what="layout check",
    )
    refusals = [r for r in results if r.error]
    if refusals:
        raise LayoutMismatchError("weight layout refused: " + " | ".join(f"rank {r.rank}: {r.error}" for r in refusals))
