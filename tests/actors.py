"""Actor classes used by the tests (a module of their own, so actor processes can import them)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator

import msgspec

from asyncrl import Actor, endpoint, start_phase


class Point(msgspec.Struct):
    x: int
    y: int


class Echo(Actor):
    def __init__(self, offset: int = 0, label: str = "echo"):
        self.offset = offset
        self.label = label
        self.cancelled = 0
        self.produced = 0

    @endpoint
    async def add(self, x: int, y: int = 1) -> int:
        return x + y + self.offset

    @endpoint
    async def scale(self, p: Point, *, factor: int = 2) -> Point:
        return Point(p.x * factor, p.y * factor)

    @endpoint
    async def anything(self, value):
        return value

    @endpoint
    def sync_add(self, x: int) -> int:
        return x + self.offset

    @endpoint
    async def get_label(self) -> str:
        return self.label

    @endpoint
    async def getpid(self) -> int:
        return os.getpid()

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def fail_custom(self) -> None:
        raise _Custom("custom failure")

    @endpoint
    async def sleep(self, seconds: float) -> float:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return seconds

    @endpoint
    async def cancelled_count(self) -> int:
        return self.cancelled

    @endpoint
    async def count(self, n: int, delay_s: float = 0.0) -> AsyncIterator[int]:
        for i in range(n):
            self.produced = i + 1
            if delay_s:
                await asyncio.sleep(delay_s)
            yield i

    @endpoint
    async def produced_count(self) -> int:
        return self.produced

    @endpoint
    async def stream_then_fail(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise RuntimeError("stream broke")

    @endpoint
    async def big(self, n: int) -> bytes:
        return b"x" * n

    @endpoint
    async def wrong_return(self) -> int:
        return "not an int"  # type: ignore[return-value]

    @endpoint
    async def unsendable(self) -> object:
        return object()

    @endpoint
    async def env(self, key: str) -> str:
        return os.environ.get(key, "<unset>")

    @endpoint
    async def sys_path(self) -> list[str]:
        return list(sys.path)

    @endpoint
    async def spawn_grandchild(self) -> int:
        return subprocess.Popen(["sleep", "300"]).pid

    @endpoint
    def block(self, seconds: float) -> None:
        time.sleep(seconds)  # holds the actor's loop; heartbeats come from a thread

    @endpoint
    async def say(self, text: str) -> None:
        print(text, flush=True)

    @endpoint
    def say_then_block(self, text: str, seconds: float) -> None:
        print(text, flush=True)  # tells a test watching the output that the loop is now held
        time.sleep(seconds)


class _Custom(Exception):
    pass


class FailsInInit(Actor):
    def __init__(self, why: str):
        raise RuntimeError(f"constructor refuses: {why}")


class ExitsInInit(Actor):
    def __init__(self):
        os._exit(7)


class SlowStart(Actor):
    async def on_start(self) -> None:
        await asyncio.sleep(30)


class PhasedStart(Actor):
    """Takes ``seconds`` to build, holding its loop as a synchronous model load does, after
    reporting (when ``budget_s`` is set) a start phase with that budget, from its own thread or
    from another (``from_thread``), as an engine built in a thread would."""

    def __init__(self, seconds: float, budget_s: float = 0.0, from_thread: bool = False):
        if budget_s:
            report = functools.partial(start_phase, "loading the model", budget_s, "--test.load_timeout_s")
            if from_thread:
                thread = threading.Thread(target=report)
                thread.start()
                thread.join()
            else:
                report()
        time.sleep(seconds)

    @endpoint
    async def getpid(self) -> int:
        return os.getpid()


class FreezesInStart(Actor):
    """Stops itself (SIGSTOP) in its constructor: its heartbeats stop with it."""

    def __init__(self):
        start_phase("about to freeze", budget_s=60)
        time.sleep(0.5)  # the report goes out first
        os.kill(os.getpid(), signal.SIGSTOP)


class RaisesOurs(Actor):
    """Raises one of asyncrl's own errors, picked by ``kind`` from a fixed table: from
    ``raise_error``, or from ``train_step`` when built with a ``kind`` (a trainer rank that fails)."""

    def __init__(self, kind: str = ""):
        self.kind = kind

    @staticmethod
    def _error(kind: str) -> Exception:
        from asyncrl.comm.errors import RendezvousTimeoutError
        from asyncrl.errors import ActorDiedError
        from asyncrl.rl.checkpoint import CheckpointWriteError
        from asyncrl.rl.sampler.errors import SamplerTimeoutError
        from asyncrl.rl.tasks.scoring import TaskFailureError
        from asyncrl.rl.trainer.errors import PeerRankFailedError

        return {
            "checkpoint_write": CheckpointWriteError("cannot write /run/checkpoints/step-2: No space left on device"),
            "task_failure": TaskFailureError("task 'countdown': 9 of 10 score calls raised"),
            "sampler_timeout": SamplerTimeoutError("no moment free of generation came within 1 s"),
            "rendezvous_timeout": RendezvousTimeoutError("weights/g0", "the layout", [2], 1.0),
            "peer_rank": PeerRankFailedError(0, 1, "train step 3", "RuntimeError: boom"),
            "actor_died": ActorDiedError("sampler3", "killed by SIGKILL"),
            "runtime": RuntimeError("a bug of this rank"),
        }[kind]

    @endpoint
    async def raise_error(self, kind: str) -> None:
        raise self._error(kind)

    @endpoint
    async def train_step(self, groups: list[int], deadline_s: float = 0.0) -> str:
        if self.kind:
            raise self._error(self.kind)
        return "trained"


class Exits(Actor):
    """Ends its own process on request, through a normal interpreter shutdown (test_zygote.py)."""

    @endpoint
    async def getpid(self) -> int:
        return os.getpid()

    @endpoint
    async def parent(self) -> int:
        return os.getppid()

    @endpoint
    async def environ(self) -> dict[str, str]:
        return dict(os.environ)

    @endpoint
    async def spawned_environ(self) -> dict[str, str]:
        """The environment a process this one starts gets (the C library's ``environ``)."""
        out = subprocess.run(["env", "-0"], capture_output=True, check=True, timeout=30).stdout
        return dict(entry.split("=", 1) for entry in out.decode().split("\0") if entry)

    @endpoint
    async def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    @endpoint
    async def temp_dir(self) -> str:
        import tempfile

        return tempfile.gettempdir()

    @endpoint
    async def tqdm_disabled(self) -> bool:
        from tqdm.std import tqdm

        bar = tqdm(range(1), file=sys.stderr)
        disabled = bool(bar.disable)
        bar.close()  # which disables it
        return disabled

    @endpoint
    async def exit_later(self, code: int, marker: str) -> None:
        """``sys.exit(code)`` once this reply is out; ``marker`` is written at exit (atexit: the
        interpreter's shutdown ran, not an ``os._exit``)."""
        import atexit

        atexit.register(lambda: open(marker, "w").write("atexit"))
        asyncio.get_running_loop().call_later(0.1, sys.exit, code)
