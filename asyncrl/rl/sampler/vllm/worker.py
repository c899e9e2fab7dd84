"""The vLLM worker's side of weight sync: a worker extension that joins the trainer's group.

`VLLMBackend` names `WeightSyncExtension` as vLLM's ``worker_extension_cls``, so its methods are
mixed into the worker class in the process that holds the model (vLLM's engine-core process, a
grandchild of the supervisor). The sampler actor calls them through ``AsyncLLM.collective_rpc``
with small plain values only (the group's address, a rank, a version, a timeout) and gets plain
values back: no tensor and no object of ours crosses that channel, whatever vLLM uses to carry
it. The buckets themselves come straight off the communicator into this process
(`asyncrl.comm`: a `StoreGroup` and gloo on CPU, PyNccl on CUDA) and are applied as they arrive.

How a received tensor gets into the model:

* CUDA, the first sync of a layout: ``model.load_weights(tensors)`` once a bucket, with every tensor
  the bucket completed, on the receiver's copy stream: the model's own loaders fuse q/k/v and
  gate/up as they would from a checkpoint. Once a bucket, not once a tensor: each call walks the
  model's parameters first (``dict(named_parameters())``), which a tensor at a time made most of a
  0.5B model's sync (docs/weight_sync.md, benchmarks/README.md). The same sync checks
  the place `param_views` computed for each tensor inside the model's parameters.
* CUDA, every later sync once those places checked out: received straight into them, as into any
  mapping of tensors (no loader call, no name lookup: the loader was still the largest part of the
  sync, docs/vllm.md). A model whose places cannot be computed or did not check keeps the loader.
* CPU: vLLM repacks linear weights for its CPU kernels after loading, so ``load_weights`` on the
  live model fails; the model runner's ``reload_weights(weights_iterator=...)`` restores the
  checkpoint layout, loads, and repacks. It pulls from an iterator while the receiver pushes, so
  it runs on a helper thread fed through a bounded queue (`_PulledLoad`), and the last tensor's
  delivery waits for it to finish: the receiver's commit vote then means "applied" on this member.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch

from asyncrl.comm.address import SyncAddress, check_timeout
from asyncrl.comm.delivery import BatchConsumer
from asyncrl.comm.errors import LayoutMismatchError
from asyncrl.rl.config.sampler import STAGE_MODES
from asyncrl.rl.sampler.errors import WeightsUnreadableError
from asyncrl.rl.sampler.vllm import compat
from asyncrl.rl.sampler.vllm.param_views import LoadAndCheck, param_views
from asyncrl.rl.sampler.vllm.reload_warnings import quiet_reload_warnings

if TYPE_CHECKING:
    from asyncrl.comm.join import SyncMembership
    from asyncrl.comm.staged import StagedReceiver
    from asyncrl.comm.weights import WeightReceiver

log = logging.getLogger(__name__)
_DONE = object()
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not a checkpoint we trust


class WorkerSyncError(RuntimeError):
    """A weight-sync control call reached the worker in a state or with values it cannot take."""


AUTO_STAGE_SHARE = 1 / 16
"""0.5B and 1.5B models' bf16 weights on an 80-141 GiB GPU (1-3 GiB); not 7B's 15 GiB."""

CALLS = ("join", "setup_receiver", "receive_weights", "digest", "leave", "created", "loaded", "pid")
"""The control calls `asyncrl_call` dispatches (each is the ``asyncrl_<name>`` method)."""


class WeightSyncExtension:
    """Mixed into vLLM's worker (``self.model_runner``, ``self.device`` come from it). One
    membership at a time; `asyncrl_join` leaves the previous one first."""

    model_runner: Any  # vLLM's model runner (its internals, read through `compat`): the worker's
    _asyncrl: _Membership | None = None
    _asyncrl_loaded: tuple[int, dict[str, int] | None] | None = None  # the last sync's version, positions

    def asyncrl_call(self, call: str, *args: Any) -> dict[str, Any]:
        """The one entry point `VLLMBackend` calls through ``collective_rpc``: run ``asyncrl_<call>``
        and answer ``{"ok": result}``, or ``{"error": type path, "message": text}`` when the data
        plane raised (an `asyncrl.comm.errors.CommError`) or a digest was refused
        (`WeightsUnreadableError`). vLLM passes an exception raised here on as text only; the type
        must survive, because it tells a member that suffered a peer's failure (it stays in the
        run) from one that failed by itself (it is replaced), and a digest that cannot exist (the
        run stops) from either. Anything else raises as it is."""
        from asyncrl.comm.errors import CommError
        from asyncrl.errors import type_path

        if call not in CALLS:
            raise WorkerSyncError(f"no weight-sync call {call!r} (known: {', '.join(CALLS)})")
        try:
            return {"ok": getattr(self, f"asyncrl_{call}")(*args)}
        except (CommError, WeightsUnreadableError) as exc:
            return {"error": type_path(type(exc)), "message": str(exc)}

    def asyncrl_join(self, address: Any, rank: Any) -> str:
        """Join the group at ``address`` (a `SyncAddress` as plain values: ``msgspec.to_builtins``)
        as ``rank``; its store is reached from here, the engine's process, which runs on the sampler
        actor's host. Returns the communicator's backend."""
        from asyncrl.comm.join import join_sync_group

        address = _check_join(address, rank)
        self.asyncrl_leave()
        membership = join_sync_group(address, rank, device=self._asyncrl_device())
        self._asyncrl = _Membership(membership)
        return membership.backend

    def asyncrl_setup_receiver(self, timeout_s: float, stage: str = "off") -> int:
        """Receive the sender's layout; refuse one whose names or shapes are not the checkpoint's.
        ``stage`` (`STAGE_MODES`): whether later syncs are staged beside the engine once their
        places checked (`_Membership.start_staging`). Returns the bucket count."""
        from asyncrl.comm.weights import WeightReceiver

        check_timeout(timeout_s)
        if stage not in STAGE_MODES:
            raise ValueError(f"stage must be one of {', '.join(STAGE_MODES)}, not {stage!r}")
        member = self._asyncrl_member("setup_receiver")
        member.stop_staging()
        stage = stage if self._asyncrl_loads_in_place() else "off"  # staging needs the places (CUDA)
        receiver = WeightReceiver.create(member.comm, member.group, src=0, timeout_s=timeout_s, notices=stage != "off")
        _check_against_checkpoint(receiver.layout, self._asyncrl_model_path())
        if not self._asyncrl_loads_in_place():
            names = {spec.name for spec in receiver.layout.tensors}
            quiet_reload_warnings(compat.live_model(self.model_runner), names)
        member.receiver, member.timeout_s, member.stage, member.syncs = receiver, timeout_s, stage, 0
        member.views, member.candidates = None, None
        member.no_views = "vLLM on the CPU repacks the weights it loads"
        if self._asyncrl_loads_in_place():
            sent = [(spec.name, tuple(spec.shape), spec.torch_dtype) for spec in receiver.layout.tensors]
            member.candidates, why = param_views(compat.live_model(self.model_runner), sent)
            member.no_views = "" if member.candidates is not None else why
            if member.candidates is None:
                log.warning("weight sync: every sync goes through vLLM's load_weights (%s)", why)
        return len(receiver.layout.buckets)

    def asyncrl_receive_weights(self, version: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Take sync ``version`` into the model, bucket by bucket, within ``timeout_s`` (None: the
        set-up's; the sampler passes what its own deadline has left after a pause). Returns
        ``{"stats": the receiver's SyncStats as plain values (its copy_s is the model's load:
        load_weights, or the CPU reload), "positions": each request's sampled tokens when the new
        weights went in (`compat.request_positions`; None where unknown)}``: every token before a
        request's position was sampled with the old weights, every later one with these."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, not {version!r}")
        if timeout_s is not None:
            check_timeout(timeout_s)
        member = self._asyncrl_member("receive_weights")
        if member.receiver is None:
            raise WorkerSyncError("receive_weights before setup_receiver")
        limit = member.timeout_s if timeout_s is None else timeout_s
        member.syncs += 1  # a sync that fails here still took part: the sender counted it too
        if member.stager is not None:
            stats = member.stager.apply(version, limit)
        elif member.views is not None:
            stats = member.receiver.receive(version, member.views, timeout_s=limit)
        elif self._asyncrl_loads_in_place():
            # vLLM's model's load_weights takes a batch of (name, tensor) pairs: a `BatchConsumer`
            load = cast(BatchConsumer, compat.live_model(self.model_runner).load_weights)
            if member.candidates is None:
                stats = member.receiver.receive(version, load, timeout_s=limit, batched=True)
            else:
                check = LoadAndCheck(load, member.candidates)
                stats = member.receiver.receive(version, check, timeout_s=limit, batched=True)
                member.take_views(check, version)
        else:
            pulled = _PulledLoad(self._asyncrl_reload, total=len(member.receiver.layout.tensors), timeout_s=limit)
            try:
                stats = member.receiver.receive(version, pulled, timeout_s=limit)
            finally:
                pulled.close()
        # Between two engine steps still (this call is one): no token is sampled until we return.
        positions = compat.request_positions(self.model_runner)
        self._asyncrl_loaded = (version, positions)
        return {"stats": msgspec.to_builtins(stats), "positions": positions}

    def asyncrl_loaded(self, marker: Any) -> dict[str, Any]:
        """For the other clients of a shared engine (`shared.ClientSink`), once its host's sync is
        done: ``{"version": the last one loaded, "positions": where each request whose id holds
        ``marker`` (the asking client's) stood at that load}`` (None where unknown)."""
        if not isinstance(marker, str) or not marker:
            raise ValueError(f"marker must be a non-empty str, not {marker!r}")
        if self._asyncrl_loaded is None:
            raise WorkerSyncError("no weights were loaded into this engine yet")
        version, positions = self._asyncrl_loaded
        mine = None if positions is None else {rid: n for rid, n in positions.items() if marker in rid}
        return {"version": version, "positions": mine}

    def asyncrl_pid(self) -> int:
        """This process's id: a client of a shared engine watches it to know when the engine ends."""
        return os.getpid()

    def asyncrl_digest(self) -> str:
        """`asyncrl.rl.digest.tensor_digest` of the model's weights under the sender's names and in
        its dtype (``--run.check_weights``), read through the places a sync checked: the trainer's
        digest of what it sent equals it only if every byte landed where the model reads it."""
        from asyncrl.rl.digest import tensor_digest

        member = self._asyncrl_member("digest")
        if member.views is None and not member.no_views:  # for now: the sampler is not judged for it
            raise WorkerSyncError("no digest of the vLLM model's weights yet: no sync has checked their places")
        if member.views is None:  # for good: the driver stops the run rather than restart the sampler
            raise WeightsUnreadableError(
                f"no digest of the vLLM model's weights: they are not held as the sent tensors ({member.no_views})"
            )
        return tensor_digest(member.views)

    def asyncrl_leave(self) -> None:
        """Drop the communicator and the store handle. Idempotent."""
        member = getattr(self, "_asyncrl", None)
        self._asyncrl = None
        if member is not None:
            member.close()

    def asyncrl_created(self) -> dict[str, int]:
        from asyncrl.comm.communicator import Communicator

        return dict(Communicator.created)

    # --- helpers --------------------------------------------------------------------------------

    def _asyncrl_member(self, what: str) -> _Membership:
        member = getattr(self, "_asyncrl", None)
        if member is None:
            raise WorkerSyncError(f"{what} before joining a weight-sync group")
        return member

    def _asyncrl_reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The CPU path: vLLM restores the checkpoint layout, loads from ``weights``, repacks."""
        compat.reload_weights(self.model_runner, weights)

    def _asyncrl_loads_in_place(self) -> bool:
        """CUDA: the live model's ``load_weights`` takes each tensor; CPU: ``reload_weights``."""
        return self._asyncrl_device().type == "cuda"

    def _asyncrl_device(self) -> torch.device:
        device = getattr(self, "device", None)
        return torch.device(device) if device is not None else torch.device("cpu")

    def _asyncrl_model_path(self) -> str:
        return compat.model_path(self.model_runner)


class _Membership:
    """The worker's place in one group (a `SyncMembership`) and the receiver set up in it."""

    def __init__(self, membership: SyncMembership):
        self.membership = membership
        self.group, self.comm = membership.group, membership.comm
        self.receiver: WeightReceiver | None = None
        self.timeout_s = 60.0
        self.stage = "off"  # `STAGE_MODES`
        self.syncs = 0  # syncs taken part in since set-up (the sender numbers its notices so)
        self.stager: StagedReceiver | None = None  # once staging began
        self.candidates: dict[str, torch.Tensor] | None = None  # computed places (param_views)
        self.views: dict[str, torch.Tensor] | None = None  # the same, once a sync checked them
        self.no_views = ""  # why ``views`` is None for good, "" while a sync may still check them

    def take_views(self, check: LoadAndCheck, version: int) -> None:
        """After a sync through the loader: receive straight into the checked places from now on,
        or never try them again for this layout."""
        why = check.verdict()
        if why:
            self.no_views = why
            log.warning("weight sync: every sync goes through vLLM's load_weights (%s)", why)
        else:
            log.info(
                "weight sync: from version %d on, %d tensors are received straight into vLLM's parameters",
                version + 1,
                len(check.views),
            )
            self.views = self.candidates
            self.start_staging()
        self.candidates = None

    def start_staging(self) -> None:
        """With the places checked: receive every later sync beside the engine (`StagedReceiver`)
        where ``stage`` allows it and the copy fits, else log why not and go on without."""
        from asyncrl.comm.staged import StagedReceiver
        from asyncrl.comm.sync_notice import NoticeWatch

        views, receiver = self.views, self.receiver
        if self.stage == "off" or views is None:
            return
        need = sum(t.numel() * t.element_size() for t in views.values())
        device = next(iter(views.values())).device
        total = torch.cuda.get_device_properties(device).total_memory
        if self.stage == "auto" and need > total * AUTO_STAGE_SHARE:
            print(
                f"weight sync: not staged (a copy of the weights, {need / 2**30:.2f} GiB, is more than "
                f"{100 * AUTO_STAGE_SHARE:.0f}% of the GPU's {total / 2**30:.0f} GiB; --sampler.stage_weights on "
                "stages it anyway)",
                flush=True,
            )
            return
        if receiver is None:  # the places are checked by a sync, which needs the receiver
            raise WorkerSyncError("staging before the weight layout was set up")
        try:
            watch = NoticeWatch(self.group, receiver.setup_calls)
            self.stager = StagedReceiver(receiver, views, watch, first=self.syncs)
        except torch.OutOfMemoryError:
            log.warning(
                "weight sync: not staged: no room on the GPU for a copy of the weights (%.2f GiB)", need / 2**30
            )
            return
        print(
            f"weight sync: from sync {self.syncs + 1} on, received into a copy of the weights "
            f"({need / 2**30:.2f} GiB) while the engine decodes, and copied in at its next step",
            flush=True,
        )  # fmt: skip

    def stop_staging(self) -> None:
        stager, self.stager = self.stager, None
        if stager is not None:
            stager.stop()

    def close(self) -> None:
        self.stop_staging()
        self.receiver = None
        self.membership.close()


class _PulledLoad:
    """A consumer for `WeightReceiver.receive` that feeds a loader which pulls from an iterator.

    The loader runs on its own thread and is started on the first tensor. Each tensor is cloned
    before it is queued (the receiver's view is only valid during the call, and a loader may hold
    a tensor until the rest of its layer arrives); the queue is bounded, so at most ``depth``
    clones wait. Delivering the ``total``-th tensor waits for the loader to return, and raises
    what it raised, so a failure is the receiver's (and hence every member's) failure. Every wait
    is bounded by ``timeout_s``."""

    def __init__(
        self,
        loader: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
        *,
        total: int,
        timeout_s: float,
        depth: int = 8,
    ):
        self.loader, self.total, self.timeout_s = loader, total, timeout_s
        self.queue: queue.Queue = queue.Queue(depth)
        self.delivered = 0
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()  # the receiver gave up: the iterator ends early

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="asyncrl-vllm-reload", daemon=True)
            self.thread.start()
        self._put((name, tensor.clone()))
        self.delivered += 1
        if self.delivered == self.total:
            self._finish()

    def close(self) -> None:
        """After the receive, successful or not: end the loader if it still runs. Idempotent."""
        if self.thread is not None and self.thread.is_alive():
            self.stop.set()
            self.thread.join(self.timeout_s)

    def _put(self, item: object) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.error is not None:
                raise WorkerSyncError(f"the vLLM weight loader failed: {self.error!r}") from self.error
            try:
                self.queue.put(item, timeout=min(0.5, max(deadline - time.monotonic(), 0.001)))
                return
            except queue.Full:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the vLLM weight loader took no tensor within {self.timeout_s:g} s") from None

    def _finish(self) -> None:
        self._put(_DONE)
        thread = self.thread
        if thread is None:  # __call__ starts it with the first tensor, before this
            raise WorkerSyncError("the vLLM weight loader was never started")
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.stop.set()
            raise TimeoutError(f"the vLLM weight loader did not finish within {self.timeout_s:g} s of the last tensor")
        if self.error is not None:
            raise WorkerSyncError(f"the vLLM weight loader failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            self.loader(self._items())
        except BaseException as exc:
            self.error = exc

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            try:
                item = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.stop.is_set():
                    raise WorkerSyncError("the weight sync ended before every tensor arrived") from None
                continue
            if item is _DONE:
                return
            yield item


# --- validation -----------------------------------------------------------------------------------


def _check_join(address: Any, rank: Any) -> SyncAddress:
    """The control values come from another process: refuse wrong types with a clear error. The
    address's own checks are `SyncAddress`'s (``msgspec.convert`` runs them); the rest are this
    worker's: it receives (never rank 0), and on CUDA or CPU (no hccl)."""
    address = msgspec.convert(address, SyncAddress)  # a ValidationError is a ValueError
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, not {rank!r}")
    if rank == 0:
        raise ValueError("a vLLM worker receives weights; rank 0 is the sender's")
    address.check_rank(rank)
    if address.backend not in ("auto", "gloo", "nccl", "ipc"):
        raise ValueError(f"backend must be auto, gloo, nccl or ipc in a vLLM worker, not {address.backend!r}")
    return address


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of a local safetensors checkpoint, read from the files' JSON
    headers only; None when ``path`` is not a local directory of safetensors files."""
    if not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(os.path.join(path, file), "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise LayoutMismatchError(f"{file}: not a safetensors file (no header length)")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise LayoutMismatchError(f"{file}: safetensors header of {size} bytes is implausible")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise LayoutMismatchError(f"{file}: safetensors header is not a JSON object")
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


def _check_against_checkpoint(layout: Any, path: str) -> None:
    """The sender's names and shapes must be the checkpoint's that vLLM loaded, so that every
    sync replaces every weight: a name vLLM does not know would fail each sync, and one the
    sender never sends would leave a stale weight behind. A tied ``lm_head.weight`` may be
    absent from the sender (``named_parameters`` lists a tied tensor once)."""
    shapes = checkpoint_shapes(path)
    if shapes is None:
        return  # not a local safetensors directory: vLLM's loaders are the only check
    problems = []
    sent = {spec.name: tuple(spec.shape) for spec in layout.tensors}
    for name, shape in sent.items():
        if name not in shapes:
            problems.append(f"{name}: not in the checkpoint at {path}")
        elif shapes[name] != shape:
            problems.append(f"{name}: sender has {list(shape)}, the checkpoint {list(shapes[name])}")
    tied = "lm_head.weight" in shapes and "model.embed_tokens.weight" in sent and _tied(path)
    problems += [
        f"{name}: in the checkpoint, never sent"
        for name in shapes
        if name not in sent and not (tied and name == "lm_head.weight")
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise LayoutMismatchError(f"the vLLM worker refuses the sender's weight layout: {shown}")


def _tied(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("tie_word_embeddings", False))
