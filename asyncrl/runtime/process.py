"""One child process: its own session and process group, an exit we can wait on, prefixed logs.

Exit is observed through a pidfd registered with the event loop, so a crash is seen the moment it
happens, not at the next poll. The child's stdout and stderr are pumped line by line to ours with
a ``[name]:`` prefix (as torchrun does with ``[rank0]:``), or handed to a ``sink`` (a node agent
forwards them to the supervisor). Stopping escalates: the caller's graceful
step, then SIGTERM to the whole process group, then SIGKILL to it, each with a bounded wait, so
grandchildren (a vLLM engine, a data loader) go too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from asyncrl.runtime.timeouts import timeout

LogSink = Callable[[int, list[bytes]], None]
"""``sink(stream, lines)``: ``stream`` is 1 for stdout, 2 for stderr; lines without their newline."""
MAX_LINE_BYTES = 1 << 20
"""A longer run of output without a newline is passed on as one line, so buffering stays bounded."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class ActorProcess:
    """An actor's process as its supervisor sees it, wherever it runs: an ``exited`` future that
    is done once the process is gone, a bounded wait on it, and the ways to end it. A local
    ``ChildProcess`` below; one on another node is a ``cluster.RemoteProcess``."""

    pid: int
    exited: asyncio.Future

    @property
    def alive(self) -> bool:
        return not self.exited.done()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the exit; True if it exited. A cancel of the caller leaves
        ``exited`` untouched (shielded), for the next waiter."""
        try:
            async with timeout(timeout_s):  # wait_for on 3.11 can swallow a cancel
                await asyncio.shield(self.exited)
            return True
        except TimeoutError:
            return False

    def exit_description(self) -> str:
        """How it ended ("killed by SIGKILL", "exited with code 1", "node 1 lost: ..."); only
        once ``exited`` is done."""
        raise NotImplementedError

    async def terminate(self, term_timeout_s: float, kill_timeout_s: float) -> int | None:
        """SIGTERM the process group, wait up to ``term_timeout_s``, then SIGKILL it and wait up
        to ``kill_timeout_s``; the exit code where one is known."""
        raise NotImplementedError

    def kill_now(self) -> None:
        """SIGKILL the process group now, without waiting (finalizers, a second Ctrl-C, a kill
        on request)."""
        raise NotImplementedError


_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-spawn")
"""The thread `ChildProcess.start` forks on, alive as long as this process. A worker's
``PR_SET_PDEATHSIG`` (runtime/worker.py) fires when the *thread* that forked it ends, not the
process: forked from a thread that ends with the event loop's default executor (its threads end
when the loop closes), a child would be signalled while its supervisor lives on."""


def _popen(argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int]) -> subprocess.Popen:
    return subprocess.Popen(
        list(argv),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # own process group: one killpg reaches every descendant
        pass_fds=tuple(pass_fds),
    )


def _kill_started(popen: asyncio.Future) -> None:
    """A start cancelled while ``Popen`` ran on its thread: the process it made is killed (its group)."""
    if not popen.cancelled() and popen.exception() is None:
        proc = popen.result()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()


class ChildProcess(ActorProcess):
    """A child process (``argv``, ``env``) in its own session; use `start` from an event loop. The
    constructor starts it on the caller's thread (``Popen`` blocks for the fork and exec)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        log_prefix: str,
        pass_fds: Sequence[int] = (),
        sink: LogSink | None = None,
        *,
        popen: subprocess.Popen | None = None,
    ):
        self.proc = popen if popen is not None else _popen(argv, env, pass_fds)
        self._init(self.proc.pid, self.proc.stdout, self.proc.stderr, log_prefix, sink)

    def _init(self, pid: int, stdout, stderr, log_prefix: str, sink: LogSink | None) -> None:
        """What every child of ours has, however it was started (`Popen`, or a zygote's fork):
        ``exited``, its exit watched (`_watch_exit`), its pipes pumped."""
        self.log_prefix = log_prefix
        self.pid = pid
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self._watch_exit()
        if sink is None:
            emit = [
                functools.partial(write_lines, sys.stdout, log_prefix),
                functools.partial(write_lines, sys.stderr, log_prefix),
            ]
        else:
            emit = [functools.partial(sink, 1), functools.partial(sink, 2)]
        self._pumps = [
            asyncio.ensure_future(_pump(loop, stdout, emit[0])),
            asyncio.ensure_future(_pump(loop, stderr, emit[1])),
        ]

    def _watch_exit(self) -> None:
        self._pidfd = os.pidfd_open(self.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        env: dict[str, str],
        log_prefix: str,
        pass_fds: Sequence[int] = (),
        sink: LogSink | None = None,
    ) -> ChildProcess:
        """The constructor's process, with ``Popen`` on a thread: a fork and exec take a fraction
        of a second, seconds on a loaded host (times the samplers of a scale-up), and the event
        loop runs on meanwhile. A cancel while it runs kills the process it made. Raises what
        ``Popen`` raises (``OSError``)."""
        loop = asyncio.get_running_loop()
        popen = asyncio.ensure_future(loop.run_in_executor(_SPAWNER, _popen, argv, env, pass_fds))
        try:
            proc = await asyncio.shield(popen)
        except asyncio.CancelledError:
            popen.add_done_callback(_kill_started)
            raise
        return cls(argv, env, log_prefix, pass_fds, sink, popen=proc)

    def _on_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        returncode = self.proc.wait()
        if not self.exited.done():
            self.exited.set_result(returncode)

    def exit_description(self) -> str:
        return describe_exit(self.exited.result())

    def signal_group(self, sig: int) -> None:
        """Signal the child's process group (it leads one: pgid == pid). Once the leader is reaped
        its pid cannot be reused while any member of the group is alive, so this never hits a
        stranger; an empty group is simply gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def terminate(self, term_timeout_s: float, kill_timeout_s: float) -> int | None:
        """SIGTERM the group, wait, SIGKILL the group, wait. Also sweeps grandchildren left
        behind by a leader that exited on its own."""
        if self.alive:
            self.signal_group(signal.SIGTERM)
            if not await self.wait(term_timeout_s):
                self.signal_group(signal.SIGKILL)
                await self.wait(kill_timeout_s)
        self.signal_group(signal.SIGKILL)
        await self.close_logs()
        return self.exited.result() if self.exited.done() else None

    async def close_logs(self, timeout_s: float = 1.0) -> None:
        """Let the log pumps drain what the child wrote, then stop them."""
        _, pending = await asyncio.wait(self._pumps, timeout=timeout_s)
        for p in pending:
            p.cancel()

    def kill_now(self) -> None:
        """Synchronous last resort (finalizers, a second Ctrl-C): SIGKILL the group."""
        self.signal_group(signal.SIGKILL)


async def _pump(loop: asyncio.AbstractEventLoop, pipe, emit: Callable[[list[bytes]], None]) -> None:
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    pending = b""
    try:
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_LINE_BYTES:
                lines.append(pending)
                pending = b""
            if lines:
                emit(lines)
        if pending:
            emit([pending])
    finally:
        transport.close()


def write_lines(out, prefix: str, lines: list[bytes] | list[str]) -> None:
    text = "".join(f"{prefix}{line if isinstance(line, str) else line.decode('utf-8', 'replace')}\n" for line in lines)
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass  # our own stdout is gone; the child's output has nowhere to go
