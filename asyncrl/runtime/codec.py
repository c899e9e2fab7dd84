"""Payload codec: msgpack for the structure, separate ZeroMQ frames for bulk tensor/array memory.

A tensor or numpy array inside a payload becomes a msgpack extension value holding
``(dtype, shape, where)``: ``where`` is the index of the frame that carries its bytes, or, for
arrays under ``INLINE_MAX_BYTES``, the bytes themselves. On send, each frame is a view of the
tensor's own memory (no copy; pyzmq keeps a reference to it until libzmq has sent it). On receive,
the tensor is rebuilt over the frame's memory with ``torch.frombuffer`` (no copy either).

(The layout follows vLLM v1's ``serial_utils``: small ext header, bulk bytes as aux frames.)

Every torch dtype travels, bfloat16 and float8 included, because the bytes are sent as uint8 and
the dtype by name. ``bytes`` values travel inline inside the msgpack body (one copy); send large
binary blobs as a uint8 tensor or array to get a frame of their own.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

TENSOR_EXT = 1
NDARRAY_EXT = 2
INLINE_MAX_BYTES = 256

# A received tensor is backed by the message's memory, which this process owns; torch warns that
# the buffer object is read-only, which is true of the Python object but not of the memory.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[str, list[int], int | bytes])


def _torch():
    try:
        import torch
    except ImportError:
        raise ValueError("the payload holds a tensor, but torch is not installed here") from None
    return torch


def _flat_bytes(t) -> np.ndarray:
    """The bytes of a CPU, contiguous tensor as a uint8 numpy view sharing its memory."""
    torch = _torch()
    return t.reshape(-1).view(torch.uint8).numpy()


class PayloadEncoder:
    """Encodes one payload at a time; large tensors/arrays are appended to ``bufs`` as frames."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._bufs: list = []  # the caller's, during `encode` only
        self._first_index = 1

    def encode(self, obj: Any, bufs: list, first_index: int = 1) -> msgspec.Raw:
        """Encode ``obj``; frame ``first_index + i`` of the final message will be ``bufs[i]``."""
        self._bufs, self._first_index = bufs, first_index
        try:
            return msgspec.Raw(self._enc.encode(obj))
        finally:
            self._bufs = []

    def _add(self, data) -> int | bytes:
        if data.nbytes <= INLINE_MAX_BYTES:
            return data.tobytes()
        self._bufs.append(data)
        return self._first_index + len(self._bufs) - 1

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.layout != torch.strided:
                raise TypeError(f"cannot send a {obj.layout} tensor; send a dense one")
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.resolve_conj().resolve_neg().contiguous()
            header = (str(t.dtype).removeprefix("torch."), list(t.shape), self._add(_flat_bytes(t)))
            return msgspec.msgpack.Ext(TENSOR_EXT, _header_encoder.encode(header))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("cannot send a numpy array of Python objects")
            a = obj if obj.flags.c_contiguous else obj.copy(order="C")  # keeps 0-d arrays 0-d
            data = a.reshape(-1).view(np.uint8)
            header = (a.dtype.str, list(a.shape), self._add(data))
            return msgspec.msgpack.Ext(NDARRAY_EXT, _header_encoder.encode(header))
        raise TypeError(f"cannot send an object of type {type(obj).__qualname__}")


def _torch_dtype(name: str):
    torch = _torch()
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _dec_hook(typ: type, obj: Any) -> Any:
    """Called by msgspec for annotations it does not know natively (``torch.Tensor``, ``ndarray``)."""
    if isinstance(typ, type) and isinstance(obj, typ):
        return obj
    raise TypeError(f"Expected `{getattr(typ, '__name__', typ)}`, got `{type(obj).__name__}`")


class PayloadDecoder:
    """Decodes payloads against one type (``Any`` when unannotated), resolving frame references."""

    def __init__(self, typ: Any = Any) -> None:
        self._dec = msgspec.msgpack.Decoder(typ, dec_hook=_dec_hook, ext_hook=self._ext_hook)
        self._frames: list = []

    def decode(self, raw: msgspec.Raw | bytes, frames: list) -> Any:
        self._frames = frames
        try:
            return self._dec.decode(raw)
        finally:
            self._frames = []

    def _buffer(self, where: int | bytes, nbytes: int) -> memoryview:
        if isinstance(where, bytes):
            # A private, writable copy: the decoded bytes object may be shared (CPython caches
            # one-byte bytes), and a tensor over it must never write into a shared object.
            buf = memoryview(bytearray(where))
        else:
            if not 0 < where < len(self._frames):
                raise ValueError(f"payload refers to frame {where}, the message has {len(self._frames)}")
            buf = memoryview(self._frames[where])
        if buf.nbytes != nbytes:
            raise ValueError(f"frame holds {buf.nbytes} bytes, its header says {nbytes}")
        return buf

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype_name, shape, where = _header_decoder.decode(data)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        numel = 1
        for d in shape:
            numel *= d
        if code == TENSOR_EXT:
            torch = _torch()
            dtype = _torch_dtype(dtype_name)
            buf = self._buffer(where, numel * dtype.itemsize)
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
        if code == NDARRAY_EXT:
            dtype = np.dtype(dtype_name)
            if dtype.hasobject:
                raise ValueError("refusing a numpy array of Python objects")
            buf = self._buffer(where, numel * dtype.itemsize)
            return np.frombuffer(buf, dtype=dtype).reshape(shape)
        raise ValueError(f"unknown msgpack extension code {code}")


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)
