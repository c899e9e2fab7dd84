"""What a `WeightReceiver` hands a consumer instead of copying into tensors in place
(``receive(version, into=fn)``): the consumer's types, `ConsumerGuard` (a consumer that raised is
not called again, while the receiver goes on taking every bucket off the wire), and
`deliver_bucket` (a bucket's whole tensors as views, a tensor larger than a bucket once its last
chunk came).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from asyncrl.comm.layout import WeightLayout
from asyncrl.comm.staging import tensor_part

Consumer = Callable[[str, torch.Tensor], None]
BatchConsumer = Callable[[list[tuple[str, torch.Tensor]]], object]
"""Takes the whole tensors a bucket completed, at once (e.g. a vLLM model's ``load_weights``, whose
every call walks the model's parameters: once a bucket, not once a tensor)."""
Destination = Mapping[str, torch.Tensor] | Consumer


class ConsumerGuard:
    """Calls the consumer until it first raises, then only records why: the receiver must go on
    taking every bucket off the wire so the sync can fail on every member instead of hanging.
    ``batched``: tensors are held until `flush`, which hands them over as one list."""

    def __init__(self, consumer: Consumer | BatchConsumer, batched: bool = False):
        # `batched` says which of the two shapes it has: called with (name, tensor) or with a list.
        self.consumer: Callable[..., object] = consumer
        self.batched = batched
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.failure = ""

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if self.batched:
            self.pending.append((name, tensor))
            return
        self._call(name, lambda: self.consumer(name, tensor))

    def flush(self) -> None:
        if self.pending:
            items, self.pending = self.pending, []
            self._call(f"{items[0][0]} .. {items[-1][0]} ({len(items)} tensors)", lambda: self.consumer(items))

    def _call(self, what: str, call: Callable[[], object]) -> None:
        if self.failure:
            return
        try:
            call()
        except Exception as exc:
            self.failure = f"consumer raised on {what}: {type(exc).__name__}: {exc}"


def deliver_bucket(
    consumer: ConsumerGuard, layout: WeightLayout, k: int, views: list[torch.Tensor], partial: dict[int, torch.Tensor]
) -> None:
    """Bucket ``k`` (``views``: its staging views) to the consumer: a tensor that fits a bucket as
    its view, one larger assembled in ``partial`` and handed over with its last chunk."""
    for seg, view in zip(layout.buckets[k], views):
        spec = layout.tensors[seg.tensor]
        if seg.length == spec.nbytes:
            consumer(spec.name, view)
            continue
        whole = partial.get(seg.tensor)
        if whole is None:
            whole = partial[seg.tensor] = torch.empty(spec.shape, dtype=spec.torch_dtype, device=view.device)
        tensor_part(whole, seg, spec).copy_(view)
        if seg.start + seg.length == spec.nbytes:
            consumer(spec.name, partial.pop(seg.tensor))
