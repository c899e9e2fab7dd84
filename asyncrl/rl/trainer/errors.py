"""The trainer rank group's errors (``group.py``), torch-free: the driver tells a rank that left its
collectives because of a peer (`LEFT_FOR_A_PEER`) from the rank that failed by catching these
types (they cross processes as themselves, `asyncrl.errors.remote_error_class`) without
importing torch."""

from __future__ import annotations

from asyncrl.errors import AsyncrlError


class RankGroupError(AsyncrlError):
    """Base of the trainer rank group's errors."""


class PeerRankFailedError(RankGroupError):
    """Another trainer rank failed during this call; this rank left its collective because of it.
    ``failed_rank`` names it, and the message carries its error."""

    def __init__(self, rank: int, failed_rank: int, what: str, error: str):
        super().__init__(f"trainer rank {rank} left {what}: trainer rank {failed_rank} failed ({error})")
        self.failed_rank = failed_rank


class RankCollectiveError(RankGroupError):
    """A collective of this rank failed with no failure record from a peer: a peer died (SIGKILL)
    or its connection broke. The driver knows which (it sees the death)."""


class StepDeadlineError(RankGroupError, TimeoutError):
    """A guarded call did not finish within its deadline on this rank (a peer is frozen or slow)."""


class RankGroupClosedError(RankGroupError):
    """The group already failed (or was closed); nothing more can run on it."""


LEFT_FOR_A_PEER: tuple[type[RankGroupError], ...] = (
    PeerRankFailedError,
    RankCollectiveError,
    RankGroupClosedError,
    StepDeadlineError,
)
"""The errors of a rank that left its collectives because of a peer: never the cause of a failure."""
