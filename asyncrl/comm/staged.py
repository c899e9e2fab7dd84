"""`StagedReceiver`: a receiver that takes each sync into a copy of the weights of its own, on a
thread, while whoever reads the weights goes on reading them; `apply` then copies the copy in.

Why: a vLLM engine takes a call only between two of its steps, and a sync whose receiver waits for
that call keeps the sender waiting in its first vote for the engine's step boundary (most of a
colocated trainer's sync went to that wait: docs/weight_sync.md; issue 46 item 3). A staged receiver instead waits for
the sender's notice on the group's store (`sync_notice.py`) and takes part in the sync at once; the
engine copies the result into its weights at its next step boundary, one device copy
(``apply``), so the sender waits for nobody's decoding. The same holds for a trainer's wait on a
sampler that is pausing for its batch to end (``weight_update="pause"``).

The thread receives into ``staging`` (the same shapes and dtypes as the targets, made once, so a
delta sync has its base there from the second staged sync on), on a CUDA stream of its own. While
a staged sync waits to be applied no later one overwrites it unannounced: `apply` of a version
another receive has begun over fails, and the next `apply` takes the newer one. The weights that
are read are never half-written: a sync that failed leaves only the staging copy incomplete, and
`apply` raises its error.

Cost: one copy of the targets on their device, and a second connection to the group's store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import msgspec
import torch

from asyncrl.comm.errors import WeightSyncError
from asyncrl.comm.sync_notice import STOP, NoticeWatch
from asyncrl.comm.sync_stats import SyncStats
from asyncrl.comm.weights import WeightReceiver

STOP_S = 5.0
"""How long `stop` waits for the thread once a receive under way was aborted."""


class StagedReceiver:
    """Stages every sync after the ``first``-th (counted from the receiver's set-up: the syncs it
    already took part in) for ``targets``, announced through ``watch``. `stop` ends the thread."""

    def __init__(
        self, receiver: WeightReceiver, targets: Mapping[str, torch.Tensor], watch: NoticeWatch, *, first: int
    ):
        self.receiver, self.watch = receiver, watch
        self.targets = list(targets.values())
        self.staging = {name: torch.empty_like(t) for name, t in targets.items()}
        self._staged = list(self.staging.values())
        self.nbytes = sum(t.numel() * t.element_size() for t in self._staged)
        self.device = self._staged[0].device if self._staged else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.received = torch.cuda.Event()  # the staging copy is whole (the thread's stream)
            self.applied = torch.cuda.Event()  # it has been read into the targets (the reader's)
        self._cond = threading.Condition()
        self._busy = -1  # the version being received, -1 none
        self._waiting = -1  # the sync whose notice the thread waits for, -1 none
        self._done: dict[int, SyncStats | BaseException] = {}
        self._gone: BaseException | None = None  # why the thread ended before it was stopped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first,), name="asyncrl-staged-receive", daemon=True)
        self._thread.start()

    @property
    def who(self) -> str:
        return f"group {self.receiver.comm.group!r} rank {self.receiver.comm.rank}"

    def apply(self, version: int, timeout_s: float) -> SyncStats:
        """Wait (at most ``timeout_s``) for sync ``version`` to be staged, then copy it into the
        targets on the caller's stream. Returns the staged sync's `SyncStats` with ``seconds`` this
        call's own time (the wait for the sync, if it was still under way, and the copy) and the
        copy counted in ``copy_s``; raises the sync's own error if it failed."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while version not in self._done:
                if self._gone is not None:
                    raise WeightSyncError(f"{self.who}: no sync is staged any more: {self._gone}") from self._gone
                if self._stop.is_set():
                    raise WeightSyncError(f"{self.who}: sync v{version} cannot be applied: staging was stopped")
                left = deadline - time.monotonic()
                if left <= 0:
                    began = "was still being received" if self._busy == version else "was never announced"
                    raise WeightSyncError(f"{self.who}: sync v{version} {began} within {timeout_s:g} s")
                self._cond.wait(left)
            result = self._done.pop(version)
            if isinstance(result, BaseException):
                raise result
            copying = time.perf_counter()
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.received)
            with torch.no_grad():
                torch._foreach_copy_(self.targets, self._staged)
            if self.cuda:
                self.applied.record(torch.cuda.current_stream(self.device))
        end = time.perf_counter()
        return msgspec.structs.replace(result, seconds=end - start, copy_s=result.copy_s + end - copying)

    def stop(self) -> None:
        """End the thread; a receive under way is aborted (the communicator with it). Idempotent."""
        with self._cond:
            self._stop.set()
            busy, waiting = self._busy, self._waiting
        if busy >= 0:
            self.receiver.comm.abort(f"the receiver stopped staging during sync v{busy}")
        elif waiting >= 0:
            self.watch.wake(waiting)
        self._thread.join(STOP_S)

    def _run(self, n: int) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._cond:  # `stop` sees either this wait, and wakes it, or the flag set
                if self._stop.is_set():
                    return
                self._waiting = n
            try:
                version = self.watch.wait(n)
            except BaseException as exc:  # the store is gone: every later apply says so
                with self._cond:
                    self._gone = exc
                    self._cond.notify_all()
                return
            if version == STOP or self._stop.is_set():
                return
            self._receive(version)
            n += 1

    def _receive(self, version: int) -> None:
        with self._cond:
            self._busy, self._waiting = version, -1
            for older in self._done:  # staged, never applied, now overwritten
                self._done[older] = WeightSyncError(
                    f"{self.who}: sync v{older} was overwritten by v{version} unapplied"
                )
            if self.cuda:
                self.stream.wait_event(self.applied)
        result: SyncStats | BaseException
        try:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    result = self.receiver.receive(version, self.staging)
                    self.received.record(self.stream)
            else:
                result = self.receiver.receive(version, self.staging)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever applies this version
            result = exc
        with self._cond:
            self._busy = -1
            self._done[version] = result
            self._cond.notify_all()
