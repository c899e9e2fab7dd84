"""Payload codec: every tensor kind round-trips, bulk memory is not copied, bad input is refused."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from asyncrl.runtime import wire
from asyncrl.runtime.codec import INLINE_MAX_BYTES, PayloadDecoder, PayloadEncoder


def roundtrip(obj: Any, typ: Any = Any, via_zmq_frames: bool = True):
    bufs: list = []
    raw = PayloadEncoder().encode(obj, bufs)
    frames = [b""] + [zmq.Frame(b, copy=False) if via_zmq_frames else bytes(memoryview(b)) for b in bufs]
    return PayloadDecoder(typ).decode(raw, frames), bufs


ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 65)], ids=str)
def test_every_dtype_and_shape_roundtrips(dtype, shape):
    src = (torch.randn(shape) * 100).to(torch.float64)
    t = src.to(torch.complex64).to(dtype) if dtype.is_complex else src.to(dtype)
    out, _ = roundtrip(t, torch.Tensor)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.contiguous().view(torch.uint8)) if t.numel() and t.dim() else True
    assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_views_are_sent_as_their_values():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    cases = [
        base.t(),
        base[:, 2:5],
        base[::2],
        base.expand(2, 6, 10),
        torch.randn(4, 4, dtype=torch.complex64).conj(),
        -base.neg(),
    ]
    for t in cases:
        out, _ = roundtrip(t)
        assert out.shape == t.shape and torch.equal(out, t.resolve_conj().resolve_neg())


def test_requires_grad_tensor_is_detached():
    t = torch.ones(100, requires_grad=True)
    out, _ = roundtrip(t)
    assert not out.requires_grad and torch.equal(out, t.detach())


def test_large_tensor_is_not_copied_on_send_nor_on_receive():
    t = torch.arange(1 << 16, dtype=torch.float32)
    bufs: list = []
    raw = PayloadEncoder().encode({"w": t}, bufs)
    assert len(bufs) == 1 and np.shares_memory(bufs[0], t.numpy())  # the frame is the tensor's memory
    frame = zmq.Frame(bufs[0], copy=False)
    out = PayloadDecoder(dict[str, torch.Tensor]).decode(raw, [b"", frame])["w"]
    assert out.data_ptr() == np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data  # rebuilt in place
    assert torch.equal(out, t)


def test_small_tensors_travel_inline():
    bufs: list = []
    PayloadEncoder().encode([torch.zeros(INLINE_MAX_BYTES // 4), torch.zeros(INLINE_MAX_BYTES)], bufs)
    assert len(bufs) == 1  # only the one over the threshold got a frame


def test_numpy_arrays_and_nested_structures():
    obj = {
        "a": np.arange(1000, dtype=np.int32).reshape(10, 100),
        "b": np.float32(3.5),
        "c": [np.zeros((0, 3)), np.ones(3, dtype=np.bool_)],
        "t": (torch.ones(2, 2), b"raw bytes", "text", None, 1.5),
    }
    out, bufs = roundtrip({**obj, "b": np.array(obj["b"])})
    assert np.array_equal(out["a"], obj["a"]) and out["a"].dtype == np.int32
    assert out["b"].shape == () and out["b"] == 3.5
    assert out["c"][0].shape == (0, 3) and out["c"][1].dtype == np.bool_
    assert torch.equal(out["t"][0], torch.ones(2, 2)) and out["t"][1:] == [b"raw bytes", "text", None, 1.5]


def test_typed_decoding_names_the_bad_field():
    class Batch(msgspec.Struct):
        ids: list[int]
        weights: torch.Tensor

    good, _ = roundtrip(Batch([1, 2], torch.ones(3)), Batch)
    assert good.ids == [1, 2] and torch.equal(good.weights, torch.ones(3))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.weights"):
        roundtrip({"ids": [1], "weights": [1.0, 2.0]}, Batch)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.ids\[1\]"):
        roundtrip({"ids": [1, "two"], "weights": torch.ones(1)}, Batch)


@pytest.mark.parametrize(
    "bad",
    [object(), {1, 2}, torch.ones(2).to_sparse(), np.array([object()])],
    ids=["object", "set-of-ints-ok", "sparse", "object-array"],
)
def test_unsendable_values_raise_type_error(bad):
    if isinstance(bad, set):  # msgspec sends sets as arrays: allowed
        out, _ = roundtrip(bad)
        assert sorted(out) == [1, 2]
        return
    with pytest.raises(TypeError):
        PayloadEncoder().encode(bad, [])


def _ext(code: int, header) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, msgspec.msgpack.encode(header))


@pytest.mark.parametrize(
    "ext, frames, match",
    [
        (_ext(1, ("float32", [4], 1)), [b""], "refers to frame 1"),
        (_ext(1, ("float32", [4], 1)), [b"", b"\0" * 12], "holds 12 bytes"),
        (_ext(1, ("not_a_dtype", [1], b"\0")), [b""], "unknown tensor dtype"),
        (_ext(1, ("Tensor", [1], b"\0")), [b""], "unknown tensor dtype"),
        (_ext(1, ("float32", [-1], b"")), [b""], "negative"),
        (_ext(2, ("O", [1], b"\0" * 8)), [b""], "objects"),
        (_ext(9, ("float32", [1], b"\0" * 4)), [b""], "unknown msgpack extension"),
        (_ext(1, "not a header"), [b""], None),
    ],
)
def test_malformed_tensor_headers_are_refused(ext, frames, match):
    raw = msgspec.msgpack.encode([ext])
    with pytest.raises((ValueError, msgspec.DecodeError, msgspec.ValidationError), match=match):
        PayloadDecoder().decode(raw, frames)


def test_envelope_decoder_refuses_garbage_and_wrong_types():
    decoder = msgspec.msgpack.Decoder(wire.ToActor)
    call = wire.Call(7, "add", msgspec.Raw(msgspec.msgpack.encode([1, 2])))
    assert decoder.decode(msgspec.msgpack.encode(call)) == call
    for junk in [
        b"",
        b"\xc1",
        b"\x93\x01\x02",
        msgspec.msgpack.encode(wire.Reply(1, msgspec.Raw(b"\xc0"))),
        msgspec.msgpack.encode([1, "id-not-int", "m", [1]]),
        bytes(range(256)),
    ]:
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decoder.decode(junk)


def test_small_received_tensors_own_their_memory():
    # Inline data arrives as a bytes object, which CPython may share (one-byte bytes are cached):
    # writing into a received tensor must never change any other object.
    out, _ = roundtrip(torch.tensor([5], dtype=torch.uint8))
    out += 1
    assert bytes([5]) == b"\x05" and out.item() == 6
    arr, _ = roundtrip(np.array([5], dtype=np.uint8))
    arr += 1  # writable, like large arrays
    assert arr[0] == 6
