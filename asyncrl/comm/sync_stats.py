"""`SyncStats`: what one member measured of one weight sync (``weights.py``). It crosses processes
(the trainer's ``send_weights`` answers it, a sampler's ``receive_weights`` carries its own), so it
is a msgspec struct, and this module needs no torch.
"""

from __future__ import annotations

import msgspec


class SyncStats(msgspec.Struct, frozen=True):
    """One member's side of one sync. ``seconds``: the whole of it, from the first vote to the
    commit. Its phases (seconds; fields appended at the end, with defaults, so an older peer's
    stats still decode):

    * ``vote_s``: the first vote, which ends only when every member has arrived (a sender's
      includes the receivers' wait for a moment free of generation);
    * ``move_s``: the host's time between the votes (on GPU mostly enqueuing: see below);
    * ``commit_s``: the commit vote, which waits for what is still on the wire and for every
      receiver to apply its last bucket;
    * ``copy_s``: in the staging copies: packing and casting to the wire's dtype on a sender,
      unpacking on a receiver, a consumer's load (vLLM ``load_weights``) included;
    * ``transfer_s``: on the wire.

    ``vote_s + move_s + commit_s`` is ``seconds`` up to a few checks. ``copy_s`` and ``transfer_s``
    are measured where the work runs (`PhaseClock`): host time on CPU, each within ``move_s`` and
    the tail of ``commit_s`` and together at most ``seconds``; CUDA events on GPU, where the two
    overlap (double buffering), so their sum may exceed ``seconds`` while each stays below it.

    A delta sync (``comm/delta.py``) moves fewer bytes than ``bytes``: ``sent_bytes`` is what
    went on the wire (the counts, the changed words and their indices, the buckets sent whole;
    in a full sync the buckets, padding included, and the tensors sent directly),
    ``changed`` the fraction of the wire's words that changed since the last sync (the sender's;
    -1 where it was not measured: a full sync, a receiver)."""

    version: int
    bytes: int
    buckets: int
    seconds: float
    vote_s: float = 0.0
    move_s: float = 0.0
    commit_s: float = 0.0
    copy_s: float = 0.0
    transfer_s: float = 0.0
    delta: bool = False
    sent_bytes: int = -1
    """-1: not counted (a peer without delta syncs); in a full sync `bytes` and the alignment
    padding between tensors in a bucket."""
    changed: float = -1.0
