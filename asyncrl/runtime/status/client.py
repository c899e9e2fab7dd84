"""The client side of ``asyncrl status``: find the live supervisor of a run directory, ask it.

``read_supervisor_file`` reads supervisor.json and checks that its writer is still that same
process (pid and start time, so a recycled pid is not mistaken for it); ``query_status`` then asks
with one bounded wait. Every way of getting no answer is a ``StatusUnavailableError`` whose
``reason`` says which.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec
import zmq

from asyncrl.runtime.status.schema import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    SUMMARY_FILE,
    SUPERVISOR_FILE,
    CommandRefusedError,
    CommandReply,
    CommandRequest,
    StatusFailure,
    StatusReply,
    StatusRequest,
    StatusTimeoutError,
    StatusUnavailableError,
    SupervisorFile,
    read_file,
    same_process_alive,
)
from asyncrl.runtime.status.view import local_time
from asyncrl.runtime.transport import configure


def read_supervisor_file(run_dir: str) -> SupervisorFile:
    """The live supervisor's ``SupervisorFile`` for ``run_dir``, or a ``StatusUnavailableError``
    that says why there is none."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise StatusUnavailableError("no_run_dir", f"no such run directory: {run_dir}")
    path = os.path.join(run_dir, SUPERVISOR_FILE)
    try:
        info = read_file(path)
    except FileNotFoundError:
        if os.path.exists(os.path.join(run_dir, SUMMARY_FILE)):
            raise StatusUnavailableError(
                "finished", f"the run in {run_dir} has finished ({SUMMARY_FILE} is there); no supervisor serves it"
            ) from None
        raise StatusUnavailableError(
            "not_started",
            f"no supervisor serves {run_dir} (no {SUPERVISOR_FILE}): the run has not started yet, "
            f"or it ended without {SUMMARY_FILE}",
        ) from None
    except (OSError, ValueError, msgspec.DecodeError) as e:
        raise StatusUnavailableError("bad_file", f"cannot read {path}: {e}") from None
    if info.hostname != socket.gethostname():
        raise StatusUnavailableError(
            "other_host",
            f"the supervisor of {run_dir} runs on host {info.hostname} (pid {info.pid}); run `asyncrl status` there",
        )
    if not same_process_alive(info.pid, info.pid_start_ticks):
        raise StatusUnavailableError(
            "stale",
            f"the supervisor is not running: pid {info.pid}, which wrote {path} at {local_time(info.started_at)}, "
            "is gone (killed or crashed before it could remove the file); the file is stale",
        )
    if info.address.startswith("ipc://") and not os.path.exists(info.address[len("ipc://") :]):
        raise StatusUnavailableError(
            "stale", f"the supervisor (pid {info.pid}) no longer serves status: its socket {info.address} is gone"
        )
    return info


def query_status(run_dir: str, timeout_s: float = 5.0) -> StatusReply:
    """Ask the live supervisor of ``run_dir`` for its status, waiting at most ``timeout_s``."""
    who, answer = _ask(run_dir, StatusRequest(), StatusReply, timeout_s)
    if isinstance(answer, StatusFailure):
        raise StatusUnavailableError("refused", f"{who} refused the request: {answer.type_name}: {answer.message}")
    if answer.protocol != PROTOCOL:
        raise StatusUnavailableError(
            "protocol", f"{who} speaks status protocol {answer.protocol}, this client {PROTOCOL}"
        )
    return answer


def send_command(run_dir: str, name: str, args: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """Ask the live supervisor of ``run_dir`` to run its command ``name`` with ``args``; returns
    the command's result. Raises `CommandRefusedError` (the run's one line: a bad value, an
    unknown command) or a `StatusUnavailableError` (no live run, no answer in ``timeout_s``)."""
    who, answer = _ask(run_dir, CommandRequest(name, args), CommandReply, timeout_s)
    if isinstance(answer, StatusFailure):
        raise CommandRefusedError(answer.type_name, answer.message)
    return answer.result


def _ask(run_dir: str, request: Any, reply_type: type, timeout_s: float) -> tuple[str, Any]:
    """Send ``request`` to the live supervisor of ``run_dir``; (who answered, its answer: a
    ``reply_type`` or a ``StatusFailure``), with one bounded wait."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
    info = read_supervisor_file(run_dir)
    who = f"the supervisor (pid {info.pid}) at {info.address}"
    ctx = zmq.Context()
    sock = configure(ctx.socket(zmq.DEALER), hwm=4)
    try:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.connect(info.address)
        try:
            sock.send(msgspec.msgpack.encode(request), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise StatusUnavailableError("refused", f"cannot send to {who}: {e}") from None
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise StatusTimeoutError(f"no answer from {who} within {timeout_s:g} s (busy, stopped, or frozen?)")
        frames = sock.recv_multipart(zmq.NOBLOCK)
    finally:
        ctx.destroy(0)  # closes sock too (made by ctx.socket), so terminating cannot wait on it
    try:
        if len(frames) != 1:
            raise ValueError(f"{len(frames)} frames, not 1")
        return who, msgspec.msgpack.decode(frames[0], type=reply_type | StatusFailure)
    except (ValueError, msgspec.DecodeError) as e:
        raise StatusUnavailableError(
            "protocol", f"undecodable answer from {who} (another asyncrl version?): {e}"
        ) from None
