"""`PhaseClock`: how long one weight sync spent copying through the staging buffers and on the wire.

A sync's copies and transfers overlap (double buffering, `staging.py`), and on a GPU they only
enqueue kernels: timing them on the host would make them look free and put their cost wherever
the host next waits (the commit vote). So on CUDA each span records a pair of timing events on
the stream it runs on, and the elapsed times are read only once the sync has ended: the commit
vote has waited for both streams by then, so reading them blocks on nothing and the sync's own
path gains two event records per span, no synchronisation. On the CPU a span is the host time
spent in it; so it is on other devices (an NPU's), where work enqueued on a stream then shows in
the commit vote, which waits for it, rather than in the span.

Spans of one phase on one stream never overlap, so each phase's total is at most the sync's;
spans of different phases on a GPU do overlap (bucket k+1 is packed while bucket k is on the
wire), so the totals of two phases may add up to more than the sync took.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

COPY = "copy"
"""Copies between the staging buffers and the caller's tensors: packing (and casting to the wire's
dtype) on the sender; unpacking on a receiver, including a consumer's load (vLLM ``load_weights``)."""
TRANSFER = "transfer"
"""On the wire: a collective in flight (GPU), or the host enqueuing one or waiting for it (CPU)."""


class PhaseClock:
    """Totals of the sync's phases (`COPY`, `TRANSFER`), reset by `begin` at each sync's start."""

    def __init__(self) -> None:
        self._host: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []
        self.begin()

    def begin(self) -> None:
        self._host = {COPY: 0.0, TRANSFER: 0.0}
        self._events = []

    @contextlib.contextmanager
    def span(self, phase: str, stream: torch.Stream | None = None) -> Iterator[None]:
        """Time the block as ``phase``: on ``stream`` (a CUDA stream) with events, else on the host."""
        if stream is None:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._host[phase] += time.perf_counter() - start
            return
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._events.append((phase, begin, end))

    def add(self, phase: str, seconds: float) -> None:
        """Count host time measured elsewhere (a wait for a transfer) as ``phase``."""
        self._host[phase] += seconds

    def totals(self) -> dict[str, float]:
        """Seconds per phase. Call once the sync has ended: a GPU span's end event is waited for."""
        totals = dict(self._host)
        for phase, begin, end in self._events:
            end.synchronize()  # done already after the commit vote; cheap
            totals[phase] += begin.elapsed_time(end) / 1e3
        self._events = []
        return totals
