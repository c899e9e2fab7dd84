"""asyncrl: fully-asynchronous RL for language models on a small asyncio actor runtime."""

from .errors import (
    ActorDiedError,
    ActorError,
    ActorStartError,
    AsyncrlError,
    CallTimeoutError,
    ClusterStartError,
    InvalidArgumentsError,
    MessageTooLargeError,
    NoFreeDevicesError,
    ProtocolError,
    RemoteError,
    SupervisorClosedError,
    UnknownMethodError,
)
from .runtime import Actor, ActorHandle, ActorState, ActorStatus, Supervisor, SupervisorConfig, endpoint, start_phase
from .runtime.loop import run

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorDiedError",
    "ActorError",
    "ActorHandle",
    "ActorStartError",
    "ActorState",
    "ActorStatus",
    "AsyncrlError",
    "CallTimeoutError",
    "ClusterStartError",
    "InvalidArgumentsError",
    "MessageTooLargeError",
    "NoFreeDevicesError",
    "ProtocolError",
    "RemoteError",
    "Supervisor",
    "SupervisorClosedError",
    "SupervisorConfig",
    "UnknownMethodError",
    "endpoint",
    "run",
    "start_phase",
]
