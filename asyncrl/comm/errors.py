"""Typed errors of the weight-sync data plane. Each names the group, the rank(s) involved and what
was awaited, so a failed sync on a 64-rank job says who to look at."""

from __future__ import annotations

from collections.abc import Iterable

from asyncrl.errors import AsyncrlError, type_path


class CommError(AsyncrlError):
    """Base class of every data-plane error."""


class RendezvousError(CommError):
    """The group could not be formed: bad arguments, a port in use, a member that disagrees on the
    world size, or a store that went away."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Some members did not arrive at a rendezvous step in time. ``missing`` lists their ranks."""

    def __init__(self, group: str, what: str, missing: Iterable[int], timeout_s: float):
        self.missing = sorted(missing)
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(f"group {group!r}: rank(s) {self.missing} did not arrive for {what} within {timeout_s:g} s")


class CollectiveError(CommError):
    """A collective failed: a peer died, a connection broke, or the library reported an error.
    The communicator that raised it is aborted and refuses further work; build a new group."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within its deadline (a peer is frozen, gone, or never joined).
    The communicator was aborted so no kernel or thread is left waiting on the peer."""


class CommunicatorClosedError(CommError):
    """Work was submitted to a communicator that was closed or aborted before."""


class CommLibraryError(CommError):
    """A collective library (libnccl, libhccl) could not be found or loaded, or lacks a symbol."""


class WeightSyncError(CommError):
    """A weight sync was refused or failed. The message names the members and the reason;
    the receiving side's weights are not valid until the next successful sync."""


class LayoutMismatchError(WeightSyncError):
    """Members disagree on the weight layout (names, shapes, dtypes or bucket offsets)."""


PEER_FAILURE_ERRORS: tuple[type[CommError], ...] = (
    RendezvousError,
    RendezvousTimeoutError,
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    WeightSyncError,
    LayoutMismatchError,
)
"""The data-plane errors a member raises when a peer fails (or cannot be reached): one that ends
a group-wide call with one of these is a victim of the failure, not its cause."""

COMM_ERRORS_BY_PATH: dict[str, type[CommError]] = {
    type_path(cls): cls for cls in (*PEER_FAILURE_ERRORS, CommLibraryError)
}
"""The same errors by type path (``module.QualName``): how a vLLM worker's answer names one is
turned back into the type; a name alone could be another module's class of that name."""
