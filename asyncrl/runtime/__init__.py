"""The generic actor runtime: knows nothing of RL. See docs/runtime.md."""

from asyncrl.runtime.actor import Actor, endpoint
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.devices import detect as detect_devices
from asyncrl.runtime.handle import ActorHandle
from asyncrl.runtime.record import ActorStatus
from asyncrl.runtime.startup import start_phase
from asyncrl.runtime.state import ActorState
from asyncrl.runtime.supervisor import Supervisor
from asyncrl.runtime.transport import pid_alive

__all__ = [
    "Actor",
    "ActorHandle",
    "ActorState",
    "ActorStatus",
    "Supervisor",
    "SupervisorConfig",
    "detect_devices",
    "endpoint",
    "pid_alive",
    "start_phase",
]
