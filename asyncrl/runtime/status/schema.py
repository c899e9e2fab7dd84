"""What the status protocol says and what ``RUN_DIR/supervisor.json`` holds.

One ``StatusRequest`` is answered with one ``StatusReply`` or a typed ``StatusFailure``.
``supervisor.json`` names its writer by pid and by the kernel's start time of that pid, so a
reader tells the live writer from a recycled pid (``same_process_alive``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.runtime.cluster.nodes import NodeStatus
from asyncrl.runtime.record import ActorStatus

PROTOCOL = 1
SUPERVISOR_FILE = "supervisor.json"
SUMMARY_FILE = "summary.json"
MAX_REQUEST_BYTES = 4096
"""A request is a few bytes; anything larger gets a ``MessageTooLargeError`` failure."""
MAX_FRAME_BYTES = 1 << 20
"""libzmq drops the connection of a peer that sends a larger frame, before we ever buffer it."""
MAX_PROGRESS_BYTES = 256 << 10
MAX_REPLY_BYTES = 64 << 20
_MAX_FILE_BYTES = 64 << 10


class StatusRequest(msgspec.Struct, tag="status_request", tag_field="t", frozen=True):
    protocol: int = PROTOCOL


class StatusReply(msgspec.Struct, tag="status", tag_field="t", frozen=True):
    protocol: int
    pid: int
    hostname: str
    run_dir: str
    address: str
    started_at: float
    """Unix time at which the status server started."""
    uptime_s: float
    actors: list[ActorStatus]
    nodes: list[NodeStatus]
    progress: dict[str, Any]
    """What the run's ``progress`` callable returned (JSON-able), or {} if it failed."""
    progress_error: str | None = None


class CommandRequest(msgspec.Struct, tag="command_request", tag_field="t", frozen=True):
    """Asks the run to do something (``asyncrl scale``): ``name`` picks a command the run
    registered (`StatusServer.add_command`), ``args`` are its arguments. Answered with one
    ``CommandReply``, or a ``StatusFailure`` naming why it was refused."""

    name: str
    args: dict[str, int | float | str | bool] = {}
    protocol: int = PROTOCOL


class CommandReply(msgspec.Struct, tag="command", tag_field="t", frozen=True):
    name: str
    result: dict[str, Any]
    """What the command returned (JSON-able)."""


class StatusFailure(msgspec.Struct, tag="status_failure", tag_field="t", frozen=True):
    type_name: str
    message: str


class SupervisorFile(msgspec.Struct, frozen=True):
    """The content of ``RUN_DIR/supervisor.json``."""

    pid: int
    pid_start_ticks: int
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat): tells a recycled pid apart."""
    hostname: str
    address: str
    started_at: float
    protocol: int = PROTOCOL


class RunDirInUseError(AsyncrlError):
    """Another live supervisor already serves the status of this run directory."""


class StatusUnavailableError(AsyncrlError):
    """No status could be had. ``reason``: 'no_run_dir', 'not_started', 'finished', 'bad_file',
    'stale', 'other_host', 'timeout', 'refused' or 'protocol'."""

    EXIT_CODES = {"no_run_dir": 2, "timeout": 3, "refused": 3, "protocol": 3}

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    @property
    def exit_code(self) -> int:
        """For ``asyncrl status``: 1 no live supervisor, 2 no such directory, 3 no valid answer."""
        return self.EXIT_CODES.get(self.reason, 1)


class CommandRefusedError(AsyncrlError):
    """The run refused a command (``asyncrl scale``): ``type_name`` is its error's type, the
    message its one line (what to change)."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class StatusTimeoutError(StatusUnavailableError, TimeoutError):
    def __init__(self, message: str):
        super().__init__("timeout", message)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of ``pid`` from /proc, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def same_process_alive(pid: int, start_ticks: int) -> bool:
    """True while ``pid`` is alive and is the process that started at ``start_ticks`` (not a
    later one given the same pid)."""
    stat = proc_stat(pid)
    if stat is None:
        return False
    state, ticks = stat
    return state not in ("Z", "X") and ticks == start_ticks


def read_file(path: str) -> SupervisorFile:
    """``path`` decoded as a ``SupervisorFile``; ``ValueError``/``msgspec.DecodeError`` if it is
    not one, ``OSError`` if it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
    return msgspec.json.decode(data, type=SupervisorFile)
