"""A zygote: one process that imports the actors' heavy modules once, then forks each actor (the protocol and
the supervisor's side here; the zygote process's own code in ``serve.py``).

An actor started by ``Popen`` is a fresh interpreter that imports torch and transformers again:
seconds of CPU each (docs/runtime.md has the figures), most of a tiny run's time. The zygote pays that
once, when the supervisor starts, and forks a child per request, so a start costs a fork.

Protocol (one ``SOCK_SEQPACKET`` socketpair, msgpack, no pickle): the supervisor sends `Spawn`
(env, cwd, the fd numbers the child is to have; no code or argv: a child only ever runs the
worker's entry point) with the file descriptors attached by ``socket.send_fds`` (the write ends
of the child's stdout and stderr pipes, then ``pass_fds``);
the zygote answers `Started` with the child's pid, and later `Exited` with its return code
(negative: killed by that signal, as ``subprocess``), since the zygote is the child's parent and
reaps it. `Ready` says the preloading is done.

The child: its own session (``setsid``, as ``Popen(start_new_session=True)``), the sent fds on
1, 2 and their numbers, stdin on /dev/null, the zygote's socket and pipes closed, ``os.environ``
replaced by the request's (and shown as its ``/proc/PID/environ``: titles.py), what was read from
the environment at import set again (`_reset_child`); then it returns out of the serve loop and
runs `asyncrl.runtime.worker.main` (which titles it, as a Popen'd actor), ending through a normal
interpreter shutdown, so buffered files get flushed.

Parent death, as ``runtime/worker.py``: the zygote dies with its supervisor (``PR_SET_PDEATHSIG``, the
parent-pid check, and the supervisor's death pipe, polled in the serve loop rather than on a
thread: the zygote forks, and a fork of a threaded process is unsafe); a child's
``ASYNCRL_PARENT_PID`` is the zygote, so a child dies with the zygote, and with the supervisor by
the death pipe it inherits. If the zygote dies, the supervisor's end of the socket sees EOF: its
live children are lost (`ZygoteProcess.lost`), and later starts go through ``Popen``.

Only where no accelerator is visible (`usable`): CUDA reads ``CUDA_VISIBLE_DEVICES`` at
``cuInit``, and a process forked after ``cuInit`` cannot use CUDA; the zygote never touches a
device, but whether every import leaves CUDA alone (and every child's visibility is applied
before its first CUDA call) is unproven, so GPU hosts keep ``Popen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import msgspec

from asyncrl.runtime.process import ChildProcess, LogSink, describe_exit
from asyncrl.runtime.timeouts import timeout

log = logging.getLogger("asyncrl.supervisor")

ENV_ZYGOTE = "ASYNCRL_ZYGOTE"
"""``0`` turns the zygote off (every actor by ``Popen``); anything else, or unset: on where `usable`."""
ENV_PRELOAD = "ASYNCRL_ZYGOTE_PRELOAD"
"""Comma-separated modules the zygote imports before it forks (the supervisor's
``zygote_preload``); unset: `PRELOAD`."""
ENV_SOCKET_FD = "ASYNCRL_ZYGOTE_FD"
PRELOAD = (
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "asyncrl.runtime.worker",
    "asyncrl.rl.trainer.actor",
    "asyncrl.rl.sampler.actor",
    "asyncrl.rl.scorer.actor",
)
"""What the actors of a GRPO run import (rl/driver/spawn.py spawns these classes): the preload
of a GRPO run's supervisor (rl/launch.py)."""
READ_AT_START = (
    *("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_"),
    *("MKL_", "OPENBLAS_", "OMP_", "KMP_", "GOMP_"),
    *("PYTHON", "LD_"),
)
"""Prefixes of variables read before a fork, by the preloaded modules at import (huggingface_hub's
``HF_HUB_OFFLINE`` and ``HF_HOME``, torch's ``TORCH_*``, the BLAS and OpenMP runtimes' when torch
loads them), by the interpreter at its start (``PYTHONHASHSEED``, ``PYTHONPATH``) or by the
dynamic linker (``LD_PRELOAD``): an actor whose environment differs from the zygote's in one of
them starts by ``Popen`` (`Zygote.unsuitable`). Not those the child sets again itself
(`_SET_AGAIN`, `_reset_child`)."""
_SET_AGAIN = frozenset({"OMP_NUM_THREADS"})
READY_TIMEOUT_S = 60.0
"""How long a spawn waits for the zygote to finish preloading before it uses ``Popen``."""
ANSWER_TIMEOUT_S = 10.0
"""How long a spawn waits for the zygote's `Started`."""
MAX_MESSAGE = 1 << 20
MAX_FDS = 16


class Spawn(msgspec.Struct, tag=True):
    """Fork an actor: its process runs `asyncrl.runtime.worker.main`, nothing named by the
    request (no code crosses the socket)."""

    id: int
    env: dict[str, str]
    cwd: str
    fds: list[int]
    """The numbers the attached fds get in the child, in order: 1, 2, then the ``pass_fds``."""


class Ready(msgspec.Struct, tag=True):
    pid: int
    preloaded: list[str]
    failed: list[str]


class Started(msgspec.Struct, tag=True):
    id: int
    pid: int = 0
    error: str = ""


class Exited(msgspec.Struct, tag=True):
    pid: int
    returncode: int


ToZygote = Spawn
FromZygote = Ready | Started | Exited


def read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a zygote and the actors it forks must agree in (`READ_AT_START`)."""
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in _SET_AGAIN}


class ZygoteUnavailable(Exception):
    """The zygote cannot start this actor (not ready in time, gone, or it failed the fork): the
    caller starts it by ``Popen``."""


def usable(device_total: int) -> bool:
    """Whether a supervisor on a host with ``device_total`` accelerator devices may use a zygote
    (where its ``zygote_preload`` asks for one)."""
    return os.environ.get(ENV_ZYGOTE, "1") != "0" and device_total == 0


# --- the supervisor's side ------------------------------------------------------------------


class ZygoteProcess(ChildProcess):
    """An actor forked by the zygote: a `ChildProcess` whose exit comes from the zygote's
    `Exited` (it is the zygote's child, not ours: no pidfd, which would race the zygote's
    reaping), or from the zygote's loss."""

    def __init__(self, pid: int, stdout, stderr, log_prefix: str, sink: LogSink | None):
        self._lost = ""
        self._init(pid, stdout, stderr, log_prefix, sink)

    def _watch_exit(self) -> None:
        pass  # `Zygote` sets ``exited``

    def lost(self, reason: str) -> None:
        """The zygote died: this process dies by its parent-death signal; made sure of here."""
        if not self.exited.done():
            self._lost = reason
            self.signal_group(signal.SIGKILL)
            self.exited.set_result(-signal.SIGKILL)

    def exit_description(self) -> str:
        return self._lost or describe_exit(self.exited.result())


class Zygote:
    """The supervisor's handle on its zygote: `start` it, `spawn` through it, `close` it."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, env: dict[str, str] | None = None):
        self.proc = proc
        self.env = env or {}
        self.pid = proc.pid
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[Ready] = self._loop.create_future()
        self.error = ""
        self._ids = 0
        self._answers: dict[int, asyncio.Future[Started]] = {}
        self._children: dict[int, ZygoteProcess] = {}
        self._starting: set[int] = set()  # pids told in a `Started` whose process is not made yet
        self._early: dict[int, int] = {}  # exits of those, seen before their process was made
        self._decoder = msgspec.msgpack.Decoder(FromZygote)
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self._started_at = time.monotonic()
        self._eof: asyncio.Future | None = None

    @classmethod
    async def start(cls, env: dict[str, str], death_r: int) -> Zygote:
        """Popen the zygote on the spawner thread (its parent-death signal follows that thread,
        see ``runtime/process.py``). Raises ``OSError``."""
        from asyncrl.runtime import titles
        from asyncrl.runtime import worker as worker_env
        from asyncrl.runtime.process import _SPAWNER

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            **env,
            "PYTHONUNBUFFERED": "1",
            ENV_SOCKET_FD: str(theirs.fileno()),
            worker_env.ENV_PARENT_PID: str(os.getpid()),
            worker_env.ENV_DEATH_FD: str(death_r),
            titles.ENV_ROOM: "." * titles.ROOM_BYTES,  # where a forked actor's own environment is shown
        }

        def popen() -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-c", "from asyncrl.runtime.zygotes.serve import main; main()"],
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(theirs.fileno(), death_r),
            )

        try:
            proc = await asyncio.get_running_loop().run_in_executor(_SPAWNER, popen)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours, env)

    @property
    def alive(self) -> bool:
        return not self.error

    def unsuitable(self, env: dict[str, str]) -> str:
        """Why a child with ``env`` would not be what ``Popen`` makes ("" if it would): a variable
        that a preloaded module read at import differs from the zygote's."""
        theirs, ours = read_at_start(env), read_at_start(self.env)
        differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
        return f"its environment differs from the zygote's in {', '.join(differ)}, read before a fork" if differ else ""

    def attach(self) -> None:
        """Serve the running loop from now on: a pooled zygote (``pool.py``) goes from one
        supervisor, and its loop, to the next. What arrived meanwhile waits in the socket."""
        if self.error:
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            ready = loop.create_future()
            if self.ready.done():  # with its `Ready`: an exception comes with an error, returned on above
                ready.set_result(self.ready.result())
            self._loop, self.ready = loop, ready
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def detach(self) -> None:
        """Stop serving its supervisor, whose actors are stopped (or killed by their groups): their
        exits, when they come, are nobody's."""
        self._stop_reading()
        self._children.clear()
        self._starting.clear()
        self._early.clear()

    def _stop_reading(self) -> None:
        if self._sock.fileno() >= 0:
            with contextlib.suppress(RuntimeError, AttributeError, ValueError):  # its loop closed
                self._loop.remove_reader(self._sock.fileno())

    def _on_readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError as e:
                self._lose(f"its socket failed: {e}")
                return
            if not data:
                self._stop_reading()
                self._eof = asyncio.ensure_future(self._on_eof())
                return
            msg = self._decoder.decode(data)
            if isinstance(msg, Ready):
                if not self.ready.done():
                    self.ready.set_result(msg)
                    took = time.monotonic() - self._started_at
                    extra = f"; could not import {msg.failed}" if msg.failed else ""
                    log.debug("zygote pid %d ready in %.1f s%s", self.pid, took, extra)
            elif isinstance(msg, Started):
                answer = self._answers.pop(msg.id, None)
                if answer is not None and not answer.done():
                    if msg.pid:
                        self._starting.add(msg.pid)
                    answer.set_result(msg)
                elif msg.pid:  # its spawn gave up waiting: the child is nobody's
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(msg.pid, signal.SIGKILL)  # its group: it leads one already
            else:
                child = self._children.pop(msg.pid, None)
                if child is None:
                    if msg.pid in self._starting:  # else nobody's: its start gave up, or an earlier supervisor's
                        self._early[msg.pid] = msg.returncode
                elif not child.exited.done():
                    child.exited.set_result(msg.returncode)

    async def _on_eof(self) -> None:
        """The zygote closed its socket: it is exiting. Its exit status, within a second, says how."""
        deadline = time.monotonic() + 1.0
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        code = self.proc.poll()
        how = describe_exit(code) if code is not None else "closed its socket"
        self._lose(f"the zygote (pid {self.pid}) {how}")

    def _lose(self, reason: str, closed: bool = False) -> None:
        if self.error:
            return
        self.error = reason
        self._stop_reading()
        self._sock.close()
        lost = f"lost: {reason} (actors forked by the zygote die with it)"
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(ZygoteUnavailable(reason))
        self._answers.clear()
        if not self.ready.done():
            self.ready.set_exception(ZygoteUnavailable(reason))
            self.ready.exception()  # retrieved: nobody may be waiting
        for child in self._children.values():
            child.lost(lost)
        if not closed:
            log.error(
                "zygote pid %d is gone (%s): %d actor process(es) lost; later actors start by Popen",
                self.pid,
                reason,
                len(self._children),
            )
        self._children.clear()

    async def spawn(
        self,
        env: dict[str, str],
        log_prefix: str,
        pass_fds: Sequence[int] = (),
        sink: LogSink | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> ZygoteProcess:
        """Fork an actor's process (`asyncrl.runtime.worker.main`, as a Popen'd one runs it) with
        ``env``; raises
        `ZygoteUnavailable` when the zygote is not ready within ``ready_timeout_s``, is gone,
        or does not answer within `ANSWER_TIMEOUT_S`."""
        if self.error:
            raise ZygoteUnavailable(self.error)
        if not self.ready.done():
            try:
                async with timeout(ready_timeout_s):  # wait_for on 3.11 can swallow a cancel
                    await asyncio.shield(self.ready)
            except TimeoutError:
                raise ZygoteUnavailable(
                    f"the zygote (pid {self.pid}) was not ready within {ready_timeout_s:g} s"
                ) from None
        if self.error:
            raise ZygoteUnavailable(self.error)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._ids += 1
        req_id = self._ids
        answer = self._answers[req_id] = self._loop.create_future()
        try:
            msg = msgspec.msgpack.encode(Spawn(req_id, env, os.getcwd(), [1, 2, *pass_fds]))
            try:
                socket.send_fds(self._sock, [msg], [out_w, err_w, *pass_fds])
            except OSError as e:  # a full buffer too: the zygote is not keeping up
                raise ZygoteUnavailable(f"cannot send to the zygote (pid {self.pid}): {e}") from e
            finally:
                os.close(out_w)
                os.close(err_w)
            try:
                async with timeout(ANSWER_TIMEOUT_S):
                    started = await asyncio.shield(answer)
            except TimeoutError:
                raise ZygoteUnavailable(
                    f"no answer from the zygote (pid {self.pid}) to the start of {log_prefix.strip()} "
                    f"within {ANSWER_TIMEOUT_S:g} s"
                ) from None
        except BaseException:
            self._answers.pop(req_id, None)
            os.close(out_r)
            os.close(err_r)
            raise
        if started.error:
            os.close(out_r)
            os.close(err_r)
            raise ZygoteUnavailable(f"the zygote (pid {self.pid}): {started.error}")
        child = ZygoteProcess(
            started.pid, open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0), log_prefix, sink
        )
        self._starting.discard(started.pid)
        code = self._early.pop(started.pid, None)
        if code is not None:
            child.exited.set_result(code)
        elif self.error:
            child.lost(f"lost: {self.error}")
        else:
            self._children[started.pid] = child
        return child

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close our end (the zygote exits on EOF), wait up to ``timeout_s``, then SIGKILL it."""
        self._lose("the supervisor closed it", closed=True)
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.kill_now()

    def kill_now(self) -> None:
        """SIGKILL the zygote (and its group) and reap it if it is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)
        if self._eof is not None:
            self._eof.cancel()
        self._lose("the supervisor killed it", closed=True)
