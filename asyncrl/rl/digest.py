"""A digest of a set of named tensors, the same wherever they live (``--run.check_weights``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any


def tensor_digest(tensors: Mapping[str, Any]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: two holders of
    the same weights get the same digest whatever device or process they live in."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
