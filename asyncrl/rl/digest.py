"""A digest of a set of named tensors, the same wherever they live (``--run.check_weights``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any


def tensor_digest(tensors: Mapping[str, Any], dtypes: Mapping[str, Any] | None = None) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: two holders of
    the same weights get the same digest whatever device or process they live in. ``dtypes``:
    hash a named tensor as cast to this dtype (a sender's fp32 weights as the bf16 its samplers
    hold), one tensor at a time."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if dtypes is not None and name in dtypes:
            t = t.to(dtypes[name])
        t = t.contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the bytes
    return h.hexdigest()
