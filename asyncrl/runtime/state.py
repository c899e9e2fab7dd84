"""The states an actor moves through, as its supervisor sees them."""

import enum


class ActorState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPED = "stopped"
