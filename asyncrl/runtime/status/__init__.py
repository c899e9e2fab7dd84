"""A live health view of a run: ``asyncrl status RUN_DIR`` asks the supervisor serving that run.

``schema``: the protocol's messages and ``RUN_DIR/supervisor.json``; ``server``: ``StatusServer``
(``await sup.serve_status(run_dir, progress=...)``); ``client``: ``read_supervisor_file`` and
``query_status``; ``view``: what ``asyncrl status`` prints. The names below are importable from
``asyncrl.runtime.status`` itself, as they were when this was one module.
"""

from asyncrl.runtime.status.client import query_status, read_supervisor_file, send_command
from asyncrl.runtime.status.schema import (
    MAX_FRAME_BYTES,
    MAX_PROGRESS_BYTES,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL,
    SUMMARY_FILE,
    SUPERVISOR_FILE,
    CommandRefusedError,
    CommandReply,
    CommandRequest,
    RunDirInUseError,
    StatusFailure,
    StatusReply,
    StatusRequest,
    StatusTimeoutError,
    StatusUnavailableError,
    SupervisorFile,
)
from asyncrl.runtime.status.server import StatusServer
from asyncrl.runtime.status.view import format_status, reply_json

__all__ = [
    "CommandRefusedError",
    "CommandReply",
    "CommandRequest",
    "send_command",
    "MAX_FRAME_BYTES",
    "MAX_PROGRESS_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PROTOCOL",
    "SUMMARY_FILE",
    "SUPERVISOR_FILE",
    "RunDirInUseError",
    "StatusFailure",
    "StatusReply",
    "StatusRequest",
    "StatusServer",
    "StatusTimeoutError",
    "StatusUnavailableError",
    "SupervisorFile",
    "format_status",
    "query_status",
    "read_supervisor_file",
    "reply_json",
]
