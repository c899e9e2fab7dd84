"""`WeightSending`: the trainer's side of a weight sync, as rank 0 of the weight-sync group.

What a sync sends is the policy's parameters, or with LoRA what ``--trainer.lora.sync`` names
(`TrainedPolicy.weight_tensors`). The trainer joins the group through its `SyncSeat` (``seat``:
the actor's side of the group, which its ``sync_*`` endpoints reach); `setup`
agrees on their layout with every sampler and `send` broadcasts them through a `WeightSender`
(``comm/weights.py``); on a rank group rank 0 sends and every rank gathers each bucket in turn
(``trainer/sharded_sync.py``). `digest` hashes what the samplers hold after a sync
(``--run.check_weights``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.comm.errors import WeightSyncError
from asyncrl.comm.layout import DTYPES, WeightLayout
from asyncrl.comm.member import SyncSeat
from asyncrl.comm.weights import SyncStats, WeightSender
from asyncrl.rl.trainer.rank_member import RankMember


class WeightSending:
    """The trainer's seat in the weight-sync group and its `WeightSender` (None until `setup`).
    ``ranks`` runs each call (on every rank of a group); ``tensors`` gives what a sync sends."""

    def __init__(self, ranks: RankMember, tensors: Callable[[], dict[str, torch.Tensor]]):
        self.ranks, self.tensors = ranks, tensors
        self.seat = SyncSeat()
        self.sender: WeightSender | None = None
        self._layout: WeightLayout | None = None
        self._sync_timeout_s = 0.0  # set up with the layout

    def forget(self) -> None:
        """Drop the sender: it holds parameters that a checkpoint's load replaced (set up again
        with the group)."""
        self.sender = None

    async def setup(self, timeout_s: float, bucket_bytes: int, wire_dtype: str, delta: bool) -> int:
        """After `form_group`: agree on the layout with every sampler. ``wire_dtype`` (e.g.
        "bfloat16") is the samplers' parameter dtype when it differs from the trainer's fp32.
        ``delta``: keep what was sent and send its changes (``comm/delta.py``; the memory of one
        copy of the weights in the wire's dtype, on rank 0). Returns the bucket count. With a rank
        group, every rank computes the layout (rank 0 alone agrees on it with the samplers) and
        the buckets are gathered by all of them."""
        cast = DTYPES[wire_dtype] if wire_dtype else None
        return await self.ranks.run(
            "agreeing on the weight layout", timeout_s, self._setup, timeout_s, bucket_bytes, cast, delta
        )

    def _setup(self, timeout_s: float, bucket_bytes: int, wire_dtype: torch.dtype | None, delta: bool) -> int:
        from asyncrl.comm.layout import default_bucket_bytes, sender_layout, wire_specs

        parallel, device = self.ranks.parallel, self.ranks.device
        params = self.tensors()
        # a sharded parameter is gathered into a bucket, never sent from where it lies; a delta
        # is found in the buckets, so with one nothing is sent directly either
        direct = parallel.world_size == 1 and not delta
        if bucket_bytes or parallel.world_size == 1:
            size = bucket_bytes or None  # None: the default for the communicator's device
        else:  # every rank the same: the default for the trainer's device
            size = default_bucket_bytes(device, sum(spec.nbytes for spec in wire_specs(params, wire_dtype)))
        if parallel.rank == 0:
            comm, group = self.seat.comm, self.seat.group
            if comm is None or group is None:
                raise WeightSyncError("trainer: agreeing on the weight layout before joining the weight-sync group")
            self.sender = WeightSender.create(
                comm,
                group,
                params,
                bucket_bytes=size,
                timeout_s=timeout_s,
                wire_dtype=wire_dtype,
                allow_direct=direct,
                delta=delta,
            )
            layout = self.sender.layout
        else:
            layout = sender_layout(params, size, wire_dtype, allow_direct=direct)
        parallel.agree(layout.digest(), "weight layouts")
        self._layout, self._sync_timeout_s = layout, timeout_s
        return len(layout.buckets)

    async def send(self, version: int) -> SyncStats:
        """Broadcast the current weights as ``version``; returns the sync's phases (`SyncStats`).
        On a rank group rank 0 sends and every rank gathers each bucket in turn. A failure on the
        weight-sync side (a sampler's) is raised after the guard, which only sees the trainer
        group's collectives, all matched: the trainer group survives it."""
        from asyncrl.comm.errors import CommError

        params, sender, layout = self.tensors(), self.sender, self._layout
        if layout is None:
            raise WeightSyncError(f"trainer: the weight sync of v{version} before its set-up")

        def send() -> tuple[SyncStats, BaseException | None]:
            parallel = self.ranks.parallel
            source = parallel.bucket_source(layout, params)
            none = SyncStats(version, 0, 0, 0.0)  # the ranks > 0 gather only; the driver reads rank 0's
            try:
                if parallel.rank == 0:
                    if sender is None:
                        raise WeightSyncError(f"trainer: the weight sync of v{version} before its set-up")
                    return sender.send(version, params if source is None else None, source=source), None
                return none, None
            except CommError as exc:  # the weight-sync group's, not the trainer's
                if source is None:
                    raise
                return none, exc
            finally:
                if source is not None:
                    source.drain()  # every bucket gathered on every rank, whatever happened

        stats, error = await self.ranks.run(f"the weight sync of v{version}", self._sync_timeout_s, send)
        if error is not None:
            raise error
        return stats

    async def digest(self, deadline_s: float) -> str:
        """SHA-256 of the policy's parameters as the samplers hold them (``rl/digest.py``): in the
        dtypes the layout sends them in (a bf16 engine holds the bf16 cast of the fp32 master
        copy); on a rank group rank 0's ("" on the others)."""
        from asyncrl.rl.digest import tensor_digest

        layout = self._layout
        sent_as = {spec.name: spec.torch_dtype for spec in layout.tensors} if layout is not None else None

        def digest() -> str:
            parallel = self.ranks.parallel
            whole = parallel.gathered(self.tensors())
            return tensor_digest(whole, sent_as) if parallel.rank == 0 else ""

        return await self.ranks.run("the weight digest", deadline_s, digest)
