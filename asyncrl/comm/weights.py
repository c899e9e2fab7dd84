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

A sender made with ``delta=True`` keeps what it last sent (`KeptBuckets`), and the first vote also
carries each member's *base*: the version it holds whole (-1: none, a failed sync, new tensors).
Where every member names the same base, each bucket goes as its changed words (``delta.py``),
preceded by their count; anywhere else the sync is a full one, which also renews the base.

A receiver that stages its syncs (``staged.py``) asks at set-up for each sync to be announced on
the group's store before its first vote (``sync_notice.py``), and joins it from a thread of its own.

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

import torch

from asyncrl.comm.communicator import Communicator
from asyncrl.comm.delivery import BatchConsumer, ConsumerGuard, Destination, deliver_bucket
from asyncrl.comm.delta import KeptBuckets, SyncMode, word_dtype
from asyncrl.comm.delta_wire import ChangeReceiving, ChangeSending, WireCount
from asyncrl.comm.errors import LayoutMismatchError, WeightSyncError
from asyncrl.comm.layout import WeightLayout, sender_layout
from asyncrl.comm.layout_check import agree_on_setup, mismatch
from asyncrl.comm.phase_clock import COPY, TRANSFER
from asyncrl.comm.rendezvous import StoreGroup
from asyncrl.comm.staging import CopyPlan, Staging, tensor_part
from asyncrl.comm.sync_notice import SyncNotices
from asyncrl.comm.sync_stats import SyncStats
from asyncrl.comm.sync_vote import agree, commit
from asyncrl.comm.transfer_hook import at_transfer_start

BucketSource = Callable[[int], list[torch.Tensor]]
"""A sender's tensors produced a bucket at a time: called with bucket ``k`` (in order, once per
sync), it returns the parts of bucket k's segments, in order, each shaped as its staging view
(a sharded model gathers each bucket's parameters here: never the whole model at once)."""


class _WeightSync:
    """What sender and receiver share: the layout, the staging buffers and the two votes."""

    def __init__(self, comm: Communicator, layout: WeightLayout, src: int, timeout_s: float, setup_calls: int):
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
        self._wire_bytes = sum(layout.bucket_sizes) + sum(layout.tensors[i].nbytes for i in layout.direct)
        self._plan_key: tuple[int, ...] = ()
        self._plan: list[CopyPlan] = []
        self.kept: KeptBuckets | None = None  # a delta sender's base; a consumer receiver's copy
        self._word = word_dtype(layout)
        self.changes: ChangeSending | ChangeReceiving | None = None  # with a base: ``delta_wire.py``
        self.notices: SyncNotices | None = None  # a sender whose receivers asked: ``sync_notice.py``
        self.setup_calls = setup_calls  # the group's store calls at the end of set-up: names its notices

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            remaining = 1e-3  # the wait itself raises the timeout, naming the operation
        return remaining

    @property
    def _who(self) -> str:
        return _who(self.comm)

    def _run(
        self,
        version: int,
        refusal: str,
        move: Callable[[SyncMode], str],
        timeout_s: float | None,
        *,
        base: int = -1,
        keep: bool = False,
    ) -> SyncStats:
        """Vote, move the buckets, commit, within ``timeout_s`` (default: the one given at set-up).
        ``move`` returns "" or why this member could not apply what it received; it must keep
        taking part in every transfer either way, so that the members' sequences of collectives
        stay identical and the commit vote can report it. ``base``: the version this member
        holds whole, for a delta sync; ``keep``: the sender keeps one."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if not refusal and version <= self.last_version:
            refusal = f"version {version} is not newer than the last synced v{self.last_version}"
        start = time.perf_counter()
        self._deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self.staging.begin()
        if self.changes is not None:
            self.changes.count = WireCount()
        mode = SyncMode(keep=False, delta=False)
        try:
            if self.notices is not None:
                self.notices.post(version)
            mode = agree(self.staging, self._who, version, self.layout_hash, refusal, base, keep)
            voted = time.perf_counter()
            at_transfer_start(self.comm.rank, version)  # test-only; inert unless its variable is set
            failure = move(mode)
            moved = time.perf_counter()
            commit(self.staging, self._who, version, failure)
            self.last_version = version
            self._committed(version, mode)
        except BaseException:
            self.last_version = max(self.last_version, version)  # a failed version is never reused
            self._committed(-1, mode)  # what a member holds is no base for a delta any more
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
            delta=mode.delta,
            sent_bytes=self.changes.count.sent if mode.delta and self.changes else self._wire_bytes,
            changed=self._changed_fraction(mode),
        )

    def _committed(self, version: int, mode: SyncMode) -> None:
        """After the commit (``version``) or a failure (-1): the base this member now holds."""
        if self.kept is not None:
            self.kept.version = version if mode.keep else -1

    def _changed_fraction(self, mode: SyncMode) -> float:
        if not mode.delta or not isinstance(self.changes, ChangeSending):
            return -1.0
        return self.changes.count.changed / max(sum(self.layout.bucket_sizes) // self._word.itemsize, 1)

    def _refusal(self, tensors: Mapping[str, torch.Tensor], who: str) -> str:
        """Everything that could stop this member half-way is checked before the first vote."""
        if not self._matches(tensors):
            return mismatch(self._expected, tensors, who)
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
    changes: ChangeSending | None
    """The trainer's side. Holds references to the tensors (normally a model's parameters, updated
    in place by the optimizer), never a copy of them."""

    def __init__(
        self,
        comm: Communicator,
        layout: WeightLayout,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        *,
        setup_calls: int = -1,
        notices: SyncNotices | None = None,
        kept: KeptBuckets | None = None,
    ):
        """What `create` agreed on: ``setup_calls``, the group's store calls at the end of set-up;
        ``notices``, where each sync is announced (receivers that stage asked for it); ``kept``,
        a delta sender's copy of what it sent (its changes go on the wire from then on)."""
        super().__init__(comm, layout, comm.rank, timeout_s, setup_calls)
        self.tensors = dict(tensors)
        self._expected = [(n, t.shape, t.dtype) for n, t in self.tensors.items()]  # local dtypes, not the wire's
        self.notices, self.kept = notices, kept
        self.changes = ChangeSending(self.staging, layout, kept, comm.rank) if kept is not None else None

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
        delta: bool = False,
    ) -> WeightSender:
        """Agree on the layout with every receiver (they call `WeightReceiver.create` together).
        ``wire_dtype``: send floating-point tensors in this dtype (e.g. fp32 master weights to
        bf16 samplers); the cast happens while packing, so it costs no extra memory.
        ``allow_direct=False``: every tensor goes through the buckets (a sender whose tensors
        come from a `BucketSource`, a sharded model's, has no whole tensor to send from).
        ``delta``: keep what was sent and send only its changes where every member holds it
        (one copy of the bucketed weights in the wire's dtype; every tensor then goes through
        the buckets, which is where changes are found)."""
        layout = sender_layout(tensors, bucket_bytes, wire_dtype, allow_direct and not delta, device=comm.device)
        deadline = time.monotonic() + timeout_s  # the driver allows this call only a margin beyond it
        group.broadcast_obj(layout, src=comm.rank, type=WeightLayout, timeout_s=timeout_s, what="the weight layout")
        announce = agree_on_setup(group, "", deadline)
        return cls(
            comm,
            layout,
            tensors,
            timeout_s,
            setup_calls=group.calls,
            notices=SyncNotices(group, group.calls, _who(comm)) if announce else None,
            kept=KeptBuckets(layout, comm.device) if delta else None,
        )

    def send(
        self, version: int, tensors: Mapping[str, torch.Tensor] | None = None, *, source: BucketSource | None = None
    ) -> SyncStats:
        """Broadcast the tensors (those given at set-up unless others are given) as ``version``;
        with ``source``, each bucket's contents come from it (the tensors are only checked
        against the layout, by name, shape and dtype)."""
        tensors = self.tensors if tensors is None else tensors
        refusal = self._refusal(tensors, f"sender rank {self.comm.rank}")
        keep = self.kept is not None
        base = self.kept.version if self.kept is not None else -1
        if source is not None:
            if self.layout.direct:
                raise WeightSyncError("a bucket source needs a layout without direct tensors (allow_direct=False)")
            return self._run(version, refusal, lambda mode: self._move_from(source, mode), None, base=base, keep=keep)
        move = lambda mode: self._move(self._plan_for(tensors, staging_is_dst=True), mode)  # noqa: E731
        return self._run(version, refusal, move, None, base=base, keep=keep)

    def _move_from(self, source: BucketSource, mode: SyncMode) -> str:
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
                count = self.changes.encode(k, mode) if self.changes else None
            self._send_bucket(k, count)
        return ""

    def _move(self, plan: list[CopyPlan], mode: SyncMode) -> str:
        for i in self.layout.direct:  # first: they need no packing, which meanwhile fills bucket 0
            self.staging.transfer_direct(self._plan_tensors[i], self.src)
        for k in range(len(self.layout.buckets)):
            with self.staging.copy(k):
                plan[k].run()
                count = self.changes.encode(k, mode) if self.changes else None
            self._send_bucket(k, count)
        return ""

    def _send_bucket(self, k: int, count: int | None) -> None:
        if self.changes is None:
            self.staging.transfer(k, self.src)
        else:
            self.changes.transfer(k, count)


class WeightReceiver(_WeightSync):
    """A sampler's side. ``receive`` copies into a mapping of tensors in place, or hands each whole
    tensor to a consumer callable as a view that is valid only during the call; with
    ``batched=True`` the consumer takes a list, once a bucket: every tensor the bucket completed."""

    changes: ChangeReceiving

    @classmethod
    def create(
        cls,
        comm: Communicator,
        group: StoreGroup,
        *,
        src: int = 0,
        expect: Mapping[str, torch.Tensor] | None = None,
        timeout_s: float = 60.0,
        notices: bool = False,
    ) -> WeightReceiver:
        """Receive the sender's layout; if ``expect`` is given, check it holds exactly those names,
        shapes and dtypes. A mismatch on any member fails set-up on every member. ``notices``: have
        the sender announce each sync on the group's store (a `StagedReceiver` waits for them)."""
        deadline = time.monotonic() + timeout_s  # the driver allows this call only a margin beyond it
        layout = group.broadcast_obj(None, src=src, type=WeightLayout, timeout_s=timeout_s, what="the weight layout")
        error = ""
        if expect is not None:
            try:
                layout.check(expect, f"receiver rank {comm.rank}")
            except LayoutMismatchError as exc:
                error = str(exc)
        agree_on_setup(group, error, deadline, notices=notices)
        return cls(comm, layout, src, timeout_s, group.calls)

    def __init__(self, comm: Communicator, layout: WeightLayout, src: int, timeout_s: float, setup_calls: int = -1):
        super().__init__(comm, layout, src, timeout_s, setup_calls)
        self.changes = ChangeReceiving(self.staging, layout, src, comm.device, self._who)
        self._held: tuple[int, tuple[int, ...]] = (-1, ())  # the version in the tensors written in place
        self._in_place = False

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
        base = -1 if refusal else self._base(into)
        return self._run(version, refusal, lambda mode: self._move(into, batched, mode), timeout_s, base=base)

    def _base(self, into: Destination | BatchConsumer) -> int:
        """The version ``into`` holds whole: tensors written in place hold the last sync's if they
        are the same objects; a consumer's is in the kept copy, where one is kept."""
        if not isinstance(into, Mapping):
            return self.kept.version if self.kept is not None else -1
        version, key = self._held
        same = key == tuple(id(into[spec.name]) for spec in self.layout.tensors)
        return version if same else -1

    def _committed(self, version: int, mode: SyncMode) -> None:
        in_place = self._in_place and version >= 0 and mode.keep
        self._held = (version, self._plan_key) if in_place else (-1, ())
        if self.kept is not None:
            self.kept.version = version if mode.keep and not self._in_place else -1

    def _move(self, into: Destination | BatchConsumer, batched: bool, mode: SyncMode) -> str:
        layout = self.layout
        self._in_place = isinstance(into, Mapping)
        consumer: ConsumerGuard | None = None
        plan: list[CopyPlan] | None = None
        if isinstance(into, Mapping):
            plan = self._plan_for(into, staging_is_dst=False)
            self._move_direct(into)
        else:
            consumer = ConsumerGuard(into, batched)
            for spec in layout.tensors:  # empty tensors carry no bytes but are still delivered
                if spec.nbytes == 0:
                    consumer(spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.comm.device))
            consumer.flush()
            self._move_direct(consumer)
        partial: dict[int, torch.Tensor] = {}  # tensors larger than a bucket, being assembled
        if consumer is not None and mode.keep and self.kept is None:
            self.kept = KeptBuckets(layout, self.comm.device)  # a consumer holds no copy we can patch
        elif consumer is None:
            self.kept = None  # in place from now on (vLLM on CUDA after its first sync): free the copy
        kept = self.kept if consumer is not None and mode.keep else None
        if mode.delta:
            self.changes.refill_from(plan)
            self.changes.receive(self._word, kept, lambda k, views: self._unpack(k, plan, consumer, views, partial))
            return consumer.failure if consumer is not None else ""
        if layout.buckets:
            self.staging.transfer(0, self.src)
        for k in range(len(layout.buckets)):
            if k + 1 < len(layout.buckets):  # bucket k+1 arrives while bucket k is unpacked
                self.staging.transfer(k + 1, self.src)
            with self.staging.copy(k):
                if kept is not None:
                    kept.bucket(k).copy_(self.staging.wire[k])
                self._unpack(k, plan, consumer, self.staging.views[k], partial)
        return consumer.failure if consumer is not None else ""

    def _unpack(
        self,
        k: int,
        plan: list[CopyPlan] | None,
        consumer: ConsumerGuard | None,
        views: list[torch.Tensor],
        partial: dict[int, torch.Tensor],
    ) -> None:
        """Exactly one of ``plan`` (in place) and ``consumer`` is given."""
        if plan is not None:
            plan[k].run()
        elif consumer is not None:
            deliver_bucket(consumer, self.layout, k, views, partial)
            consumer.flush()  # while bucket k's views are valid: k+2 reuses its buffer

    def _move_direct(self, into: Mapping[str, torch.Tensor] | ConsumerGuard) -> None:
        """Tensors sent whole: received in place, or into temporaries handed to the consumer."""
        received = []
        for i in self.layout.direct:
            spec = self.layout.tensors[i]
            if isinstance(into, Mapping) and into[spec.name].device == self.comm.device:
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
                    if isinstance(into, Mapping):
                        into[name].copy_(whole)
                    else:
                        into(name, whole)
                if isinstance(into, ConsumerGuard):
                    into.flush()


def _who(comm: Communicator) -> str:
    """A member as its errors and notices name it."""
    return f"group {comm.group!r} rank {comm.rank}"
