"""The zygote process itself (`asyncrl.runtime.zygotes.zygote` has the protocol and the supervisor's side):
preload, serve `Spawn` requests, fork, and in the child set up what ``Popen`` would have given
before running the worker's entry point.

Started as ``python -c "from asyncrl.runtime.zygotes.serve import main; main()"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import gc
import importlib
import os
import random
import select
import signal
import socket
import sys
import tempfile
from typing import Any

import msgspec

from asyncrl.runtime import titles
from asyncrl.runtime.zygotes.zygote import (
    ENV_PRELOAD,
    ENV_SOCKET_FD,
    MAX_FDS,
    MAX_MESSAGE,
    PRELOAD,
    Exited,
    Ready,
    Spawn,
    Started,
    ToZygote,
)


def _returncode(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def _arm_parent_death(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _serve(sock: socket.socket, death_fd: int) -> tuple[Spawn, list[int]] | None:
    """Answer requests until a fork: in the child, the request and its received fds; in the
    zygote, None once the supervisor is gone (EOF on the socket or the death pipe)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    decoder = msgspec.msgpack.Decoder(ToZygote)
    encode = msgspec.msgpack.encode
    poller = select.poll()
    for fd in (sock.fileno(), death_fd, wake_r):
        poller.register(fd, select.POLLIN)
    warned_threads = False
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    while True:
                        try:
                            pid, status = os.waitpid(-1, os.WNOHANG)
                        except ChildProcessError:
                            break
                        if pid == 0:
                            break
                        sock.send(encode(Exited(pid, _returncode(status))))
                elif fd == death_fd:
                    if not os.read(death_fd, 1):
                        return None
                else:
                    try:
                        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
                    except ConnectionResetError:
                        return None
                    if not data:
                        return None
                    req = decoder.decode(data)
                    threads = len(os.listdir("/proc/self/task"))
                    if threads > 1 and not warned_threads:  # BLAS pools (OpenBLAS) shut down at fork
                        warned_threads = True
                        print(f"asyncrl zygote: {threads} threads at fork", file=sys.stderr, flush=True)
                    # The child's session exists before its pid is told: a killpg of it right
                    # after `Started` (a start cancelled, a stop) must reach it.
                    session_r, session_w = os.pipe()
                    try:
                        pid = os.fork()
                    except OSError as e:
                        for f in (*fds, session_r, session_w):
                            os.close(f)
                        sock.send(encode(Started(req.id, error=f"fork failed: {e}")))
                        continue
                    if pid == 0:
                        os.setsid()  # its own session and group, as Popen(start_new_session=True)
                        os.close(session_w)
                        os.close(session_r)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.close(wake_r)
                        os.close(wake_w)
                        return req, fds
                    os.close(session_w)
                    os.read(session_r, 1)  # EOF once the child has its session (or is gone)
                    os.close(session_r)
                    for f in fds:
                        os.close(f)
                    sock.send(encode(Started(req.id, pid)))
    except (BrokenPipeError, ConnectionResetError):
        return None


def _place_fds(received: list[int], targets: list[int]) -> None:
    """Give the child's fds their numbers: received[i] becomes targets[i] (inheritable)."""
    above = max([*targets, *received]) + 1
    moved = [fcntl.fcntl(f, fcntl.F_DUPFD, above) for f in received]  # clear of every target number
    for f in received:
        os.close(f)
    for f, target in zip(moved, targets):
        if f != target:
            os.dup2(f, target, inheritable=True)
            os.close(f)
        else:
            os.set_inheritable(f, True)


def _reset_child(env: dict[str, str]) -> None:
    """What a fresh interpreter reads from its environment at start or import, set again from
    the request's: the environment itself, the temporary directory, torch's intra-op threads, the
    random seeds."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the zygote's, cached from its own TMPDIR: read from the request's again
    random.seed()  # os.fork reseeds it too; explicit, as numpy's below is not
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    _reset_tqdm()
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = env.get("OMP_NUM_THREADS", "")
        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(int(threads) if threads else max(1, os.cpu_count() or 1))


def _reset_tqdm() -> None:
    """tqdm reads its ``TQDM_*`` defaults (``TQDM_DISABLE``, which a GRPO run gives its actors)
    when ``tqdm.std`` is imported (``envwrap`` on ``tqdm.__init__``): read them again."""
    std: Any = sys.modules.get("tqdm.std")
    utils: Any = sys.modules.get("tqdm.utils")
    if std is None or utils is None or not hasattr(utils, "envwrap"):
        return
    init = std.tqdm.__dict__.get("__init__")
    if not isinstance(init, functools.partialmethod):
        return
    types = {"total": float, "ncols": int, "miniters": float, "position": int, "nrows": int}  # as tqdm.std's
    std.tqdm.__init__ = utils.envwrap("tqdm", is_method=True, types=types)(init.func)


def main() -> None:
    """The zygote's entry point (``python -c "from asyncrl.runtime.zygotes.zygote import main; main()"``)."""
    from asyncrl.runtime import worker as worker_env

    parent_pid = int(os.environ[worker_env.ENV_PARENT_PID])
    death_fd = int(os.environ[worker_env.ENV_DEATH_FD])
    _arm_parent_death(parent_pid)
    titles.set_title("zygote")  # first: setproctitle finds the command line through the environment block
    os.environ.pop(titles.ENV_ROOM, None)
    titles.own_environ()  # before the preload: no module keeps a pointer into what children overwrite
    sock = socket.socket(fileno=int(os.environ.pop(ENV_SOCKET_FD)))
    names = os.environ.get(ENV_PRELOAD)
    modules = [m.strip() for m in names.split(",") if m.strip()] if names is not None else list(PRELOAD)
    done, failed = [], []
    for m in modules:
        try:
            importlib.import_module(m)
            done.append(m)
        except Exception as e:  # the actor that needs it will say so, in its own start
            failed.append(f"{m}: {type(e).__name__}: {e}")
    sys.stdout.flush()
    sys.stderr.flush()
    # What the imports made lives as long as every child: out of the collector's reach, so no
    # collection touches (and copies) the shared pages, and a child's exit does not walk them
    # (2.0 s down to 0.5 s for an interpreter with torch and transformers on a 2-core host).
    gc.freeze()
    try:
        sock.send(msgspec.msgpack.encode(Ready(os.getpid(), done, failed)))
    except OSError:
        os._exit(0)
    child = _serve(sock, death_fd)
    if child is None:
        # The supervisor is gone or closed us; our children die by their parent-death signal.
        # Nothing of ours to flush, and a finalization with torch loaded takes seconds.
        os._exit(0)
    req, fds = child
    sock.close()
    targets = list(req.fds)
    _place_fds(fds, targets)
    if death_fd not in targets:
        os.close(death_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _reset_child(req.env)
    titles.show_environ(req.env)  # /proc/PID/environ: the actor's, as Popen would have made it
    with contextlib.suppress(OSError):
        os.chdir(req.cwd)
    sys.argv = ["-c"]  # as a Popen'd worker's (``python -c ...``, runtime/incarnations.py)
    from asyncrl.runtime.worker import main as worker_main

    worker_main()  # ends by sys.exit: a normal interpreter shutdown
