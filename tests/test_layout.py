"""Bucket layout: placement, chunking, alignment, hashing and the checks that refuse a mismatch."""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.comm.errors import LayoutMismatchError
from asyncrl.comm.layout import (
    DTYPES,
    TensorSpec,
    WeightLayout,
    build_layout,
    default_bucket_bytes,
    dtype_name,
    sender_layout,
    spec_of,
)


def specs(*entries):
    return [TensorSpec(name, shape, dtype) for name, shape, dtype in entries]


def covered_bytes(layout: WeightLayout) -> dict[int, list[tuple[int, int]]]:
    ranges: dict[int, list[tuple[int, int]]] = {}
    for bucket in layout.buckets:
        for seg in bucket:
            ranges.setdefault(seg.tensor, []).append((seg.start, seg.start + seg.length))
    return ranges


def test_every_byte_of_every_tensor_is_placed_once_and_segments_never_overlap():
    layout = build_layout(
        specs(
            ("a", (10,), "float32"),
            ("big", (1000,), "float32"),
            ("e", (0, 3), "float16"),
            ("b", (3, 3), "bfloat16"),
            ("c", (7,), "int64"),
        ),
        bucket_bytes=1024,
    )
    for index, spec in enumerate(layout.tensors):
        got = sorted(covered_bytes(layout).get(index, []))
        if spec.nbytes == 0:
            assert got == []
            continue
        assert got[0][0] == 0 and got[-1][1] == spec.nbytes
        assert all(a[1] == b[0] for a, b in zip(got, got[1:])), got  # contiguous, no gap, no overlap
    for k, bucket in enumerate(layout.buckets):
        spans = sorted((seg.offset, seg.offset + seg.length) for seg in bucket)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] <= layout.bucket_sizes[k] <= layout.bucket_bytes
        assert all(seg.offset % layout.alignment == 0 for seg in bucket)


def test_a_tensor_that_fits_is_never_split_and_a_larger_one_is_chunked():
    layout = build_layout(
        specs(("small", (200,), "float32"), ("fits", (256,), "float32"), ("huge", (700,), "float32")), bucket_bytes=1024
    )
    ranges = covered_bytes(layout)
    assert ranges[0] == [(0, 800)] and ranges[1] == [(0, 1024)]  # "fits" moved to a fresh bucket
    assert len(ranges[2]) == 3  # 2800 bytes over 1024-byte buckets
    assert layout.buffer_bytes == 1024 and layout.total_bytes == 800 + 1024 + 2800


def test_the_hash_changes_with_any_field_and_is_stable_across_processes_by_construction():
    base = specs(("w", (4, 4), "float32"))
    h = build_layout(base, 1024).digest()
    assert h == build_layout(base, 1024).digest()
    assert 0 <= h < 2**62
    for other in (specs(("w", (4, 4), "bfloat16")), specs(("w", (16,), "float32")), specs(("v", (4, 4), "float32"))):
        assert build_layout(other, 1024).digest() != h
    assert build_layout(base, 2048).digest() != h
    # what travels decodes to an equal layout with an equal hash
    wire = msgspec.msgpack.encode(build_layout(base, 1024))
    assert msgspec.msgpack.decode(wire, type=WeightLayout).digest() == h


def test_check_names_every_difference():
    layout = build_layout([spec_of("a", torch.zeros(2, 3)), spec_of("b", torch.zeros(4, dtype=torch.int64))], 1024)
    layout.check({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}, "me")
    with pytest.raises(LayoutMismatchError, match=r"a: layout has \[2, 3\] float32, me has \[3, 2\] float32"):
        layout.check({"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.int64)}, "me")
    with pytest.raises(LayoutMismatchError, match="b: me has no such tensor"):
        layout.check({"a": torch.zeros(2, 3)}, "me")
    with pytest.raises(LayoutMismatchError, match="c: not in the layout"):
        layout.check({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64), "c": torch.zeros(1)}, "me")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of the alignment"):
        build_layout([], 1000)
    with pytest.raises(ValueError, match="power of two"):
        build_layout([], 1024, alignment=3)
    with pytest.raises(ValueError, match="unique"):
        build_layout(specs(("a", (1,), "float32"), ("a", (1,), "float32")), 1024)
    with pytest.raises(TypeError, match="cannot be synced"):
        dtype_name(torch.complex32)
    for bad in (["a", [1], "os.system"], ["a", [-1], "float32"]):  # refused when decoded off the wire
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode([1024, 256, [bad], [], []]), type=WeightLayout)
    assert "bfloat16" in DTYPES and "float32" in DTYPES


def test_tensors_sent_directly_leave_the_buckets():
    layout = build_layout(
        specs(("small", (10,), "float32"), ("huge", (700,), "float32"), ("tail", (5,), "int64")),
        bucket_bytes=1024,
        direct=["huge"],
    )
    assert layout.direct == [1]
    assert all(seg.tensor != 1 for bucket in layout.buckets for seg in bucket)
    assert sorted(seg.tensor for bucket in layout.buckets for seg in bucket) == [0, 2]
    assert build_layout(layout.tensors, 1024).digest() != layout.digest()  # part of what members agree on
    with pytest.raises(ValueError, match="larger than a bucket"):
        build_layout(specs(("small", (10,), "float32")), 1024, direct=["small"])
    with pytest.raises(ValueError, match="larger than a bucket"):
        build_layout(specs(("small", (10,), "float32")), 1024, direct=["nope"])


def test_the_default_bucket_grows_with_the_weights_on_a_gpu_to_512_mib_and_stays_32_mib_on_the_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # only the device's type is read
    assert default_bucket_bytes(cpu, 15_231_233_024) == 32 << 20
    assert default_bucket_bytes(gpu) == default_bucket_bytes(gpu, 1_260_334_848) == 256 << 20  # 0.5B in bf16
    assert default_bucket_bytes(gpu, 8 << 30) == (8 << 30) // 24 >> 20 << 20  # 341 MiB: whole MiB
    assert default_bucket_bytes(gpu, 15_231_233_024) == 512 << 20  # 7B in bf16
    tensors = {"w": torch.zeros(10, 1000), "b": torch.zeros(10, dtype=torch.int64)}
    layout = sender_layout(tensors, None, torch.bfloat16)
    assert layout.bucket_bytes == 32 << 20 and [s.dtype for s in layout.tensors] == ["bfloat16", "int64"]
