"""The weight-sync data plane and its rendezvous; knows nothing of RL (see docs/weight_sync.md).

Backends are imported on use (`make_communicator`), so importing this package loads no
collective library."""

from asyncrl.comm.communicator import Communicator, ReduceOp, Work
from asyncrl.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommError,
    CommLibraryError,
    CommunicatorClosedError,
    LayoutMismatchError,
    RendezvousError,
    RendezvousTimeoutError,
    WeightSyncError,
)
from asyncrl.comm.rendezvous import StoreGroup, join_all, reserve_listener
from asyncrl.comm.weights import SyncStats, WeightReceiver, WeightSender

__all__ = [
    "CollectiveError", "CollectiveTimeoutError", "CommError", "CommLibraryError", "CommunicatorClosedError",
    "Communicator", "LayoutMismatchError", "ReduceOp", "RendezvousError", "RendezvousTimeoutError",
    "StoreGroup", "SyncStats", "WeightReceiver", "WeightSender", "WeightSyncError", "Work", "join_all",
    "reserve_listener",
]
