"""`WeightSending`: the trainer actor's side of a weight sync, as rank 0 of the weight-sync group.

What a sync sends is the policy's parameters, or with LoRA what ``--trainer.lora.sync`` names
(`weight_tensors`). `setup_sender` agrees on their layout with every sampler and `send_weights`
broadcasts them through a `WeightSender` (``comm/weights.py``); on a rank group rank 0 sends and
every rank gathers each bucket in turn (``trainer/sharded_sync.py``). `weights_digest` hashes what
the samplers hold after a sync (``--run.check_weights``).
"""

from __future__ import annotations

import torch

from asyncrl.comm.layout import DTYPES
from asyncrl.comm.member import SyncMember
from asyncrl.comm.weights import SyncStats, WeightSender
from asyncrl.runtime.actor import endpoint


class WeightSending(SyncMember):
    """The weight-sync endpoints of a trainer. The actor provides ``config``, ``model``, ``device``,
    ``parallel`` (its strategy) and ``rank``, ``_merged`` (LoRA's merged weights, or None), ``sender``
    (None until set up) and ``_run`` (a call off the event loop, on every rank of a group)."""

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """What a weight sync sends: every parameter; with LoRA, the merged weights under the base
        model's names, or the adapters alone (``--trainer.lora.sync``, ``trainer/lora.py``)."""
        if not self.config.lora.rank:
            return dict(self.model.named_parameters())
        from asyncrl.rl.trainer.lora import sync_tensors

        return sync_tensors(self.model, self.config.lora.sync, self._merged)

    @endpoint
    async def setup_sender(
        self, timeout_s: float = 60.0, bucket_bytes: int = 0, wire_dtype: str = "", delta: bool = False
    ) -> int:
        """After `form_group`: agree on the layout with every sampler. ``wire_dtype`` (e.g.
        "bfloat16") is the samplers' parameter dtype when it differs from the trainer's fp32.
        ``delta``: keep what was sent and send its changes (``comm/delta.py``; the memory of one
        copy of the weights in the wire's dtype, on rank 0). Returns the bucket count. With a rank
        group, every rank computes the layout (rank 0 alone agrees on it with the samplers) and
        the buckets are gathered by all of them."""
        cast = DTYPES[wire_dtype] if wire_dtype else None
        return await self._run(
            "agreeing on the weight layout", timeout_s, self._setup_sender, timeout_s, bucket_bytes, cast, delta
        )

    def _setup_sender(self, timeout_s: float, bucket_bytes: int, wire_dtype: torch.dtype | None, delta: bool) -> int:
        from asyncrl.comm.layout import default_bucket_bytes, sender_layout

        params = self.weight_tensors()
        # a sharded parameter is gathered into a bucket, never sent from where it lies; a delta
        # is found in the buckets, so with one nothing is sent directly either
        direct = self.parallel.world_size == 1 and not delta
        size = bucket_bytes or (None if self.parallel.world_size == 1 else default_bucket_bytes(self.device))
        if self.rank == 0:
            self.sender = WeightSender.create(
                self.sync_comm,
                self.sync_group,
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
        self.parallel.agree(layout.digest(), "weight layouts")
        self._layout, self._sync_timeout_s = layout, timeout_s
        return len(layout.buckets)

    @endpoint
    async def send_weights(self, version: int) -> SyncStats:
        """Broadcast the current weights as ``version``; returns the sync's phases (`SyncStats`).
        On a rank group rank 0 sends and every rank gathers each bucket in turn. A failure on the
        weight-sync side (a sampler's) is raised after the guard, which only sees the trainer
        group's collectives, all matched: the trainer group survives it."""
        from asyncrl.comm.errors import CommError

        params = self.weight_tensors()

        def send() -> tuple[SyncStats, BaseException | None]:
            source = self.parallel.bucket_source(self._layout, params)
            none = SyncStats(version, 0, 0, 0.0)  # the ranks > 0 gather only; the driver reads rank 0's
            try:
                if self.rank == 0:
                    return self.sender.send(version, params if source is None else None, source=source), None
                return none, None
            except CommError as exc:  # the weight-sync group's, not the trainer's
                if source is None:
                    raise
                return none, exc
            finally:
                if source is not None:
                    source.drain()  # every bucket gathered on every rank, whatever happened

        stats, error = await self._run(f"the weight sync of v{version}", self._sync_timeout_s, send)
        if error is not None:
            raise error
        return stats

    @endpoint
    async def weights_digest(self, deadline_s: float = 0.0) -> str:
        """SHA-256 of the policy's parameters as the samplers hold them (``rl/digest.py``); on a
        rank group rank 0's ("" on the others)."""
        from asyncrl.rl.digest import tensor_digest

        def digest() -> str:
            whole = self.parallel.gathered(self.weight_tensors())
            return tensor_digest(whole) if self.rank == 0 else ""

        return await self._run("the weight digest", deadline_s, digest)
