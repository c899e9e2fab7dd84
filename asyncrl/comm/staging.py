"""The staging side of a weight sync (`comm/weights.py`): the two bucket buffers and the ordering
between copying into or out of them and the communicator (`Staging`), the per-bucket copies
between the staging views and the caller's tensors (`CopyPlan`), and the views themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from asyncrl.comm.communicator import Communicator, ReduceOp, Work
from asyncrl.comm.layout import Segment, TensorSpec, WeightLayout
from asyncrl.comm.phase_clock import COPY, TRANSFER, PhaseClock


class Staging:
    """The two staging buffers and the ordering between the side that copies into or out of them
    and the communicator. ``copy(k)`` is entered before touching bucket ``k``'s buffer (``k % 2``);
    ``transfer(k)`` puts it on the wire. On GPU nothing here blocks the CPU; on CPU ``copy`` waits
    for the buffer's previous transfer, which is where the overlap with gloo's threads comes from.

    Every view of the buffers a sync needs is made once here: building hundreds of tensor views
    per sync would cost milliseconds of CPU, more than the GPU needs to move a 0.5B model.

    ``clock`` times the copies and the transfers of the current sync (`PhaseClock`: events on
    the two streams on GPU, host time on CPU, where a wait for a transfer counts as transfer)."""

    def __init__(self, comm: Communicator, layout: WeightLayout, deadline: Callable[[], float]):
        self.comm = comm
        self.deadline = deadline
        self.buffers = [torch.empty(layout.buffer_bytes, dtype=torch.uint8, device=comm.device) for _ in range(2)]
        self.wire = [self.buffers[k % 2][:size] for k, size in enumerate(layout.bucket_sizes)]
        self.views = [
            [bucket_view(self.buffers[k % 2], seg, layout) for seg in bucket] for k, bucket in enumerate(layout.buckets)
        ]
        self.cuda = comm.device.type == "cuda"
        self.works: list[list[Work]] = [[], []]  # a delta bucket puts two on a slot: count, payload
        self.held: list[torch.Tensor] = []  # sent counts, alive until the commit vote
        self.direct_works: list[Work] = []
        self.clock = PhaseClock()
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(comm.device)
            self.comm_stream = torch.cuda.Stream(comm.device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.transferred = [torch.cuda.Event(), torch.cuda.Event()]

    @property
    def stream(self):
        return self.comm_stream if self.cuda else None

    def begin(self) -> None:
        """Order this sync after whatever the caller's stream did to the weights (the comm stream
        reads and writes tensors sent directly)."""
        self.clock.begin()
        if self.cuda:
            current = torch.cuda.current_stream(self.comm.device)
            self.copy_stream.wait_stream(current)
            self.comm_stream.wait_stream(current)

    def transfer_direct(self, tensor: torch.Tensor, src: int) -> None:
        """Put a whole tensor on the wire with no staging copy (the tensor is the buffer)."""
        with self.clock.span(TRANSFER, self.stream):
            self.direct_works.append(self.comm.broadcast(tensor, src, stream=self.stream, timeout_s=self.deadline()))

    def direct_done(self) -> None:
        """Let the copy side read what the direct transfers received."""
        if self.cuda:
            self.copy_stream.wait_stream(self.comm_stream)
        else:
            self._wait_direct()

    def _wait_direct(self) -> None:
        works, self.direct_works = self.direct_works, []
        with self.clock.span(TRANSFER):
            for work in works:
                work.wait(self.deadline())

    @contextlib.contextmanager
    def copy(self, k: int) -> Iterator[None]:
        slot = k % 2
        if self.cuda:
            self.copy_stream.wait_event(self.transferred[slot])
            with torch.cuda.stream(self.copy_stream), self.clock.span(COPY, self.copy_stream):
                yield
            self.copied[slot].record(self.copy_stream)
        else:
            works, self.works[slot] = self.works[slot], []
            if works:
                with self.clock.span(TRANSFER):  # the buffer's previous transfer (a receiver: bucket k's)
                    for work in works:
                        work.wait(self.deadline())
            with self.clock.span(COPY):
                yield

    def transfer(self, k: int, src: int, tensor: torch.Tensor | None = None) -> None:
        """Put bucket ``k`` on the wire, or ``tensor`` (a delta's count or payload, which bucket
        ``k``'s copy produced) in its place."""
        slot = k % 2
        if self.cuda:
            self.comm_stream.wait_event(self.copied[slot])
        sent = self.wire[k] if tensor is None else tensor
        with self.clock.span(TRANSFER, self.stream):
            self.works[slot].append(self.comm.broadcast(sent, src, stream=self.stream, timeout_s=self.deadline()))
        if self.cuda:
            self.transferred[slot].record(self.comm_stream)

    def receive_now(self, tensor: torch.Tensor, src: int) -> None:
        """Receive ``tensor`` and wait for it (a delta's count must be read before its payload
        can be received). On GPU it first waits for every copy out of the staging buffers, since
        ``tensor`` may be one of them."""
        if self.cuda:
            self.comm_stream.wait_stream(self.copy_stream)
        with self.clock.span(TRANSFER, self.stream):
            self.comm.broadcast(tensor, src, stream=self.stream, timeout_s=self.deadline()).wait(self.deadline())
        if self.cuda:
            self.copy_stream.wait_stream(self.comm_stream)

    def vote(self, values: list[int]) -> list[int]:
        """All-reduce MAX over int64 values and return them; completes every transfer before it."""
        if self.cuda:
            self.comm_stream.wait_stream(self.copy_stream)
        else:
            self._wait_direct()
        tensor = torch.tensor(values, dtype=torch.int64, device=self.comm.device)
        if self.cuda:
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.comm.device))
        self.comm.all_reduce(tensor, ReduceOp.MAX, stream=self.stream, timeout_s=self.deadline()).wait(self.deadline())
        self.works = [[], []]
        self.held = []
        return tensor.tolist()

    def end(self) -> None:
        """Order the caller's later work on the weights after this sync."""
        self.direct_works = []
        self.works, self.held = [[], []], []
        if self.cuda:
            current = torch.cuda.current_stream(self.comm.device)
            current.wait_stream(self.copy_stream)
            current.wait_stream(self.comm_stream)


class CopyPlan:
    """The copies of one bucket, between the staging views and the caller's tensors, made once
    and reused while the caller's tensors are the same objects."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        self.fused_dsts, self.fused_srcs, self.pairs = [], [], []
        for dst, src in zip(dsts, srcs):
            if dst.is_contiguous() and src.is_contiguous():  # a dtype cast (wire_dtype) fuses too
                self.fused_dsts.append(dst)
                self.fused_srcs.append(src)
            else:
                self.pairs.append((dst, src))

    def reversed(self) -> CopyPlan:
        """The same copies the other way (a receiver refilling the staging views from its tensors)."""
        back = CopyPlan([], [])
        back.fused_dsts, back.fused_srcs = self.fused_srcs, self.fused_dsts
        back.pairs = [(src, dst) for dst, src in self.pairs]
        return back

    def run(self) -> None:
        if self.fused_dsts:  # one multi-tensor launch instead of one kernel per tensor on GPU
            torch._foreach_copy_(self.fused_dsts, self.fused_srcs)
        for dst, src in self.pairs:
            dst.copy_(src)


def bucket_view(buffer: torch.Tensor, seg: Segment, layout: WeightLayout) -> torch.Tensor:
    """The segment in the bucket, typed as on the wire: shaped when it is a whole tensor, flat
    when it is a chunk of a larger one."""
    raw = buffer[seg.offset : seg.offset + seg.length]
    spec = layout.tensors[seg.tensor]
    if seg.length == spec.nbytes:
        return raw.view(spec.torch_dtype).view(spec.shape)
    return raw.view(spec.torch_dtype)


def tensor_part(tensor: torch.Tensor, seg: Segment, spec: TensorSpec) -> torch.Tensor:
    """The tensor itself for a whole-tensor segment, else the segment's elements of it, flat.
    Chunk boundaries fall on whole elements (`build_layout` cuts at aligned offsets), which is
    what lets a chunk be cast between the tensor's dtype and the wire's."""
    if seg.start == 0 and seg.length == spec.nbytes:
        return tensor
    size = spec.torch_dtype.itemsize
    return tensor.reshape(-1)[seg.start // size : (seg.start + seg.length) // size]
