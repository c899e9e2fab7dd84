"""`RequestBatcher`: the endpoint's requests into the sampler's ``generate`` calls.

The HF backend runs one batch at a time, so requests made concurrently (the episodes of a batch)
are gathered into one call: whatever arrived while the previous call ran goes into the next, and
the first request of an idle batcher waits `GATHER_S` for the others of its round. vLLM batches
concurrent calls itself and gets each request at once (``batch=False``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from asyncrl.errors import AsyncrlError
from asyncrl.rl.generation import Completion, SamplingParams

Progress = Callable[[int, list[int]], None]
"""``progress(row, token_ids so far)``: the backend's report as tokens come (`SamplerBackend.generate`)."""
Generate = Callable[
    [list[list[int]], int, SamplingParams, Progress | None], Awaitable[tuple[int, list[list[Completion]]]]
]
"""``generate(prompts, n, params, progress) -> (weight version, completions per prompt)``: the sampler's."""


class EndpointClosedError(AsyncrlError):
    """A request reached an endpoint that is closing; nothing was generated for it."""


class RequestBatcher:
    """Hands requests to ``generate``: each at once (``batch`` False), or gathered: one call at a
    time, with every request that arrived while the previous one ran and asks for the same
    sampling (a request for ``n`` completions is ``n`` rows of it). A seeded request goes alone:
    a backend seeds each row by its place in the call, so its tokens then depend on its own seed
    only."""

    GATHER_S = 0.005
    """How long the first request of an idle batcher waits for the others of its round: the
    episodes of a batch send their requests within a few milliseconds of each other, and a call
    started on the first alone would leave the rest waiting a whole generation for the next one."""

    def __init__(self, generate: Generate, batch: bool):
        self._generate, self._batch = generate, batch
        self._pending: list[tuple[list[int], SamplingParams, int, asyncio.Future, Progress | None]] = []
        self._waiting: set[asyncio.Future] = set()  # every request not answered yet: close() answers them
        self._tasks: set[asyncio.Task] = set()  # the worker and the direct calls: close() cancels them
        self._worker: asyncio.Task | None = None
        self._closed = False

    async def submit(
        self, prompt: list[int], params: SamplingParams, n: int = 1, progress: Progress | None = None
    ) -> tuple[int, list[Completion]]:
        """The weight version and ``n`` completions of ``prompt``; ``progress(choice, ids)``: told each
        completion's tokens as they are generated. `EndpointClosedError` once closed,
        what ``generate`` raises otherwise. A caller that goes away stops its direct call (vLLM
        aborts its request); a gathered call goes on for the others in it."""
        if self._closed:
            raise EndpointClosedError("the endpoint is closing")
        future = asyncio.get_running_loop().create_future()
        self._waiting.add(future)
        direct = None
        try:
            if not self._batch:
                direct = self._start(self._direct(prompt, params, n, future, progress))
            else:
                self._pending.append((prompt, params, n, future, progress))
                if self._worker is None or self._worker.done():
                    self._worker = self._start(self._work())
            return await future
        finally:
            self._waiting.discard(future)
            if direct is not None and not future.done():
                direct.cancel()

    def close(self) -> None:
        """Answer every request waiting with `EndpointClosedError` and stop the calls under way. Idempotent."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for future in list(self._waiting):
            if not future.done():
                future.set_exception(EndpointClosedError("the endpoint closed before this request was generated"))
        self._pending = []

    def _start(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _direct(
        self, prompt: list[int], params: SamplingParams, n: int, future: asyncio.Future, progress: Progress | None
    ) -> None:
        try:
            version, groups = await self._generate([prompt], n, params, progress)
        except Exception as exc:
            _settle(future, exc=exc)
        else:
            _settle(future, (version, groups[0]))

    async def _work(self) -> None:
        await asyncio.sleep(self.GATHER_S)
        while self._pending:
            head = self._pending[0][1]
            same = [p for p in self._pending if p[1] == head and head.seed is None] or [self._pending[0]]
            taken = {id(p) for p in same}
            self._pending = [p for p in self._pending if id(p) not in taken]
            live = [p for p in same if not p[3].done()]  # a request whose caller went away is not generated
            if not live:
                continue
            # Unseeded, each of a request's n completions is a row of its own; seeded, it is alone
            # and asks the backend for n, which seeds each by its sample index. Either way the
            # call's rows are the requests' choices in order.
            n = live[0][2] if head.seed is not None else 1
            rows = [p[0] for p in live for _ in range(p[2] // n)]
            owners = [(p[4], choice) for p in live for choice in range(p[2])]
            try:
                version, groups = await self._generate(rows, n, head, _by_row(owners))
            except Exception as exc:
                for p in live:
                    _settle(p[3], exc=exc)
                continue
            done = [c for group in groups for c in group]
            for _, _, k, future, _ in live:
                _settle(future, (version, done[:k]))
                done = done[k:]


def _by_row(owners: list[tuple[Progress | None, int]]) -> Progress | None:
    """A call's ``progress``: row r's tokens to the request whose choice it is (None: none streams)."""
    if all(progress is None for progress, _ in owners):
        return None

    def report(row: int, ids: list[int]) -> None:
        progress, choice = owners[row]
        if progress is not None:
            progress(choice, ids)

    return report


def _settle(future: asyncio.Future, value: object = None, exc: BaseException | None = None) -> None:
    if future.done():  # its caller went away, or close() answered it
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
