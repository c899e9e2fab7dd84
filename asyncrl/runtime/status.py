"""A live health view of a run: ``asyncrl status RUN_DIR`` asks the supervisor serving that run.

Server: ``StatusServer`` (``await sup.serve_status(run_dir, progress=...)``) binds a ROUTER at an
``ipc://`` path inside a private directory of its own (mode 0700, named like the supervisor's, so
a later supervisor sweeps it if this process is SIGKILLed), and publishes that address in
``RUN_DIR/supervisor.json``. Only the owner of the run can connect: the directory's mode is the
access control, and nothing listens on TCP, so no CURVE is needed. Every ``StatusRequest`` is
answered from the event loop with one ``StatusReply``; anything else gets a typed
``StatusFailure`` and the server keeps serving. ``close()`` removes the socket and
supervisor.json; a ``weakref.finalize`` does the same if the owner never calls it.

Client: ``query_status`` reads supervisor.json, checks that its writer is still that same process
(its pid and the kernel's start time of that pid, so a recycled pid is not mistaken for it), then
asks with one bounded wait. Every way of getting no answer is a ``StatusUnavailableError`` whose
``reason`` says which.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import weakref
from typing import Any, Callable, Union

import msgspec
import zmq

from .cluster import NodeStatus
from .record import ActorStatus
from .transport import LoopSocket, configure, make_run_dir, remove_run_dir
from ..errors import AsyncrlError

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


class StatusTimeoutError(StatusUnavailableError, TimeoutError):
    def __init__(self, message: str):
        super().__init__("timeout", message)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of ``pid`` from /proc, None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _same_process_alive(pid: int, start_ticks: int) -> bool:
    stat = _proc_stat(pid)
    if stat is None:
        return False
    state, ticks = stat
    return state not in ("Z", "X") and ticks == start_ticks


def _read_file(path: str) -> SupervisorFile:
    with open(path, "rb") as f:
        data = f.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
    return msgspec.json.decode(data, type=SupervisorFile)


# --- server ------------------------------------------------------------------------------------


def _remove_if_ours(path: str, ours: bytes) -> None:
    """Unlink ``path`` only while it still holds what we wrote: a later supervisor of the same run
    directory may have replaced it, and its file is not ours to remove."""
    try:
        with open(path, "rb") as f:
            if f.read(len(ours) + 1) != ours:
                return
        os.unlink(path)
    except OSError:
        pass


def _cleanup(socket_dir: str, path: str, ours: list[bytes]) -> None:
    if ours:
        _remove_if_ours(path, ours[0])
    remove_run_dir(socket_dir)


class StatusServer:
    """Answers ``StatusRequest``s for one run directory. ``actors`` and ``nodes`` are the
    supervisor's ``status`` and ``nodes``; ``progress`` returns a JSON-able dict describing the
    run. All three are called on the event loop, once per request, so they must be quick."""

    def __init__(
        self,
        run_dir: str,
        actors: Callable[[], list[ActorStatus]],
        nodes: Callable[[], list[NodeStatus]],
        progress: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, SUPERVISOR_FILE)
        self.address = ""
        self.requests = 0
        """Requests answered with a ``StatusReply``."""
        self.refused = 0
        """Messages answered with a ``StatusFailure`` (malformed, oversized, wrong protocol)."""
        self._actors, self._nodes, self._progress = actors, nodes, progress
        self._sock: LoopSocket | None = None
        self._ctx: zmq.Context | None = None
        self._closed = False
        self._written: list[bytes] = []  # filled once supervisor.json is ours; read by the finalizer
        self._decoder = msgspec.msgpack.Decoder(StatusRequest)
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Bind and publish. Call from the event loop that will serve the requests."""
        if not os.path.isdir(self.run_dir):
            raise FileNotFoundError(f"run directory {self.run_dir} does not exist")
        _refuse_if_served(self.path)
        self._socket_dir = make_run_dir()
        self._finalizer = weakref.finalize(self, _cleanup, self._socket_dir, self.path, self._written)
        try:
            self._ctx = zmq.Context()
            sock = configure(self._ctx.socket(zmq.ROUTER), hwm=64)  # made by ctx: destroy() closes it on any failure
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client is dropped, not queued
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # before bind: a listener copies its options
            bind = f"ipc://{self._socket_dir}/status.sock"
            try:
                sock.bind(bind)
            except zmq.ZMQError as e:
                sock.close(0)
                raise OSError(f"status server: cannot bind {bind}: {e}") from e
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sock = LoopSocket(sock, self._on_message, "status server")
            self.started_at = time.time()
            self._started = time.monotonic()
            self._publish()
        except BaseException:
            self.close()
            raise

    def _publish(self) -> None:
        """Write supervisor.json by rename, so a reader sees the old file, none, or all of ours."""
        record = SupervisorFile(os.getpid(), _proc_stat(os.getpid())[1], socket.gethostname(), self.address, self.started_at)
        data = msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix=f".{SUPERVISOR_FILE}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._written.append(data)

    def close(self) -> None:
        """Stop answering; remove the socket and supervisor.json (if still ours). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.destroy(0)
        if hasattr(self, "_finalizer"):
            self._finalizer()

    async def __aenter__(self) -> "StatusServer":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # --- requests ------------------------------------------------------------------------------

    def _on_message(self, frames: list) -> None:
        route = frames[0].bytes
        if len(frames) != 2:
            return self._refuse(route, "ProtocolError", f"a request is one frame, not {len(frames) - 1}")
        body = frames[1]
        if len(body) > MAX_REQUEST_BYTES:
            return self._refuse(route, "MessageTooLargeError", f"request of {len(body)} bytes, over {MAX_REQUEST_BYTES}")
        try:
            request = self._decoder.decode(body.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._refuse(route, "ProtocolError", f"not a StatusRequest: {e}")
        if request.protocol != PROTOCOL:
            return self._refuse(route, "ProtocolError", f"status protocol {request.protocol}; this supervisor speaks {PROTOCOL}")
        try:
            reply = self._encoder.encode(self.snapshot())
        except Exception as e:  # a bug of ours must not stop the server: say it to the caller
            return self._refuse(route, type(e).__name__, str(e))
        self.requests += 1
        self._sock.send([route, reply], copy=True)

    def _refuse(self, route: bytes, type_name: str, message: str) -> None:
        self.refused += 1
        self._sock.send([route, self._encoder.encode(StatusFailure(type_name, message))], copy=True)

    def snapshot(self) -> StatusReply:
        """What a request is answered with, now."""
        try:
            nodes = self._nodes()
        except AsyncrlError:  # the supervisor is closing: its actors' states still say something
            nodes = []
        progress, error = self._progress_now()
        return StatusReply(
            protocol=PROTOCOL,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            run_dir=self.run_dir,
            address=self.address,
            started_at=self.started_at,
            uptime_s=round(time.monotonic() - self._started, 3),
            actors=self._actors(),
            nodes=nodes,
            progress=progress,
            progress_error=error,
        )

    def _progress_now(self) -> tuple[dict[str, Any], str | None]:
        if self._progress is None:
            return {}, None
        try:
            value = self._progress()
            if not isinstance(value, dict):
                raise TypeError(f"progress() returned a {type(value).__name__}, not a dict")
            text = msgspec.json.encode(value)  # what `--json` prints must be JSON: normalise here
            if len(text) > MAX_PROGRESS_BYTES:
                raise ValueError(f"progress() returned {len(text)} bytes of JSON, over {MAX_PROGRESS_BYTES}")
            return msgspec.json.decode(text), None
        except Exception as e:
            return {}, f"{type(e).__name__}: {e}"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _refuse_if_served(path: str) -> None:
    try:
        current = _read_file(path)
    except (OSError, ValueError, msgspec.DecodeError):
        return  # none, or unreadable: ours replaces it
    if current.hostname == socket.gethostname() and _same_process_alive(current.pid, current.pid_start_ticks):
        raise RunDirInUseError(
            f"{os.path.dirname(path)} is already served by a live supervisor (pid {current.pid}, {current.address}); "
            "two runs must not share a run directory"
        )


# --- client ------------------------------------------------------------------------------------


def read_supervisor_file(run_dir: str) -> SupervisorFile:
    """The live supervisor's ``SupervisorFile`` for ``run_dir``, or a ``StatusUnavailableError``
    that says why there is none."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise StatusUnavailableError("no_run_dir", f"no such run directory: {run_dir}")
    path = os.path.join(run_dir, SUPERVISOR_FILE)
    try:
        info = _read_file(path)
    except FileNotFoundError:
        if os.path.exists(os.path.join(run_dir, SUMMARY_FILE)):
            raise StatusUnavailableError(
                "finished", f"the run in {run_dir} has finished ({SUMMARY_FILE} is there); no supervisor serves it"
            ) from None
        raise StatusUnavailableError(
            "not_started",
            f"no supervisor serves {run_dir} (no {SUPERVISOR_FILE}): the run has not started yet, or it ended without {SUMMARY_FILE}",
        ) from None
    except (OSError, ValueError, msgspec.DecodeError) as e:
        raise StatusUnavailableError("bad_file", f"cannot read {path}: {e}") from None
    if info.hostname != socket.gethostname():
        raise StatusUnavailableError(
            "other_host", f"the supervisor of {run_dir} runs on host {info.hostname} (pid {info.pid}); run `asyncrl status` there"
        )
    if not _same_process_alive(info.pid, info.pid_start_ticks):
        raise StatusUnavailableError(
            "stale",
            f"the supervisor is not running: pid {info.pid}, which wrote {path} at {_when(info.started_at)}, is gone "
            "(killed or crashed before it could remove the file); the file is stale",
        )
    if info.address.startswith("ipc://") and not os.path.exists(info.address[len("ipc://"):]):
        raise StatusUnavailableError(
            "stale", f"the supervisor (pid {info.pid}) no longer serves status: its socket {info.address} is gone"
        )
    return info


def query_status(run_dir: str, timeout_s: float = 5.0) -> StatusReply:
    """Ask the live supervisor of ``run_dir`` for its status, waiting at most ``timeout_s``."""
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
            sock.send(msgspec.msgpack.encode(StatusRequest()), zmq.NOBLOCK)
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
        answer = msgspec.msgpack.decode(frames[0], type=Union[StatusReply, StatusFailure])
    except (ValueError, msgspec.DecodeError) as e:
        raise StatusUnavailableError("protocol", f"undecodable answer from {who} (another asyncrl version?): {e}") from None
    if isinstance(answer, StatusFailure):
        raise StatusUnavailableError("refused", f"{who} refused the request: {answer.type_name}: {answer.message}")
    if answer.protocol != PROTOCOL:
        raise StatusUnavailableError("protocol", f"{who} speaks status protocol {answer.protocol}, this client {PROTOCOL}")
    return answer


# --- presentation ------------------------------------------------------------------------------


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _first_line(text: str | None, width: int = 72) -> str:
    if not text:
        return "-"
    line = text.strip().splitlines()[0] if text.strip() else "-"
    return line if len(line) <= width else line[: width - 3] + "..."


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_status(reply: StatusReply) -> str:
    """The human-readable view ``asyncrl status`` prints."""
    lines = [
        f"run         {reply.run_dir}",
        f"supervisor  pid {reply.pid} on {reply.hostname}, up {_duration(reply.uptime_s)} (since {_when(reply.started_at)})",
    ]
    for n in reply.nodes:
        lines.append(f"node {n.rank:<6} {n.hostname} {n.address}, devices {n.devices_free}/{n.devices_total} free, {n.state}")
    lines.append("")
    rows = [["ACTOR", "NODE", "STATE", "PID", "RESTARTS", "HEARTBEAT", "ERROR"]]
    for a in reply.actors:
        beat = f"{a.last_heartbeat_age_s:.1f}s ago" if a.last_heartbeat_age_s is not None else "-"
        rows.append([a.name, str(a.node), a.state, str(a.pid) if a.pid is not None else "-",
                     f"{a.restarts}/{a.max_restarts}", beat, _first_line(a.error)])
    lines += _table(rows) if reply.actors else ["(no actors)"]
    if reply.progress or reply.progress_error:
        lines += ["", "progress"]
        width = max((len(k) for k in reply.progress), default=0)
        lines += [f"  {k:<{width}}  {_value(k, v)}" for k, v in reply.progress.items()]
        if reply.progress_error:
            lines.append(f"  (progress unavailable: {reply.progress_error})")
    return "\n".join(lines)


def _value(key: str, v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and key.endswith("_at") and v > 0:
        return _when(v)  # a progress key named *_at holds a Unix time
    if isinstance(v, float):
        return f"{v:.4f}".rstrip("0").rstrip(".") if 1e-3 <= abs(v) < 1e15 else f"{v:.3g}"
    if isinstance(v, (dict, list)):
        return msgspec.json.encode(v).decode()
    return str(v)


def reply_json(reply: StatusReply) -> str:
    return msgspec.json.format(msgspec.json.encode(reply), indent=2).decode()
