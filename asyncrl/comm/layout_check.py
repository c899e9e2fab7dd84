"""Tensors against an agreed `WeightLayout`: the set-up vote on it (every member's verdict, so a
mismatch anywhere fails set-up everywhere) and the one-line explanation of a mismatch."""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec
import torch

from asyncrl.comm.errors import LayoutMismatchError
from asyncrl.comm.rendezvous import StoreGroup


class _SetupResult(msgspec.Struct, array_like=True, frozen=True):
    rank: int
    error: str  # empty when this member accepts the layout
    notices: bool = False  # this member wants each sync announced on the store (`sync_notice.py`)


def mismatch(expected: list[tuple[str, torch.Size, torch.dtype]], tensors: Mapping[str, torch.Tensor], who: str) -> str:
    """Why ``tensors`` do not fit what this member agreed to at set-up (names, shapes, dtypes)."""
    problems = []
    for name, shape, dtype in expected:
        t = tensors.get(name)
        if t is None:
            problems.append(f"{name}: {who} has no such tensor")
        elif t.shape != shape or t.dtype != dtype:
            problems.append(f"{name}: agreed {list(shape)} {dtype}, now {list(t.shape)} {t.dtype}")
    known = {name for name, _, _ in expected}
    problems += [f"{name}: not in the layout" for name in tensors if name not in known]
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return f"{who} disagrees with the weight layout: {shown}"


def agree_on_setup(group: StoreGroup, error: str, deadline: float, *, notices: bool = False) -> bool:
    """Every member's verdict on the layout; a refusal anywhere fails set-up everywhere. Returns
    whether any member asked for notices of each sync (``notices``)."""
    results = group.all_gather_obj(
        _SetupResult(group.rank, error, notices),
        type=_SetupResult,
        timeout_s=max(deadline - time.monotonic(), 1e-3),
        what="layout check",
    )
    refusals = [r for r in results if r.error]
    if refusals:
        raise LayoutMismatchError("weight layout refused: " + " | ".join(f"rank {r.rank}: {r.error}" for r in refusals))
    return any(r.notices for r in results)
