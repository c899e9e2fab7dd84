"""Telling receivers that a weight sync begins, on the group's store, ahead of its first vote.

A receiver normally learns of a sync from its own caller (a sampler told by the driver), and a vLLM
engine takes that call only between two of its steps, so the sender's first vote waits for the
engine's step boundary (issue 46 item 3). A receiver that stages its syncs (`staged.py`) instead
waits on the store for the sender's notice and joins the sync at once. The sender posts notices
only where some receiver asked at set-up (`layout_check.agree_on_setup`).

The n-th sync (0, 1, ...) a sender makes after its set-up is announced under
``notice/<set-up>/<n>``, valued its version; the set-up is named by the group's count of store
calls when it ended (`StoreGroup.calls`, the same on every member), so the notices of an earlier
set-up in the same group are never read as this one's. Receivers count the syncs they took part
in, so each knows the next key. The sender drops the previous key as it posts the next: by then
every member has taken part in that sync.

A receiver waits on a connection of its own to the store, for as long as no sync comes; it is
woken to stop by the key it waits for, set to -1 through the group's connection (a wait with a
short timeout instead would make torch log two warnings at every timeout).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from asyncrl.comm.errors import RendezvousError, WeightSyncError
from asyncrl.comm.rendezvous import StoreGroup

WAIT_S = 3600.0
"""How long one wait for a notice lasts before it is renewed (torch logs each that times out)."""
STOP = -1
"""The value that wakes a waiting receiver to stop."""


def _key(setup: int, n: int) -> str:
    return f"notice/{setup}/{n}"


class SyncNotices:
    """The sender's side: one key per sync on the group's store (a local call: rank 0 hosts it)."""

    def __init__(self, group: StoreGroup, setup: int, who: str):
        self.store, self.setup, self.who = group.store, setup, who
        self.posted = 0

    def post(self, version: int) -> None:
        n, self.posted = self.posted, self.posted + 1
        try:
            self.store.set(_key(self.setup, n), str(version))
            if n:
                self.store.delete_key(_key(self.setup, n - 1))
        except dist.DistError as exc:
            raise WeightSyncError(
                f"{self.who}: could not announce sync v{version} on the group's store: {exc}"
            ) from exc


class NoticeWatch:
    """A receiver's side, for the set-up named ``setup`` (`WeightReceiver.setup_calls`)."""

    def __init__(self, group: StoreGroup, setup: int):
        self.label, self.setup = group.label, setup
        self.waker = group.store
        self.store = group.second_connection(WAIT_S)

    def wait(self, n: int) -> int:
        """The version of the ``n``-th sync once it is announced, or `STOP` once `wake` was called."""
        key = _key(self.setup, n)
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=WAIT_S))
                return int(self.store.get(key))
            except dist.DistNetworkError as exc:
                raise RendezvousError(
                    f"group {self.label!r}: lost the store while waiting for sync notices: {exc}"
                ) from exc
            except dist.DistError:  # an hour without a sync: wait again
                continue

    def wake(self, n: int) -> None:
        """Make `wait` for the ``n``-th sync return `STOP`; nothing if the store is gone (then the
        wait ends by itself, with the connection)."""
        try:
            self.waker.set(_key(self.setup, n), str(STOP))
        except dist.DistError:
            pass
