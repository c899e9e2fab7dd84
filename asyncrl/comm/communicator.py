"""The one interface every collective backend implements (gloo, NCCL, HCCL).

Operations *enqueue*: on an accelerator they go on a stream and return at once; on CPU they start on
gloo's threads. Each returns a `Work`; `Work.wait(timeout_s)` completes it under a deadline. An
operation's own ``timeout_s`` is a limit the library enforces by itself where it can (gloo does, so
its threads are free again when the caller's deadline passes); `Work.wait` is what callers rely on. A
communicator that saw a failure or a timeout aborts itself (so no kernel or thread is left spinning
on a dead peer) and refuses further work with `CommunicatorClosedError`: a group with a failed
member is rebuilt, never patched.

A communicator is created once per membership and reused for every sync; `Communicator.created`
counts creations per backend in this process so a test can prove the reuse.
"""

from __future__ import annotations

import abc
import collections
import enum
from typing import ClassVar

import torch

from asyncrl.comm.errors import CommunicatorClosedError


class ReduceOp(enum.IntEnum):
    """Reduction of `Communicator.all_reduce`. Each backend maps these to its own codes."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3


def cuda_stream(stream: torch.Stream | None, device: torch.device) -> torch.cuda.Stream:
    """``stream`` as the CUDA stream an operation on ``device`` goes on (None: the device's current
    one); a stream of another kind is refused (`TypeError`)."""
    if stream is None:
        return torch.cuda.current_stream(device)
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"an operation on {device} goes on a torch.cuda.Stream, not a {type(stream).__name__}")
    return stream


class Work(abc.ABC):
    """One enqueued operation (or a batch of them)."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until the work completed. On timeout or failure the communicator is aborted and a
        `CollectiveTimeoutError` / `CollectiveError` naming the group, rank and operation is raised."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the work completed (successfully or not); never blocks."""


class CompletedWork(Work):
    """The work of an operation that completed before it was returned (or needed no device op)."""

    def wait(self, timeout_s: float) -> None:
        return None

    def done(self) -> bool:
        return True


class Communicator(abc.ABC):
    """A fixed group of ``world_size`` ranks that exchange tensors on ``device``.

    Subclasses set ``backend`` and call ``super().__init__`` only once the library communicator
    exists, so ``created`` counts real creations."""

    backend: ClassVar[str] = "?"
    created: ClassVar[collections.Counter[str]] = collections.Counter()

    def __init__(self, *, group: str, rank: int, world_size: int, device: torch.device):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._closed_reason: str | None = None
        Communicator.created[self.backend] += 1

    # -- operations -------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every other rank. ``tensor`` must be
        contiguous and on ``device``; same shape and dtype on every rank."""

    @abc.abstractmethod
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.Stream | None = None,
        timeout_s: float | None = None,
    ) -> Work:
        """Reduce ``tensor`` across ranks in place."""

    def send(
        self, tensor: torch.Tensor, dst: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        raise NotImplementedError(f"{self.backend} communicator has no point-to-point send")

    def recv(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        raise NotImplementedError(f"{self.backend} communicator has no point-to-point recv")

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def abort(self, reason: str = "aborted") -> None:
        """Stop all outstanding work without waiting for peers and release the library handle.
        Idempotent; later operations raise `CommunicatorClosedError`."""
        if self._closed_reason is None:
            self._closed_reason = reason
            self._abort()

    def close(self) -> None:
        """Release the communicator. Does not wait for peers (a clean shutdown is the caller's
        barrier); idempotent."""
        if self._closed_reason is None:
            self._closed_reason = "closed"
            self._destroy()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _abort(self) -> None: ...

    @abc.abstractmethod
    def _destroy(self) -> None: ...

    def _check_open(self, what: str) -> None:
        if self._closed_reason is not None:
            raise CommunicatorClosedError(
                f"group {self.group!r} rank {self.rank}: cannot {what}, the {self.backend} "
                f"communicator is {self._closed_reason}"
            )

    def _check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{self.backend} {what}: tensor must be contiguous")
        if tensor.device != self.device:
            raise ValueError(f"{self.backend} {what}: tensor is on {tensor.device}, communicator on {self.device}")

    def __repr__(self) -> str:
        state = self._closed_reason or "open"
        return (
            f"<{type(self).__name__} group={self.group!r} rank={self.rank}/{self.world_size} "
            f"device={self.device} {state}>"
        )
