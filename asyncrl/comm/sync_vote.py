"""The two votes of a weight sync (``weights.py``), each one small all_reduce of int64s (MAX) in
which every member takes part, so that all of them learn the same result: `agree` before any
weight moves (the version, the layout, whether anyone refuses, the delta base), `commit` after the
last bucket (whether every member applied all of it). A failure anywhere fails the sync everywhere.

A value voted next to its negation gives both its largest and its smallest across the members:
they agree where the two are equal."""

from __future__ import annotations

from asyncrl.comm.delta import SyncMode
from asyncrl.comm.errors import LayoutMismatchError, WeightSyncError
from asyncrl.comm.staging import Staging


def agree(staging: Staging, who: str, version: int, layout_hash: int, refusal: str, base: int, keep: bool) -> SyncMode:
    """First vote: same version, same layout, nobody refusing; else fail everywhere. It also
    says whether the sender keeps a base (``keep``) and whether every member holds it."""
    h = layout_hash
    code = staging.comm.rank + 1 if refusal else 0
    votes = staging.vote([version, -version, h, -h, code, base, -base, int(keep)])
    vmax, vneg, hmax, hneg, refuser, bmax, bneg, kept = votes
    if refusal:
        raise WeightSyncError(f"{who} refused weight sync v{version}: {refusal}")
    if hmax != -hneg:
        raise LayoutMismatchError(f"{who}: members disagree on the weight layout in sync v{version}")
    if vmax != -vneg:
        raise WeightSyncError(f"{who}: members disagree on the version of this sync (from v{-vneg} to v{vmax})")
    if refuser:
        raise WeightSyncError(f"{who}: rank {refuser - 1} refused weight sync v{version} (see its error)")
    return SyncMode(keep=bool(kept), delta=bool(kept) and bmax == -bneg and bmax >= 0)


def commit(staging: Staging, who: str, version: int, failure: str) -> None:
    """Second vote: succeeds only if every member applied every bucket."""
    (failed,) = staging.vote([staging.comm.rank + 1 if failure else 0])
    if failure:
        raise WeightSyncError(f"{who}: weight sync v{version} failed here: {failure}")
    if failed:
        raise WeightSyncError(f"{who}: weight sync v{version} failed on rank {failed - 1}")
