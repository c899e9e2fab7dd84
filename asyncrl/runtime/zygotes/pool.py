"""Zygotes kept between the supervisors of one process.

A supervisor with a ``zygote_preload`` starts a zygote (``zygote.py``) and ends it when it closes: a
zygote's imports, seconds of CPU for a GRPO run's (docs/runtime.md), are paid once per supervisor.
A process that starts one supervisor after another (a test suite, a notebook, a sweep) can pay
them once instead: while a `ZygotePool` serves (``with ZygotePool(): ...``), a supervisor takes
an idle zygote of the pool that preloaded what it asks for, in an environment that agrees in what
imports read (`zygote.READ_AT_START`), or starts one into the pool; when it closes, its actors
stopped, it gives the zygote back. Closing the pool ends its zygotes.

A pooled zygote belongs to the pool, not to a supervisor: it is not among a supervisor's process
groups, and its own death pipe is the pool's. Each actor it forks still gets its supervisor's
death pipe and dies with that supervisor, as any forked actor does. One supervisor at a time uses
a zygote (two at once take two). A zygote that failed a start is ended rather than given back, and
so is the oldest idle one past `ZygotePool.max_idle`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from asyncrl.runtime.zygotes.zygote import ENV_PRELOAD, Zygote, read_at_start

_active: ZygotePool | None = None


def active_pool() -> ZygotePool | None:
    """The pool serving supervisors started now (None: each starts its own zygote)."""
    return _active


class ZygotePool:
    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        """Idle zygotes kept, of any keys; the oldest past it is ended (each holds its imports' memory)."""
        self._idle: list[tuple[tuple, Zygote]] = []  # oldest first
        self._busy: dict[Zygote, tuple] = {}  # in use, with the key it was asked for by
        self._death_r, self._death_w = os.pipe()  # EOF to every zygote of the pool when it closes
        self._closed = False

    def __enter__(self) -> ZygotePool:
        self._serving = self.serving()
        self._serving.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._serving.__exit__(None, None, None)
        self.close()

    @contextlib.contextmanager
    def serving(self) -> Iterator[ZygotePool]:
        """Supervisors started in this block take their zygotes from this pool, which stays open
        after it (`close` ends it)."""
        global _active
        if _active is not None:
            raise RuntimeError("a ZygotePool is serving already in this process")
        _active = self
        try:
            yield self
        finally:
            _active = None

    async def acquire(self, env: Mapping[str, str]) -> Zygote:
        """An idle zygote of ``env``'s preload (``ASYNCRL_ZYGOTE_PRELOAD``) and environment, now
        serving this loop, or a new one. Raises ``OSError`` where none can start."""
        if self._closed:
            raise OSError("the zygote pool is closed")
        key = _key(env)
        for i in reversed(range(len(self._idle))):
            if self._idle[i][0] != key:
                continue
            zygote = self._idle.pop(i)[1]
            if zygote.alive and zygote.proc.poll() is None:
                zygote.attach()
                self._busy[zygote] = key
                return zygote
            zygote.kill_now()
        zygote = await Zygote.start(dict(env), self._death_r)
        self._busy[zygote] = key
        return zygote

    def release(self, zygote: Zygote, reusable: bool = True) -> None:
        """``zygote`` back from its supervisor, whose actors are stopped: kept for the next where
        ``reusable`` and alive, else ended."""
        key = self._busy.pop(zygote, None)
        zygote.detach()
        if reusable and key is not None and not self._closed and zygote.alive and zygote.proc.poll() is None:
            self._idle.append((key, zygote))
        else:
            zygote.kill_now()
        while len(self._idle) > self.max_idle:
            self._idle.pop(0)[1].kill_now()

    @property
    def pids(self) -> set[int]:
        """The pool's zygotes' pids, idle or in use."""
        return {z.pid for z in self._busy} | {z.pid for _, z in self._idle}

    def close(self) -> None:
        """End every zygote of the pool (SIGKILL: an idle one holds nothing to flush; one in use
        takes its actors with it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for zygote in [*self._busy, *(z for _, z in self._idle)]:
            with contextlib.suppress(RuntimeError):  # killed first; its actors' futures may be of a closed loop
                zygote.kill_now()
        self._busy.clear()
        self._idle.clear()
        for fd in (self._death_r, self._death_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _key(env: Mapping[str, str]) -> tuple:
    """What two supervisors' zygotes must agree in to be one: the preload and what imports read."""
    return env.get(ENV_PRELOAD, ""), tuple(sorted(read_at_start(env).items()))
