"""A bucket's change since the last sync, as it travels in a delta sync (``--run.sync_delta``).

A bucket is compared, encoded and patched as raw words (an integer view of its bytes), never as
floats: a NaN, a -0.0 or a subnormal that changed is sent, one that did not is not, and what the
receiver writes is the sender's bits. The word is the itemsize that carries most of the layout's
bytes (bf16 weights: 2 bytes), so one changed weight is one changed word.

A changed bucket (``count`` words changed) travels in the smaller of two forms, which fills the
front of a buffer of the bucket's size:

- `INDEX`: the ``count`` new words, then, from the next multiple of 8 bytes, their indices (int32
  where the bucket has fewer than 2**31 words, else int64): 6 bytes a changed bf16 weight;
- `BITMAP`: one bit a word (set where it changed; its bytes padded to a multiple of 8), then the
  ``count`` new words in order: a sixteenth of a bf16 bucket, plus 2 bytes a changed weight.

The index form is the smaller below one word in 32 changed (for bf16), the bitmap above, which is
where a training step's changes to a bf16 copy usually fall (docs/weight_sync.md has the fractions
measured). Where neither is smaller than the bucket, the whole bucket goes.
What the receivers are told first is one int64 (`told`): `WHOLE`, or the count and the form.

Everything here is torch ops over whole buckets; no loop visits an element.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from asyncrl.comm.layout import WeightLayout

WHOLE = -1
"""What the receivers are told where a bucket travels whole (changed too much, or there is no base)."""
INDEX, BITMAP = 0, 1
"""The two forms of a changed bucket (the module's docstring)."""

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


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


def told(form: int, count: int) -> int:
    """The int64 the receivers are told first: a changed bucket's count and form."""
    return count * 2 + form


def told_form(value: int) -> tuple[int, int]:
    """(form, count) of what `told` made; (`WHOLE`, -1) for `WHOLE`."""
    return (WHOLE, -1) if value == WHOLE else (value & 1, value >> 1)


def payload_bytes(count: int, words: int, word: torch.dtype, form: int = INDEX) -> int:
    """Bytes of a bucket of ``words`` words sent as ``count`` changed words in ``form``."""
    if form == BITMAP:
        return _bitmap_bytes(words) + count * word.itemsize
    return _pad8(count * word.itemsize) + count * index_dtype(words).itemsize


def told_bytes(told_value: int, words: int, word: torch.dtype) -> int:
    """Bytes of the changes told as ``told_value`` (not `WHOLE`)."""
    form, count = told_form(told_value)
    return payload_bytes(count, words, word, form)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _bitmap_bytes(words: int) -> int:
    return _pad8((words + 7) // 8)


def smallest_form(count: int, words: int, word: torch.dtype) -> int:
    """`INDEX` or `BITMAP`, whichever is smaller for ``count`` changed words (the index form on a
    tie, and where the words do not divide into bytes of bits), or `WHOLE` where neither is smaller
    than the bucket."""
    form = INDEX
    if words % 8 == 0 and payload_bytes(count, words, word, BITMAP) < payload_bytes(count, words, word):
        form = BITMAP
    return form if payload_bytes(count, words, word, form) < words * word.itemsize else WHOLE


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
    """What the receivers are told: `WHOLE`, or the count and form (`told`). (Not ``count``:
    that is tuple's method.)"""


def encode(current: torch.Tensor, kept: torch.Tensor, out: torch.Tensor, word: torch.dtype) -> Encoded:
    """Compare bucket ``current`` with ``kept`` (uint8 buffers of one size); write the changes in
    their smaller form to the front of ``out`` (uint8, at least as large; it may be ``current``
    itself) and bring ``kept`` up to ``current``. Where sending the bucket whole is no larger,
    the told value is `WHOLE` and ``out`` is untouched (the bucket to send is ``current``)."""
    now, base = current.view(word), kept.view(word)
    words = now.numel()
    changed, mask = _changed_words(current, kept, word), None
    if changed is None:
        mask = now != base
        count = int(mask.count_nonzero())  # exact, for the stats too
    else:
        count = changed.numel()
    form = smallest_form(count, words, word)
    if form == WHOLE:
        kept.copy_(current)
        return Encoded(count, WHOLE)
    if form == INDEX:
        if changed is None:  # not listed where the index form cannot be the smaller: never so here
            changed = (now != base).nonzero().view(-1)
        values = now[changed]  # a copy: ``out`` may be ``current``
        base[changed] = values
        at = _pad8(count * word.itemsize)
        out[: count * word.itemsize].view(word).copy_(values)
        out[at : at + count * index_dtype(words).itemsize].view(index_dtype(words)).copy_(changed)
        return Encoded(count, told(INDEX, count))
    if mask is None:
        mask = torch.zeros(words, dtype=torch.bool, device=current.device)
        mask[changed] = True
    values = now[mask]  # copies, as are the bits: ``out`` may be ``current``
    packed = _pack(mask)
    kept.copy_(current)
    at = _bitmap_bytes(words)
    out[: packed.numel()].copy_(packed)
    out[at : at + count * word.itemsize].view(word).copy_(values)
    return Encoded(count, told(BITMAP, count))


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor (its length a multiple of 8) as bits, 8 to a byte, least significant first."""
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=mask.device)
    return (mask.view(torch.uint8).view(-1, 8) * bits).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    bits = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return (packed.view(-1, 1) & bits).ne(0).view(-1)


def _changed_words(current: torch.Tensor, kept: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """The indices of the words that differ, found 8 bytes at a time first (a quarter of the
    elements to compare and scan for bf16), then word by word within the 8-byte blocks that
    changed. None where so many blocks changed that the index form would be larger than the
    bucket (each block holds at least one changed word), which also bounds the temporaries to
    about the bucket's size."""
    ratio = 8 // word.itemsize
    if ratio == 1 or current.numel() % 8:
        return (current.view(word) != kept.view(word)).nonzero().view(-1)
    differs = current.view(torch.int64) != kept.view(torch.int64)
    words = current.numel() // word.itemsize
    if payload_bytes(int(differs.count_nonzero()), words, word) >= current.numel():  # counting is cheaper than listing
        return None
    blocks = differs.nonzero().view(-1)
    differ = current.view(word).view(-1, ratio)[blocks] != kept.view(word).view(-1, ratio)[blocks]
    block, offset = differ.nonzero().unbind(1)
    return blocks[block] * ratio + offset


def apply(payload: torch.Tensor, told_value: int, base: torch.Tensor, word: torch.dtype) -> None:
    """Patch bucket ``base`` (uint8) with the changes in ``payload`` (uint8, the front of it as
    `encode` wrote it, told as ``told_value``). Changes that do not fit the bucket, or a bitmap
    whose bits do not number its count, are a `ValueError`."""
    words = base.view(word)
    form, count = told_form(told_value)
    size = payload_bytes(count, words.numel(), word, form)
    if form == WHOLE or count < 0 or count > words.numel() or size > base.numel() or size > payload.numel():
        raise ValueError(f"a delta told as {told_value} does not fit a bucket of {base.numel()} bytes")
    if form == BITMAP:
        at = _bitmap_bytes(words.numel())
        mask = _unpack(payload[: words.numel() // 8])
        marked = int(mask.count_nonzero())
        if marked != count:
            raise ValueError(f"a delta's bitmap marks {marked} changed words, its count says {count}")
        words.masked_scatter_(mask, payload[at : at + count * word.itemsize].view(word))
        return
    at, kind = _pad8(count * word.itemsize), index_dtype(words.numel())
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
