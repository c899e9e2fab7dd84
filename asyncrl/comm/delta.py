"""A bucket's change since the last sync, as it travels in a delta sync (``--run.sync_delta``).

A bucket is compared, encoded and patched as raw words (an integer view of its bytes), never as
floats: a NaN, a -0.0 or a subnormal that changed is sent, one that did not is not, and what the
receiver writes is the sender's bits. The word is the itemsize that carries most of the layout's
bytes (bf16 weights: 2 bytes), so one changed weight is one changed word.

The wire form of a changed bucket (``count`` words changed) fills the front of a buffer of the
bucket's size: ``count`` new words, then, from the next multiple of 8 bytes, their ``count``
indices (int32 where the bucket has fewer than 2**31 words, else int64). It is used only where it
is smaller than the bucket (`payload_bytes` < bucket size); otherwise the whole bucket goes, as
``count`` == `WHOLE`.

Everything here is torch ops over whole buckets; no loop visits an element.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from asyncrl.comm.layout import WeightLayout

WHOLE = -1
"""The count that says: this bucket travels whole (changed too much, or there is no base)."""

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_dtype(layout: WeightLayout) -> torch.dtype:
    """The integer dtype a layout's buckets are compared in: that of the itemsize holding most
    bytes (a tie goes to the smaller). Every bucket size is a multiple of the alignment (256),
    so it divides into words of any of these sizes."""
    by_size: Counter[int] = Counter()
    for spec in layout.tensors:
        by_size[min(spec.torch_dtype.itemsize, 8)] += spec.nbytes
    if not by_size:
        return torch.uint8
    size = max(sorted(by_size), key=lambda s: by_size[s])
    return _WORD[size]


def index_dtype(words: int) -> torch.dtype:
    return torch.int32 if words < 2**31 else torch.int64


def payload_bytes(count: int, words: int, word: torch.dtype) -> int:
    """Bytes of a bucket of ``words`` words sent as ``count`` changed words."""
    return _index_offset(count, word) + count * index_dtype(words).itemsize


def _index_offset(count: int, word: torch.dtype) -> int:
    return (count * word.itemsize + 7) // 8 * 8


class SyncMode(NamedTuple):
    """What the first vote of a sync decided."""

    keep: bool
    """The sender keeps a base: every member renews its own as the buckets pass."""
    delta: bool
    """Every member holds the same base: the buckets go as their changes."""


class Encoded(NamedTuple):
    changed: int
    """Words that differ from the kept bucket."""
    told: int
    """What the receivers are told: ``changed``, or `WHOLE`. (Not ``count``: that is tuple's method.)"""


def encode(current: torch.Tensor, kept: torch.Tensor, out: torch.Tensor, word: torch.dtype) -> Encoded:
    """Compare bucket ``current`` with ``kept`` (uint8 buffers of one size); write the changed
    words and their indices to the front of ``out`` (uint8, at least as large; it may be
    ``current`` itself) and bring ``kept`` up to ``current``. Where sending the bucket whole is
    no larger, the count is `WHOLE` and ``out`` is untouched (the bucket to send is ``current``)."""
    now, base = current.view(word), kept.view(word)
    changed = _changed_words(current, kept, word)
    count = int((now != base).sum()) if changed is None else changed.numel()  # exact, for the stats
    if changed is None or payload_bytes(count, now.numel(), word) >= current.numel():
        kept.copy_(current)
        return Encoded(count, WHOLE)
    values = now[changed]  # a copy: ``out`` may be ``current``
    base[changed] = values
    at = _index_offset(count, word)
    out[: count * word.itemsize].view(word).copy_(values)
    out[at : at + count * index_dtype(now.numel()).itemsize].view(index_dtype(now.numel())).copy_(changed)
    return Encoded(count, count)


def _changed_words(current: torch.Tensor, kept: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """The indices of the words that differ, found 8 bytes at a time first (a quarter of the
    elements to compare and scan for bf16), then word by word within the 8-byte blocks that
    changed. None where so many blocks changed that the bucket goes whole anyway (each holds at
    least one changed word), which also bounds the temporaries to about the bucket's size."""
    ratio = 8 // word.itemsize
    if ratio == 1 or current.numel() % 8:
        return (current.view(word) != kept.view(word)).nonzero().view(-1)
    blocks = (current.view(torch.int64) != kept.view(torch.int64)).nonzero().view(-1)
    words = current.numel() // word.itemsize
    if payload_bytes(blocks.numel(), words, word) >= current.numel():
        return None
    differ = current.view(word).view(-1, ratio)[blocks] != kept.view(word).view(-1, ratio)[blocks]
    block, offset = differ.nonzero().unbind(1)
    return blocks[block] * ratio + offset


def apply(payload: torch.Tensor, count: int, base: torch.Tensor, word: torch.dtype) -> None:
    """Patch bucket ``base`` (uint8) with the ``count`` changed words in ``payload`` (uint8, the
    front of it as `encode` wrote it). A count that does not fit the bucket is a `ValueError`."""
    words = base.view(word)
    size = payload_bytes(count, words.numel(), word)
    if count < 0 or size > base.numel() or size > payload.numel():
        raise ValueError(f"a delta of {count} words does not fit a bucket of {base.numel()} bytes")
    at, kind = _index_offset(count, word), index_dtype(words.numel())
    values = payload[: count * word.itemsize].view(word)
    index = payload[at : at + count * kind.itemsize].view(kind)
    words.index_copy_(0, index.long(), values)


def padding_index(layout: WeightLayout, k: int, device: torch.device) -> torch.Tensor:
    """The byte offsets of bucket ``k`` that no segment covers. A sender zeroes them after
    packing: the staging buffer a bucket shares with others (every second bucket) leaves their
    bytes there, which would otherwise look like changes."""
    size = layout.bucket_sizes[k]
    covered = torch.zeros(size, dtype=torch.bool)
    for seg in layout.buckets[k]:  # one slice per segment, not per element
        covered[seg.offset : seg.offset + seg.length] = True
    return (~covered).nonzero().view(-1).to(device)


class KeptBuckets:
    """The last version every member committed, bucket by bucket as it went on the wire: the
    sender's base for its deltas, and the copy a receiver patches when it hands whole tensors to a
    consumer (vLLM's ``load_weights``) instead of holding them itself. Its memory, one buffer per
    bucket, is the wire's size of the bucketed tensors, allocated at the first sync that keeps it."""

    def __init__(self, layout: WeightLayout, device: torch.device):
        self.layout, self.device = layout, device
        self.word = word_dtype(layout)
        self.buffers: list[torch.Tensor] = []
        self.version = -1
        """The version the buffers hold (-1: none, or a sync changed them and then failed)."""

    def bucket(self, k: int) -> torch.Tensor:
        if not self.buffers:
            sizes = self.layout.bucket_sizes
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in sizes]
        return self.buffers[k]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)
