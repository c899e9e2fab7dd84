"""The states an actor moves through, as its supervisor sees them, and the supervisor's own."""

import enum


class _StrState(str, enum.Enum):
    """A string enum (``enum.StrEnum`` is 3.11+): a state compares equal to, prints, formats and
    JSON-encodes as its value (``"running"``), so ``asyncrl status`` output and messages read the
    same as when states were plain strings."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class SupervisorState(_StrState):
    """A `Supervisor`'s life: made, started (``async with``), closing its actors, closed."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class ActorState(_StrState):
    """An actor's state, as ``asyncrl status`` and `ActorHandle.info` show it."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        """DEAD or STOPPED: an actor in a final state never runs again (its name may be reused
        by a new actor, with a new handle)."""
        return self in (ActorState.DEAD, ActorState.STOPPED)
