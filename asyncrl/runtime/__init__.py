"""The generic actor runtime: knows nothing of RL. See docs/runtime.md."""

from .actor import Actor, endpoint
from .config import SupervisorConfig
from .handle import ActorHandle
from .state import ActorState
from .supervisor import ActorStatus, Supervisor

__all__ = ["Actor", "ActorHandle", "ActorState", "ActorStatus", "Supervisor", "SupervisorConfig", "endpoint"]
