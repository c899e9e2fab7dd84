"""Weights of a sharded policy on their way to the samplers: gathered one bucket at a time.

Every trainer rank computes the same `WeightLayout` (a pure function of the parameters' names,
shapes and dtypes: `sender_layout`) and walks its buckets in order; bucket k's parameters are
gathered whole (``full_tensor``: an all-gather on the trainer group, which every rank joins) and
handed to rank 0's `WeightSender`, which packs them into its staging buffer and broadcasts to the
samplers through the unchanged protocol (votes, layout hash, double buffering). The other ranks
only take part in the gathers and drop the result.

Invariant: on every rank, each sync gathers exactly the layout's buckets, in order, whatever
happens on the weight-sync side. If a sampler fails mid-sync, rank 0's send raises, and
`GatheredBuckets.drain` gathers the buckets it has not reached yet, so the trainer group's
collectives stay matched and the group survives a sampler's failure.

Memory on a rank, beyond its shards: the two staging buffers (rank 0 only; two buckets) plus one
gathered bucket. A parameter larger than a bucket is gathered whole once and sent in chunks
across several buckets, so "one gathered bucket" is at most max(bucket, largest parameter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.comm.layout import WeightLayout
from asyncrl.comm.staging import tensor_part
from asyncrl.rl.trainer.fsdp import full_tensor


class GatheredBuckets:
    """The `BucketSource` of one sync over ``params`` (ordered as ``layout.tensors``)."""

    def __init__(self, layout: WeightLayout, params: Sequence[torch.Tensor]):
        if len(params) != len(layout.tensors):
            raise ValueError(f"{len(params)} parameters for a layout of {len(layout.tensors)} tensors")
        self.layout, self.params = layout, list(params)
        self.next = 0  # the next bucket to gather
        self._whole: dict[int, torch.Tensor] = {}  # a parameter larger than a bucket, until its last chunk
        self.peak_gathered_bytes = 0

    @torch.no_grad()
    def __call__(self, k: int) -> list[torch.Tensor]:
        if k != self.next:
            raise ValueError(f"bucket {k} asked for, bucket {self.next} is next: buckets go in order")
        self.next += 1
        parts, held = [], 0
        for seg in self.layout.buckets[k]:
            spec = self.layout.tensors[seg.tensor]
            whole = self._whole.get(seg.tensor)
            if whole is None:
                whole = full_tensor(self.params[seg.tensor].detach())
                if seg.length != spec.nbytes:
                    self._whole[seg.tensor] = whole
            parts.append(tensor_part(whole, seg, spec))
            if seg.start + seg.length == spec.nbytes:
                self._whole.pop(seg.tensor, None)
            held += seg.length
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held + sum(t.nbytes for t in self._whole.values()))
        return parts

    def drain(self) -> None:
        """Gather (and drop) every bucket not gathered yet, keeping the ranks' collectives matched."""
        while self.next < len(self.layout.buckets):
            self(self.next)
        self._whole.clear()
