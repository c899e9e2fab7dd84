"""Where every weight tensor sits in the fixed-size buckets of a sync, agreed once and hashed.

A tensor that fits in a bucket is never split, so a receiver can hand it to its consumer as a plain
view of the bucket. A tensor larger than a bucket is cut into byte ranges that fill consecutive
buckets. Offsets are aligned (256 bytes by default) so every view is aligned for its dtype and for
fast copies. Bucket `k` goes on the wire as its first ``bucket_sizes[k]`` bytes.

`sender_layout` is the layout a sender proposes (which tensors go whole, in which dtype, buckets
of `default_bucket_bytes` unless told); `comm/weights.py` agrees on it and moves the buckets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import msgspec
import torch

from asyncrl.comm.errors import LayoutMismatchError

DEFAULT_ALIGNMENT = 256
DEFAULT_GPU_BUCKET_BYTES = 256 << 20  # NCCL broadcasts near its peak from here, not at 16 MiB (docs/weight_sync.md)
LARGEST_GPU_BUCKET_BYTES = 512 << 20
GPU_BUCKETS_AIMED_AT = 24
DEFAULT_CPU_BUCKET_BYTES = 32 << 20  # gloo gains nothing past a few MiB; keep the staging small

# dtypes a weight may have; names are what travels, so an unknown name is refused, never looked up.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        *(
            getattr(torch, n)
            for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
            if hasattr(torch, n)
        ),
    )
}


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:  # also runs when a layout is decoded off the wire
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r} has unknown dtype {self.dtype!r}")
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"tensor {self.name!r} has a negative dimension: {list(self.shape)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.torch_dtype.itemsize


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """Bytes ``[start, start + length)`` of tensor ``tensor`` sit at ``offset`` in the bucket."""

    tensor: int
    start: int
    length: int
    offset: int


class WeightLayout(msgspec.Struct, array_like=True, frozen=True):
    bucket_bytes: int
    alignment: int
    tensors: list[TensorSpec]
    buckets: list[list[Segment]]
    bucket_sizes: list[int]
    direct: list[int] = []
    """Tensors (by index) that go on the wire whole, straight from the sender's tensor into the
    receiver's, before the buckets: no staging copy on either side (see `build_layout`)."""

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    @property
    def buffer_bytes(self) -> int:
        """Size of each of the two staging buffers: the largest bucket actually used."""
        return max(self.bucket_sizes, default=0)

    def digest(self) -> int:
        """A 62-bit hash of the whole layout; fits a signed int64 with room to negate."""
        raw = hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8).digest()
        return int.from_bytes(raw, "little") & ((1 << 62) - 1)

    def check(self, expected: Mapping[str, torch.Tensor], who: str) -> None:
        """Raise `LayoutMismatchError` if ``expected`` does not hold exactly these names, shapes and
        dtypes. ``who`` says whose tensors they are, for the message."""
        problems = []
        mine = {spec.name: spec for spec in self.tensors}
        for name, tensor in expected.items():
            spec = mine.get(name)
            if spec is None:
                problems.append(f"{name}: not in the layout")
            elif tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
                problems.append(
                    f"{name}: layout has {list(spec.shape)} {spec.dtype}, "
                    f"{who} has {list(tensor.shape)} {dtype_name(tensor.dtype)}"
                )
        problems += [f"{name}: {who} has no such tensor" for name in mine if name not in expected]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise LayoutMismatchError(f"{who} disagrees with the weight layout: {shown}")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"weights of dtype {dtype} cannot be synced")
    return name


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(tensor.shape), dtype_name(tensor.dtype))


def build_layout(
    specs: Iterable[TensorSpec], bucket_bytes: int, alignment: int = DEFAULT_ALIGNMENT, direct: Iterable[str] = ()
) -> WeightLayout:
    """Pack tensors in the given order into buckets of at most ``bucket_bytes``; the tensors named
    in ``direct`` (each larger than a bucket) are not packed but sent whole."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if bucket_bytes < alignment or bucket_bytes % alignment:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be a positive multiple of the alignment ({alignment})")
    specs = list(specs)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    direct_set = set(direct)
    direct_index = [i for i, spec in enumerate(specs) if spec.name in direct_set]
    if any(specs[i].nbytes <= bucket_bytes for i in direct_index) or len(direct_index) != len(direct_set):
        raise ValueError("only tensors of the layout that are larger than a bucket can be sent directly")
    buckets: list[list[Segment]] = [[]]
    used = 0  # bytes used in the last bucket, aligned

    def start_bucket() -> None:
        nonlocal used
        buckets.append([])
        used = 0

    for index, spec in enumerate(specs):
        nbytes = spec.nbytes
        if nbytes == 0 or spec.name in direct_set:
            continue  # empty: checked but nothing travels; direct: travels whole, unstaged
        if nbytes <= bucket_bytes:
            if used + nbytes > bucket_bytes:
                start_bucket()
            buckets[-1].append(Segment(index, 0, nbytes, used))
            used = _align(used + nbytes, alignment)
            continue
        start = 0  # larger than a bucket: fill what is left of this one, then whole buckets
        while start < nbytes:
            if used >= bucket_bytes:
                start_bucket()
            length = min(nbytes - start, bucket_bytes - used)
            buckets[-1].append(Segment(index, start, length, used))
            start += length
            used = _align(used + length, alignment)
    if not buckets[-1]:
        buckets.pop()
    sizes = [_align(seg[-1].offset + seg[-1].length, alignment) for seg in buckets]
    return WeightLayout(bucket_bytes, alignment, specs, buckets, [min(s, bucket_bytes) for s in sizes], direct_index)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def default_bucket_bytes(device: torch.device, total_bytes: int = 0) -> int:
    """The bucket size for ``total_bytes`` on the wire. On a GPU 256 MiB, up to 512 MiB for
    weights of more than 24 such buckets: each bucket costs a fixed amount of work beside its bytes,
    so larger buckets come nearer a raw NCCL broadcast's speed, while the staging holds two buckets
    and the pipeline fills and drains one, so a bucket as large as the whole model loses the overlap
    (docs/weight_sync.md and benchmarks/README.md, "the data plane's bucket size", have the figures)."""
    if device.type == "cpu":
        return DEFAULT_CPU_BUCKET_BYTES
    aimed = total_bytes // GPU_BUCKETS_AIMED_AT >> 20 << 20  # whole MiB: every alignment divides it
    return min(max(aimed, DEFAULT_GPU_BUCKET_BYTES), LARGEST_GPU_BUCKET_BYTES)


def wire_specs(tensors: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """The tensors as they travel: floating-point ones in ``wire_dtype`` where one is given."""
    return [
        spec_of(n, t)
        if wire_dtype is None or not t.is_floating_point()
        else TensorSpec(n, tuple(t.shape), dtype_name(wire_dtype))
        for n, t in tensors.items()
    ]


def sender_layout(
    tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int | None,
    wire_dtype: torch.dtype | None = None,
    allow_direct: bool = True,
    *,
    device: torch.device | None = None,
) -> WeightLayout:
    """The layout a sender of ``tensors`` proposes: a pure function of the tensors' names, shapes
    and dtypes (and the communicator's ``device``), so every rank of a sharded trainer computes the
    same one. ``bucket_bytes`` None: `default_bucket_bytes` for the communicator's device (the
    tensors' where none is given) and the bytes on the wire."""
    specs = wire_specs(tensors, wire_dtype)
    if not bucket_bytes:
        where = device or next((t.device for t in tensors.values()), torch.device("cpu"))
        bucket_bytes = default_bucket_bytes(where, sum(spec.nbytes for spec in specs))
    # A tensor larger than a bucket goes straight from the parameter when nothing has to change
    # on the way (contiguous, no cast): no staging copy, and no pipeline fill before it. Not
    # across devices: a CUDA model's weights on a CPU communicator (gloo) are staged.
    direct = [
        n
        for n, t in tensors.items()
        if allow_direct
        and t.nbytes > bucket_bytes
        and t.is_contiguous()
        and (device is None or t.device == device)
        and (wire_dtype is None or not t.is_floating_point() or t.dtype == wire_dtype)
    ]
    return build_layout(specs, bucket_bytes, direct=direct)
