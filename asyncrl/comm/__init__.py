"""The weight-sync data plane and its rendezvous; knows nothing of RL (see docs/weight_sync.md).

A member forms (or, next generation, rebuilds) its group with `join_sync_group`, given the group's
`SyncAddress` and its own rank. Backends are imported on use (`make_communicator`), so importing
this package loads no collective library."""

import importlib
from typing import Any

# Names resolved on first use (PEP 562): the communicator, rendezvous and weight modules load
# torch, and code that only needs the typed errors (the GRPO driver judging a remote failure,
# a flag error that must answer without torch) imports this package too.
_HOMES = {
    "Communicator": "communicator",
    "ReduceOp": "communicator",
    "Work": "communicator",
    "CollectiveError": "errors",
    "CollectiveTimeoutError": "errors",
    "CommError": "errors",
    "CommLibraryError": "errors",
    "CommunicatorClosedError": "errors",
    "LayoutMismatchError": "errors",
    "RendezvousError": "errors",
    "RendezvousTimeoutError": "errors",
    "WeightSyncError": "errors",
    "SyncAddress": "address",
    "SyncMembership": "join",
    "join_sync_group": "join",
    "make_communicator": "join",
    "StoreGroup": "rendezvous",
    "join_all": "rendezvous",
    "reserve_listener": "rendezvous",
    "SyncStats": "sync_stats",
    "NoticeWatch": "sync_notice",
    "StagedReceiver": "staged",
    "WeightReceiver": "weights",
    "WeightSender": "weights",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommError",
    "CommLibraryError",
    "CommunicatorClosedError",
    "Communicator",
    "LayoutMismatchError",
    "NoticeWatch",
    "ReduceOp",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StagedReceiver",
    "StoreGroup",
    "SyncAddress",
    "SyncMembership",
    "SyncStats",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "Work",
    "join_all",
    "join_sync_group",
    "make_communicator",
    "reserve_listener",
]
