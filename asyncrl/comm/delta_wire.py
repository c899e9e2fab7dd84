"""A delta sync's buckets on the wire (``--run.sync_delta``): what `WeightSender` and
`WeightReceiver` (``weights.py``) do with each bucket once the first vote has said that the sender
keeps a base (`SyncMode.keep`) and that every member holds it (`SyncMode.delta`).

Per bucket, the same collectives on every member: one broadcast of what the receivers are told
(`delta.told`: the count of changed words and their form, or `delta.WHOLE`: the bucket follows
whole), then one of the changes (none when nothing changed).
A receiver must read what it is told before it can receive what follows, so it waits for each transfer
in turn instead of receiving bucket k+1 while it applies bucket k: the link, not the copies, is
what a delta sync is for.
"""

from __future__ import annotations

import torch

from asyncrl.comm.delta import WHOLE, KeptBuckets, SyncMode, apply, encode, padding_index, told_bytes
from asyncrl.comm.errors import WeightSyncError
from asyncrl.comm.layout import WeightLayout
from asyncrl.comm.staging import CopyPlan, Staging, bucket_view


class WireCount:
    """What one sync put on the wire, and how many words changed (the sender's count)."""

    def __init__(self) -> None:
        self.sent, self.changed = 0, 0


class ChangeSending:
    """The sender's side: renews its base from every packed bucket, and in a delta sync leaves
    the bucket's changes at the front of its staging buffer and sends them after their count."""

    def __init__(self, staging: Staging, layout: WeightLayout, kept: KeptBuckets, src: int):
        self.staging, self.layout, self.kept, self.src = staging, layout, kept, src
        self.count = WireCount()
        self._padding: list[torch.Tensor] = []  # per bucket, made once

    def encode(self, k: int, mode: SyncMode) -> int | None:
        """Within bucket k's copy, once it is packed. Returns what the receivers are told first
        (`delta.told`, or `WHOLE`), None in a sync without counts."""
        if not mode.keep:
            return None
        wire, kept = self.staging.wire[k], self.kept.bucket(k)
        if len(self._padding) <= k:
            self._padding.append(padding_index(self.layout, k, wire.device))
        wire.index_fill_(0, self._padding[k], 0)  # another bucket's bytes left there are no change
        if not mode.delta:
            kept.copy_(wire)
            return None
        encoded = encode(wire, kept, wire, self.kept.word)
        self.count.changed += encoded.changed
        self.staging.held.append(torch.tensor([encoded.told], dtype=torch.int64, device=wire.device))
        return encoded.told

    def transfer(self, k: int, told: int | None) -> None:
        staging, size, word = self.staging, self.layout.bucket_sizes[k], self.kept.word
        if told is not None:
            staging.transfer(k, self.src, staging.held[-1])
            self.count.sent += 8
        if told is None or told == WHOLE:
            staging.transfer(k, self.src)
            self.count.sent += size
        elif told:
            nbytes = told_bytes(told, size // word.itemsize, word)
            staging.transfer(k, self.src, staging.wire[k][:nbytes])
            self.count.sent += nbytes


class ChangeReceiving:
    """A receiver's side of a delta sync: each bucket's count, then its changes (or the whole
    bucket), patched into the kept copy (a receiver that hands tensors to a consumer) or into the
    staging buffer refilled from the tensors it writes in place, which hold the base themselves."""

    def __init__(self, staging: Staging, layout: WeightLayout, src: int, device: torch.device, who: str):
        self.staging, self.layout, self.src, self.who = staging, layout, src, who
        self.device = device
        self.count = WireCount()
        self._views_of: KeptBuckets | None = None
        self._kept_views: list[list[torch.Tensor]] = []
        self._back_of: list[CopyPlan] | None = None
        self._back: list[CopyPlan] = []

    def receive(self, word: torch.dtype, kept: KeptBuckets | None, unpack) -> None:
        """``unpack(k, views)`` hands bucket k, as ``views``, to the tensors or the consumer."""
        staging = self.staging
        told_of = torch.empty(1, dtype=torch.int64, device=self.device)
        for k, size in enumerate(self.layout.bucket_sizes):
            staging.receive_now(told_of, self.src)
            told, payload = int(told_of.item()), None
            self.count.sent += 8
            if told == WHOLE:
                staging.receive_now(staging.wire[k], self.src)
                self.count.sent += size
            else:
                nbytes = told_bytes(told, size // word.itemsize, word) if told >= 0 else -1
                if not 0 <= nbytes < size:  # the sender's own rule: a delta is smaller than its bucket
                    raise WeightSyncError(f"{self.who}: bucket {k} came told as {told} ({nbytes} bytes)")
                payload = staging.buffers[(k + 1) % 2][:nbytes]  # bucket k's own buffer takes its base
                if nbytes:
                    staging.receive_now(payload, self.src)
                self.count.sent += nbytes
            with staging.copy(k):
                self._patch(k, told, payload, word, kept, unpack)

    def _patch(self, k: int, told: int, payload: torch.Tensor | None, word, kept, unpack) -> None:
        wire, views = self.staging.wire[k], self.staging.views[k]
        if kept is not None:  # the consumer's copy: patched, then delivered whole from it
            if payload is None:
                kept.bucket(k).copy_(wire)
            else:
                apply(payload, told, kept.bucket(k), word)
                views = self.views_of(kept)[k]
        elif payload is not None:  # in place
            if told == 0:  # nothing changed
                return
            self._back[k].run()
            apply(payload, told, wire, word)
        unpack(k, views)

    def refill_from(self, plan: list[CopyPlan] | None) -> None:
        """Where a receiver writes in place: its unpacking plan, reversed (tensors into the staging
        views), so that a bucket's base can be patched before it is unpacked again."""
        if plan is not None and self._back_of is not plan:
            self._back_of, self._back = plan, [p.reversed() for p in plan]

    def views_of(self, kept: KeptBuckets) -> list[list[torch.Tensor]]:
        if self._views_of is not kept:
            self._views_of = kept
            self._kept_views = [
                [bucket_view(kept.bucket(k), seg, self.layout) for seg in bucket]
                for k, bucket in enumerate(self.layout.buckets)
            ]
        return self._kept_views
