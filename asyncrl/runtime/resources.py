"""What a supervisor holds on its host, with one owner and one idempotent ``close()``.

``SupervisorResources`` owns the ZeroMQ context (and the CURVE gatekeeper whose thread uses it),
the private run directory of ipc socket files, the death pipe whose read end every child inherits
(its EOF tells a child we died, see ``worker.py``), and the set of process groups we started.

Invariant: from the moment the run directory exists, something removes it and SIGKILLs every
tracked group, whichever way this process ends: ``close()``; the ``weakref.finalize`` when the
owner is dropped or the interpreter exits without it; the ``signals.on_force_exit`` hook when a
second Ctrl-C ends the process at once (``os._exit`` runs no finalizer). Only a SIGKILL of this
process escapes all three; the next supervisor on the host sweeps what that leaves
(``transport.remove_stale_run_dirs``), and the children notice by the death pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import weakref

import zmq

from asyncrl.runtime import signals
from asyncrl.runtime.cluster import auth
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.transport import make_run_dir, remove_run_dir


def cluster_keys(cfg: SupervisorConfig) -> auth.ClusterKeys | None:
    """Keys for TCP sockets: the configured cluster secret; on one host, a fresh one if none is
    set (our children get it from us). None when nothing of ours speaks TCP."""
    if cfg.transport != "tcp" and cfg.nnodes == 1:
        return None
    secret = auth.load_secret()
    if secret is None:
        if cfg.nnodes > 1:
            raise ValueError(
                f"a cluster of {cfg.nnodes} nodes needs a cluster secret: set {auth.ENV_SECRET_FILE} "
                f"(or {auth.ENV_SECRET}) to the same secret on every node; `asyncrl secret PATH` makes one"
            )
        secret = auth.new_secret()
    return auth.ClusterKeys.from_secret(secret)


def kill_groups(groups: set[int]) -> None:
    """SIGKILL each process group in ``groups`` and forget them all."""
    for pgid in list(groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    groups.clear()


def _emergency_cleanup(groups: set[int], run_dir: str, fds: list[int]) -> None:
    kill_groups(groups)
    remove_run_dir(run_dir)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SupervisorResources:
    """The context, gatekeeper, run directory, death pipe and process groups of one supervisor.
    A constructor that fails half-way releases what it made before raising."""

    def __init__(self, keys: auth.ClusterKeys | None) -> None:
        self.keys = keys
        self.groups: set[int] = set()
        """Process groups we started and have not yet seen empty (each led by its actor)."""
        self.gate: auth.Gatekeeper | None = None
        self.ctx: zmq.Context | None = None
        self.run_dir = make_run_dir()
        self._closed = False
        try:
            # Children inherit the read end; only we hold the write end.
            self.death_r, self.death_w = os.pipe()
        except BaseException:
            remove_run_dir(self.run_dir)
            raise
        self._finalizer = weakref.finalize(
            self, _emergency_cleanup, self.groups, self.run_dir, [self.death_r, self.death_w]
        )
        self._hooks = contextlib.ExitStack()
        try:
            self._hooks.enter_context(signals.on_force_exit(self._finalizer))
            self.ctx = zmq.Context()
            if keys is not None:  # before any bind: without it no TCP peer is admitted
                self.gate = auth.Gatekeeper(self.ctx, keys, "supervisor")
        except BaseException:
            self.close()
            raise

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context the constructor made (``ctx`` is None only before that, or once closed)."""
        if self.ctx is None:
            raise RuntimeError("the supervisor's resources are closed")
        return self.ctx

    @property
    def rejected(self) -> int:
        """Connections refused by authentication so far (0 when nothing listens on TCP)."""
        return self.gate.rejected if self.gate is not None else 0

    def kill_groups(self) -> None:
        """SIGKILL every tracked process group now (a second Ctrl-C while closing)."""
        kill_groups(self.groups)

    def close(self) -> None:
        """Stop the gatekeeper, destroy the context (closing any socket left on it), SIGKILL every
        group still tracked, remove the run directory, close the pipe. Idempotent. Close the
        sockets driven by the event loop first (``LoopSocket.close``)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.gate is not None:
                self.gate.close()  # its thread owns sockets of this context: stop it before destroy
            if self.ctx is not None:
                self.ctx.destroy(0)
        finally:
            self._finalizer()
            self._hooks.close()
